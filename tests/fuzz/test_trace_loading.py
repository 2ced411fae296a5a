"""Fuzz: mutated and structurally hostile traces through ``load_trace`` and every
``accel-alloc`` command (issue 14).

Every outcome is a loaded trace or a :class:`TraceFormatError`; every command exits with a
documented code (never 70, an internal error); hostile files cost memory in proportion to their
size. Bounded (derandomized, few examples) so the file adds a few seconds to CI.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel_graph.allocator.traces import Trace, TraceFormatError, load_trace, save_trace
from accel_graph.allocator.traces.actions import ACTION_CODE as C
from accel_graph.cli.alloc.main import main

#: accel-alloc's documented exit codes (docs/accel-alloc.md); 70 (internal error) is a bug.
DOCUMENTED = {0, 1, 2, 3, 4, 5, 6, 7}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip
MIB = 1 << 20


def _tiny() -> Trace:
    rows = [(C["segment_alloc"], 1 << 40, 2 * MIB, 0, 0), (C["alloc"], 1 << 40, 100, 0, 0),
            (C["alloc"], (1 << 40) + 512, 600, 1, 0), (C["free_requested"], 1 << 40, 100, 0, 0),
            (C["free_completed"], 1 << 40, 100, 0, 0)]  # fmt: skip
    return Trace.from_events(rows)


_SNAP = _tiny().to_snapshot()
_RMM = (b"Thread,Time,Action,Pointer,Size,Stream\n1,0.000001,allocate,0x7f0000000000,1024,0x0\n"
        b"1,0.000002,free,0x7f0000000000,1024,0x0\n")


def _valid_files(tmp: Path) -> dict[str, bytes]:
    out = {"rmm": _RMM}
    for fmt in ("pickle", "json", "compact"):
        path = tmp / f"t.{fmt}"
        save_trace(_tiny(), path, format=fmt)
        out[fmt] = path.read_bytes()
    return out


def _run(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    assert len(out.getvalue()) < 4 * MIB  # output in proportion to a tiny input
    return code


def _commands(path: Path) -> list[list[str]]:
    p = str(path)
    return [["inspect", p, "--json"], ["inspect", p], ["simulate", p, "--json"],
            ["validate", p, "--json"], ["diff", p, p, "--json"],
            ["tune", p, "--json", "--budget", "2"],
            ["plot", p, "-o", str(path.parent / "o.svg")]]  # fmt: skip


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _valid_files(tmp_path_factory.mktemp("valid"))


@FUZZ
@given(fmt=st.sampled_from(["pickle", "json", "compact", "rmm"]), data=st.data())
def test_mutated_bytes_load_or_raise_trace_format_error(
    tmp_path: Path, valid: dict[str, bytes], fmt: str, data: st.DataObject
) -> None:
    blob = bytearray(valid[fmt])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob)))
        how = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "repeat"]))
        if how == "flip" and at < len(blob):
            blob[at] ^= data.draw(st.integers(1, 255))
        elif how == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=9))
        elif how == "delete":
            del blob[at : at + data.draw(st.integers(1, 16))]
        elif how == "truncate":
            del blob[at:]
        else:
            blob[at:at] = blob[at : at + 32] * data.draw(st.integers(2, 64))
    path = tmp_path / "m"
    path.write_bytes(bytes(blob))
    try:
        load_trace(path)
    except TraceFormatError:
        pass


_HOSTILE = st.one_of(
    st.sampled_from([None, True, -1, 1 << 63, 1 << 64, 10**5000, -(10**5000), math.nan,
                     math.inf, "", "0x10", "x" * 5000, (1, 2, 3), (1 << 70, 0), [], {}]),
    st.integers(), st.floats(), st.text(max_size=20),
    st.recursive(st.integers(-3, 3) | st.text(max_size=3),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                     max_size=3),
                 max_leaves=8),
)  # fmt: skip


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every (container path, key) in a snapshot, to put a hostile value at."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


_SNAP_PATHS = _paths(_SNAP)


@settings(FUZZ, max_examples=50)
@given(where=st.sampled_from(_SNAP_PATHS), value=_HOSTILE,
       share=st.integers(0, 12), fmt=st.sampled_from(["pickle", "json"]))
def test_structurally_hostile_snapshots_exit_with_documented_codes(
    tmp_path: Path, where: tuple, value: object, share: int, fmt: str
) -> None:
    snap = pickle.loads(pickle.dumps(_SNAP))
    parent = snap
    for k in where[:-1]:
        parent = parent[k]
    for _ in range(share):  # memo-shared nesting: 2**share paths through one object
        value = [value, value]
    parent[where[-1]] = value
    path = tmp_path / "h"
    try:
        path.write_bytes(pickle.dumps(snap) if fmt == "pickle"
                         else json.dumps(snap, default=list).encode())
    except (ValueError, TypeError):  # JSON cannot hold it (10**5000 is fine, tuples become lists)
        return
    try:
        load_trace(path)
    except TraceFormatError:
        pass
    for argv in _commands(path):
        code = _run(argv)
        assert code in DOCUMENTED, (argv, code, where, repr(value)[:200])


def _hostile_files() -> dict[str, bytes]:
    """Files built to cost memory or time out of proportion to their size."""
    events = _SNAP["device_traces"][0]
    node: list = ["x" * 40]
    for _ in range(60):
        node = [node, node]
    return {
        "memo index 2**26": b"\x80\x02N" + b"r" + (1 << 26).to_bytes(4, "little") + b".",
        # (small, as tracemalloc slows the opcode scan tenfold; tools/trace_bombs.py measures
        # the full-size files)
        "256 Ki empty dicts": b"\x80\x04](" + b"}" * (256 << 10) + b"e.",
        "128 Ki refs to one event": pickle.dumps({"segments": [],
                                                 "device_traces": [[events[1]] * (128 << 10)]}),
        "one event list x 4096 devices": pickle.dumps({"segments": [],
                                                      "device_traces": [events * 400] * 4096}),
        "settings shared 2**60 ways": pickle.dumps(dict(_SNAP, allocator_settings={"x": node})),
        "4 MiB string": pickle.dumps({"segments": [], "device_traces": [], "x": "y" * (4 << 20)}),
    }


@pytest.mark.parametrize("name", list(_hostile_files()))
def test_hostile_files_cost_memory_in_proportion(tmp_path: Path, name: str) -> None:
    data = _hostile_files()[name]
    path = tmp_path / "h.pkl"
    path.write_bytes(data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load_trace(path)
    except TraceFormatError:
        pass
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # generous guards (the numbers measured are in docs/traces.md): 2x the 10x + 64 MiB
    assert peak < 20 * len(data) + 128 * MIB, (name, peak)
    assert seconds < 60, (name, seconds)


def _measure(data: bytes, tmp: Path) -> tuple[int, int, float, str]:
    """Load ``data`` in a fresh interpreter: (peak RSS after import, its growth during the
    load, in bytes; seconds; outcome). The import's own peak hides smaller loads (growth 0)."""
    import subprocess
    import sys

    path = tmp / "h"
    path.write_bytes(data)
    script = (
        "import resource, time, sys\n"
        "from accel_graph.allocator.traces import load_trace, TraceFormatError\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t = time.perf_counter()\n"
        "try:\n    load_trace(sys.argv[1]); out = 'loaded'\n"
        "except TraceFormatError as e:\n    out = 'refused: ' + str(e).split(': ', 1)[1][:60]\n"
        "t = time.perf_counter() - t\n"
        "print(base * 1024, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024,"
        " t, out)\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, check=True)
    base, grown, seconds, outcome = run.stdout.split(" ", 3)
    return int(base), int(grown), float(seconds), outcome.strip()


def _full_size_files() -> dict[str, bytes]:
    """The worst cases at about 16 MiB (the issue's bound is for files under 16 MiB)."""
    events = _SNAP["device_traces"][0]
    n = 15 << 20
    budget = (16 * (16 << 20) + (48 << 20) - 2 * n) // 88  # empty dicts the estimate admits
    files = {name: data for name, data in _hostile_files().items() if len(data) < 1 << 20}
    genuine = Path(__file__).resolve().parents[2] / "shared/traces/npu/snapshot_expandable.pkl"
    for path in (genuine, Path("/work/shared/traces/npu/snapshot_expandable.pkl")):
        if path.exists():
            files["genuine: NPU snapshot_expandable.pkl"] = path.read_bytes()
            break
    files.update({
        "memo index 2**32-1": b"\x80\x02N" + b"r" + b"\xff\xff\xff\xff" + b".",
        "16 Mi empty dicts (pickle)": b"\x80\x04](" + b"}" * (16 << 20) + b"e.",
        "8 Mi refs to one event (pickle)": pickle.dumps(
            {"segments": [], "device_traces": [[events[1]] * (8 << 20)]}),
        "15 MiB string + most dicts admitted": b"\x80\x04}(\x8c\x01x" + pickle.dumps(
            "y" * n)[2:-1] + b"\x8c\x01z](" + b"}" * budget + b"eu.",
        "5.3 Mi empty dicts (JSON)": b'{"segments": [], "device_traces": [['
        + b"{}," * ((16 << 20) // 3) + b"{}]]}",
        "JSON just under the estimate": b'{"segments": [], "x": ['
        + b"{}," * ((48 << 20) // 64) + b'{}]}',
    })  # fmt: skip
    return files


if __name__ == "__main__":  # python -m tests.fuzz.test_trace_loading: the table in docs/traces.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print("| file | bytes | peak RSS growth (MiB) | growth / size | seconds | outcome |")
        print("|---|---:|---:|---:|---:|---|")
        for name, data in _full_size_files().items():
            base, grown, seconds, outcome = _measure(data, Path(tmp))
            print(f"| {name} | {len(data):,} | {grown / MIB:.1f} | {grown / len(data):.1f} "
                  f"| {seconds:.2f} | {outcome} |")
        print(f"\npeak RSS after import: {base / MIB:.0f} MiB")
