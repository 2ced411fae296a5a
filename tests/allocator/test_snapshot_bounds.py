"""Issue 14, items 5-8: trace loading stays in proportion to the file, and every malformed field
is a TraceFormatError (never an internal error)."""

from __future__ import annotations

import copy
import csv
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import TraceFormatError, TraceLimits, load_trace
from accel_graph.allocator.traces.rmm_csv import read_rmm_csv


def _write(tmp_path: Path, data: bytes, name: str = "t.pkl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _snapshot() -> dict:
    return generate("frag", seed=0).to_snapshot()


@pytest.mark.parametrize("put", [b"r" + (1 << 26).to_bytes(4, "little"), b"p67108864\n",
                                 b"r" + (0xFFFFFFFF).to_bytes(4, "little")])
def test_memo_index_beyond_the_file_is_refused_before_unpickling(tmp_path: Path, put: bytes) -> None:
    data = b"\x80\x02N" + put + b"."  # 9 bytes that made CPython zero-fill 1 GiB of memo
    with pytest.raises(TraceFormatError, match="memo index"):
        load_trace(_write(tmp_path, data))


def test_decoded_size_is_bounded_by_the_file_size(tmp_path: Path) -> None:
    # a list of 4 million empty dicts: 4 MiB of file, 300 MiB of objects
    data = b"\x80\x04]" + b"(" + b"}" * (4 << 20) + b"e."
    with pytest.raises(TraceFormatError, match="would build about"):
        load_trace(_write(tmp_path, data))
    from accel_graph.allocator.traces.safe_pickle import scan_pickle

    est, top = scan_pickle(data)
    assert est > 16 * len(data) and top == -1


def test_genuine_pickles_are_well_within_the_estimate() -> None:
    from accel_graph.allocator.traces.safe_pickle import scan_pickle

    trace = generate("train", seed=0)
    for protocol in (2, 4, 5):
        data = pickle.dumps(trace.to_snapshot(), protocol=protocol)
        est, top = scan_pickle(data)
        assert est < TraceLimits().max_decode_expansion * len(data) and top < len(data)


def test_shared_event_lists_do_not_multiply(tmp_path: Path) -> None:
    snap = _snapshot()
    events = snap["device_traces"][0]
    snap["device_traces"] = [events] * 4096  # one list by reference: 4096x the events
    with pytest.raises(TraceFormatError, match="more than once by reference"):
        load_trace(_write(tmp_path, pickle.dumps(snap)))
    snap["device_traces"] = [[events[0]] * 1000]  # one event dict by reference
    with pytest.raises(TraceFormatError, match="more than once by reference"):
        load_trace(_write(tmp_path, pickle.dumps(snap)))


def test_a_small_trace_loads_under_a_3_gib_address_space_limit(tmp_path: Path) -> None:
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under AddressSanitizer (tools/asan.sh) the shadow memory alone exceeds any "
                    "address-space limit")
    path = tmp_path / "t.pkl"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    script = textwrap.dedent(f"""
        import resource
        from accel_graph.allocator.traces import load_trace
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        print(load_trace({str(path)!r}).num_events)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "0", run.stderr[-2000:]


def _mutated(mutate) -> dict:  # noqa: ANN001
    snap = copy.deepcopy(_SNAP)
    mutate(snap)
    return snap


_SNAP = _snapshot()


def _block(s: dict) -> dict:
    seg = next(seg for seg in s["segments"] if len(seg["blocks"]) > 1)
    return seg["blocks"][0]


def _set(getter, key, value):  # noqa: ANN001, ANN202
    return lambda s: getter(s).__setitem__(key, value)


@pytest.mark.parametrize("mutate, fragment", [
    (_set(lambda s: s["device_traces"][0][1], "size", 10**5000), "an integer of"),
    (_set(lambda s: s["segments"][0], "address", -(10**5000)), "an integer of"),
    (_set(lambda s: s["segments"][0], "address", 1 << 63), "absurd value"),
    (lambda s: _block(s).pop("address"), "missing 'address'"),
    (_set(_block, "address", "0x10"), "expected an integer"),
    (_set(_block, "address", float("nan")), "expected an integer"),
    (_set(_block, "address", -5), "negative value -5"),
    (_set(_block, "address", 1 << 63), "absurd value"),
    (_set(lambda s: s["segments"][0], "segment_pool_id", "x"), "segment_pool_id"),
    (_set(lambda s: s["segments"][0], "segment_pool_id", (1, 2, 3)), "segment_pool_id"),
    (_set(lambda s: s["segments"][0], "segment_pool_id", (1.5, 2)), "segment_pool_id"),
    (_set(lambda s: s["segments"][0], "segment_pool_id", (1 << 70, 2)), "segment_pool_id"),
])  # fmt: skip
def test_malformed_fields_are_trace_format_errors(tmp_path: Path, mutate, fragment: str) -> None:  # noqa: ANN001
    path = _write(tmp_path, pickle.dumps(_mutated(mutate), protocol=4))
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert fragment in str(info.value) and len(str(info.value)) < 1000, str(info.value)[:2000]


def test_legacy_blocks_without_addresses_tile_their_segment() -> None:
    from accel_graph.allocator.traces import Trace

    seg = {"address": 4096, "total_size": 3072, "stream": 0,
           "blocks": [{"size": 1024, "state": "active_allocated"},
                      {"size": 2048, "state": "inactive"}]}  # fmt: skip
    t = Trace.from_snapshot([seg])
    assert [b["address"] for b in t.segments[0]["blocks"]] == [4096, 5120]
    assert "address" not in seg["blocks"][0]  # the input is not changed


def test_rmm_csv_field_over_the_csv_limit_is_a_trace_format_error() -> None:
    big = "x" * (csv.field_size_limit() + 10)
    data = f"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x10,\"{big}\",0\n".encode()
    with pytest.raises(TraceFormatError, match="not a readable RMM log CSV"):
        read_rmm_csv(data, "log.csv")
    data = ("Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x10," + "9" * 5000
            + ",0\n").encode()
    with pytest.raises(TraceFormatError, match="not an integer") as info:
        read_rmm_csv(data, "log.csv")
    assert len(str(info.value)) < 300


def test_dense_json_is_refused_before_decoding(tmp_path: Path) -> None:
    data = b'{"segments": [], "device_traces": [[' + b"{}," * (2 << 20) + b"{}]]}"
    with pytest.raises(TraceFormatError, match="bytes of JSON would build"):
        load_trace(_write(tmp_path, data, "t.json"))
