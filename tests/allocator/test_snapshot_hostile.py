"""Bad trace files: hostile pickles, truncations, corruption, wrong types, absurd values.

Every case must raise TraceFormatError (a ValueError) with a useful message, and nothing in a
file may ever run.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import pickletools
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel_graph.allocator.traces import (
    Trace,
    TraceFormatError,
    TraceLimits,
    load_trace,
    save_trace,
)
from accel_graph.allocator.traces.actions import ACTION_CODE as C
from accel_graph.allocator.traces.safe_pickle import safe_loads
from accel_graph.errors import AccelGraphError

MIB = 1 << 20


def small_trace() -> Trace:
    rows = [
        (C["segment_alloc"], 1 << 40, 2 * MIB, 0, 0),
        (C["alloc"], 1 << 40, 100, 0, 0),
        (C["alloc"], (1 << 40) + 512, 600, 0, 0),
        (C["free_requested"], 1 << 40, 100, 0, 0),
        (C["free_completed"], 1 << 40, 100, 0, 0),
    ]
    return Trace.from_events(rows)


def snapshot_dict() -> dict:
    return small_trace().to_snapshot()


def write(tmp_path: Path, data: bytes, name: str = "f") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refused(path: Path, *fragments: str, **kwargs: object) -> str:
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AccelGraphError)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- pickles that would run code --------------------------------------------------------------


class _Pwn:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - this is the attack
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_reduce_to_os_system_is_refused_and_never_runs(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = snapshot_dict()
    payload["segments"].append(_Pwn(marker))
    data = pickle.dumps(payload, protocol=protocol)
    opcodes = {op.name for op, _, _ in pickletools.genops(data)}
    assert "REDUCE" in opcodes and opcodes & {"GLOBAL", "STACK_GLOBAL"}
    message = refused(write(tmp_path, data), "global", "system", "nothing from the file was run")
    assert "posix.system" in message or "os.system" in message or "nt.system" in message
    assert not marker.exists()


def test_global_alone_is_refused(tmp_path: Path) -> None:
    # Even a harmless-looking global is refused: a snapshot never needs one.
    data = pickle.dumps({"segments": [], "device_traces": [], "x": set}, protocol=4)
    refused(write(tmp_path, data), "builtins.set")


def test_inst_opcode_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # protocol 0: MARK, string arg, INST os system -> would call os.system(arg)
    data = b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n."
    refused(write(tmp_path, data), "os.system")
    assert not marker.exists()


def test_persistent_id_is_refused(tmp_path: Path) -> None:
    data = b"\x80\x02X\x03\x00\x00\x00abcQ."  # BINUNICODE 'abc', BINPERSID, STOP
    refused(write(tmp_path, data), "persistent id")


def test_extension_code_is_refused(tmp_path: Path) -> None:
    data = b"\x80\x02\x82\x01."  # EXT1 1: looked up in copyreg's registry, then find_class
    refused(write(tmp_path, data))


def test_build_and_newobj_without_globals_are_refused(tmp_path: Path) -> None:
    # BUILD on a plain dict (no class to call) must not do anything surprising.
    data = b"\x80\x02}q\x00}q\x01X\x01\x00\x00\x00aK\x01sb."
    refused(write(tmp_path, data))


def test_pickle_sets_and_bytes_are_wrong_types(tmp_path: Path) -> None:
    for bad in ({1, 2}, frozenset(), b"raw", bytearray(b"x")):
        snap = snapshot_dict()
        snap["segments"][0]["blocks"][0]["frames"] = [{"filename": bad}]
        refused(write(tmp_path, pickle.dumps(snap, protocol=5)), "frames")


def test_safe_loads_plain_data() -> None:
    obj = {"a": [1, 2.5, None, True, ("t", 3)], "b": {"c": "d"}}
    assert safe_loads(pickle.dumps(obj, protocol=4)) == obj


# --- truncation and corruption ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pickle", "json", "compact"])
def test_truncation_at_every_offset_is_refused(tmp_path: Path, fmt: str) -> None:
    full = tmp_path / "full"
    save_trace(small_trace(), full, format=fmt)
    data = full.read_bytes()
    step = max(1, len(data) // 300)
    offsets = sorted(set(range(0, len(data), step)) | {len(data) - 1, 1, 2, 8, 31, 32})
    for cut in offsets:
        path = write(tmp_path, data[:cut], "cut")
        with pytest.raises(TraceFormatError) as info:
            load_trace(path)
        assert "cut" in str(info.value)
    assert load_trace(full).num_events == 5


def test_compact_corruption_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "t.agt"
    save_trace(small_trace(), path)
    data = bytearray(path.read_bytes())
    payload_at = len(data) - 5 * 48
    for at, fragment in [(payload_at + 9, "events are corrupt"), (40, "header is corrupt"),
                         (9, "version"), (0, "not a memory snapshot")]:  # fmt: skip
        bad = bytearray(data)
        bad[at] ^= 0xFF
        refused(write(tmp_path, bytes(bad)), fragment)
    refused(write(tmp_path, bytes(data) + b"\0"), "trailing bytes")


def test_compact_bad_values_are_refused_even_with_valid_crc(tmp_path: Path) -> None:
    from accel_graph.allocator.traces import compact

    trace = small_trace()
    for field, value, fragment in [
        ("action", 200, "unknown action code 200"),
        ("size", 1 << 60, "absurd size"),
        ("frames", 3, "stack frames it lacks"),
    ]:
        arrays = [trace.events(0).copy()]
        arrays[0][field][1] = value
        data = b"".join(bytes(c) for c in compact.encode({"device_type": "cuda"}, arrays))
        refused(write(tmp_path, data), fragment)


def test_compact_header_lies_are_refused(tmp_path: Path) -> None:
    import zlib

    from accel_graph.allocator.traces import compact

    header = json.dumps({"event_itemsize": 48, "event_counts": [10**12]}).encode()
    fixed = struct.pack("<8sIIQII", b"\x89AGTRACE", 1, len(header), 0, 0, zlib.crc32(header))
    pad = b"\0" * (-(32 + len(header)) % 64)
    refused(write(tmp_path, fixed + header + pad), "exceed the limits")
    header = json.dumps({"event_itemsize": 48, "event_counts": [2]}).encode()
    fixed = struct.pack("<8sIIQII", b"\x89AGTRACE", 1, len(header), 0, 0, zlib.crc32(header))
    pad = b"\0" * (-(32 + len(header)) % 64)
    refused(write(tmp_path, fixed + header + pad), "do not match the payload")
    assert compact.VERSION == 1


# --- wrong types and absurd values ----------------------------------------------------------------


def _mutated(mutate) -> bytes:  # noqa: ANN001
    snap = snapshot_dict()
    mutate(snap)
    return pickle.dumps(snap, protocol=4)


def _set_event(i: int, key: str, value: object):  # noqa: ANN202
    def mutate(s: dict) -> None:
        s["device_traces"][0][i][key] = value

    return mutate


def _del_event(i: int, key: str):  # noqa: ANN202
    def mutate(s: dict) -> None:
        del s["device_traces"][0][i][key]

    return mutate


@pytest.mark.parametrize(
    "mutate,fragment",
    [
        (_set_event(1, "size", -1), "negative value -1"),
        (_set_event(1, "size", "100"), "expected an integer, got str"),
        (_set_event(1, "size", 1.5), "expected an integer, got float"),
        (_set_event(1, "size", True), "expected an integer, got bool"),
        (_set_event(1, "size", 1 << 62), "absurd value"),
        (_set_event(1, "addr", 1 << 70), "absurd value"),
        (_set_event(1, "addr", None), "expected an integer, got NoneType"),
        (_set_event(1, "action", "allocate"), "unknown action 'allocate'"),
        (_set_event(1, "action", 3), "unknown action 3"),
        (_set_event(1, "stream", 1 << 64), "absurd value"),
        (_set_event(1, "time_us", -5), "negative value -5"),
        (_set_event(1, "frames", "not a list"), "frames must be a list"),
        (_set_event(1, "frames", [["nested"]]), "a frame must be a dict"),
        (_set_event(1, "frames", [{"line": [1]}]), "must map a string to a scalar"),
        (_del_event(1, "addr"), "missing 'addr'"),
        (_del_event(1, "size"), "missing 'size'"),
        (lambda s: s["device_traces"][0].__setitem__(0, "event"), "expected an event dict"),
        (lambda s: s.__setitem__("device_traces", {"0": []}), "expected a list"),
        (lambda s: s.__setitem__("segments", "none"), "segments: expected a list"),
        (lambda s: s["segments"][0].__setitem__("total_size", -2), "negative value"),
        (lambda s: s["segments"][0].__delitem__("blocks"), "missing 'blocks'"),
        (lambda s: s["segments"][0]["blocks"][0].__setitem__("size", 2**80), "absurd value"),
        (lambda s: s["segments"][0]["blocks"].append(7), "expected a dict, got int"),
        (lambda s: s.__setitem__("allocator_settings", [1]), "allocator_settings: expected a dict"),
        (lambda s: s.__setitem__("extra", {"k": Exception("x")}), "builtins.Exception"),
    ],
)
def test_wrong_types_and_absurd_values(tmp_path: Path, mutate, fragment: str) -> None:  # noqa: ANN001
    try:
        data = _mutated(mutate)
    except pickle.PicklingError:
        pytest.skip("not picklable")
    refused(write(tmp_path, data), fragment)


def test_not_a_snapshot(tmp_path: Path) -> None:
    refused(write(tmp_path, pickle.dumps({"hello": 1})), "no 'segments' or 'device_traces'")
    refused(write(tmp_path, pickle.dumps("text")), "expected a dict or a list, got str")
    refused(write(tmp_path, pickle.dumps([1, 2])), "segments[0]")


def test_deep_nesting_is_refused(tmp_path: Path) -> None:
    nested: list = []
    for _ in range(200):
        nested = [nested]
    snap = snapshot_dict()
    snap["external_annotations"] = [nested]
    refused(write(tmp_path, pickle.dumps(snap)), "nested deeper")
    text = json.dumps({"segments": [], "x": nested})
    refused(write(tmp_path, ("[" * 100_000 + "]" * 100_000).encode()), "JSON")
    refused(write(tmp_path, text.encode()), "nested deeper")


def test_shared_structure_does_not_blow_up(tmp_path: Path) -> None:
    # 2**40 paths through shared lists: a naive walk would never finish.
    frame = {"filename": "x.py", "line": 1, "name": "f"}
    node: list = [frame]
    for _ in range(40):
        node = [node, node]
    snap = snapshot_dict()
    snap["external_annotations"] = node
    with pytest.raises(TraceFormatError, match="nested deeper"):
        load_trace(write(tmp_path, pickle.dumps(snap)), limits=TraceLimits(max_nesting=30))
    # checked in linear time, and refused: printed in full (inspect --json, a JSON save) it
    # would never end (issue 14: 477 MB of JSON in 60 s from a 12 KB pickle)
    refused(write(tmp_path, pickle.dumps(snap)), "repeats shared objects", "more than 128x")
    # moderate sharing, as torch's frame dicts, loads
    snap["external_annotations"] = [frame] * 100
    trace = load_trace(write(tmp_path, pickle.dumps(snap)))
    assert trace.external_annotations == [frame] * 100
    # one frames list shared by many events is interned once
    frames = [{"filename": "a.py", "line": i, "name": "f"} for i in range(50)]
    snap = snapshot_dict()
    for e in snap["device_traces"][0]:
        e["frames"] = frames
    trace = load_trace(write(tmp_path, pickle.dumps(snap)))
    assert len(trace.stacks) == 1


def test_huge_claimed_lengths_do_not_allocate(tmp_path: Path) -> None:
    data = b"\x80\x04\x8d" + struct.pack("<Q", 1 << 60) + b"abc"  # BINUNICODE8 of 2**60 bytes
    refused(write(tmp_path, data), "truncated")
    data = b"\x80\x04\x95" + struct.pack("<Q", 1 << 60) + b"}."  # FRAME of 2**60 bytes
    refused(write(tmp_path, data))


def test_size_limits(tmp_path: Path) -> None:
    path = tmp_path / "t.pickle"
    save_trace(small_trace(), path)
    refused(path, "byte limit", limits=TraceLimits(max_file_bytes=100))
    refused(path, "events exceed the limit", limits=TraceLimits(max_events=3))
    refused(path, "absurd value", limits=TraceLimits(max_bytes_value=1000))
    compact_path = tmp_path / "t.agt"
    save_trace(small_trace(), compact_path)
    refused(compact_path, "exceed the limits", limits=TraceLimits(max_events=3))


def test_not_a_trace_file(tmp_path: Path) -> None:
    refused(write(tmp_path, b""), "empty")
    refused(write(tmp_path, gzip.compress(pickle.dumps(snapshot_dict()))), "gzip")
    refused(write(tmp_path, b"hello world"), "not a memory snapshot")
    refused(write(tmp_path, b"\x80\x04\xff\xff."), "not a readable pickle")
    refused(write(tmp_path, b"\x80\x04garbage"), "ends early")
    refused(write(tmp_path, b'{"segments": [], "device_traces": [[{"action": "alloc"}]]}'),
            "missing 'addr'")  # fmt: skip
    refused(write(tmp_path, b'{"segments": [], "x": NaN}'), "NaN")
    refused(write(tmp_path, b"\xff\xfe{"), "not a memory snapshot")
    refused(write(tmp_path, b"{\xff}"), "UTF-8")
    refused(tmp_path / "missing.pickle", "cannot read")
    refused(tmp_path, "cannot read")


def test_data_problems_do_not_fail_the_load(tmp_path: Path) -> None:
    snap = snapshot_dict()
    snap["device_traces"][0].append(
        {"action": "free_requested", "addr": 0xBAD000, "size": 1, "stream": 0, "frames": []}
    )
    trace = load_trace(write(tmp_path, pickle.dumps(snap)))
    report = trace.validate()
    assert not report.ok and "never allocated" in report.errors[0]


# --- fuzzing: any byte damage gives a Trace or a TraceFormatError, nothing else ---------------


def _rich_bytes(fmt: str, tmp_path: Path) -> bytes:
    trace = small_trace()
    trace.stacks = [({"filename": "a.py", "line": 1, "name": "f"},)]
    trace.device_traces[0]["frames"][1] = 0
    trace.external_annotations = [{"device": 0, "time_us": 1, "stage": "x"}]
    path = tmp_path / f"seed.{fmt}"
    save_trace(trace, path, format=fmt)
    return path.read_bytes()


@pytest.mark.parametrize("fmt", ["pickle", "json", "compact"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_bytes_never_escape(tmp_path: Path, fmt: str, data: st.DataObject) -> None:
    seed = bytearray(_rich_bytes(fmt, tmp_path))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(seed) - 1))
        seed[at] = data.draw(st.integers(0, 255))
    path = write(tmp_path, bytes(seed), "fuzzed")
    try:
        trace = load_trace(path)
    except TraceFormatError:
        return
    trace.validate()  # whatever loads must also be safe to use
    trace.to_snapshot()


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        | st.tuples(inner, inner)
    ),
    max_leaves=6,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    where=st.sampled_from(["event", "segment", "block", "top", "frame"]),
    key=st.sampled_from(
        ["action", "addr", "size", "stream", "time_us", "frames", "device_free", "pool_id",
         "address", "total_size", "blocks", "device", "state", "requested_size",
         "segment_pool_id", "segments", "device_traces", "allocator_settings", "line"]
    ),
    value=_values,
)  # fmt: skip
def test_fuzzed_structure_never_escapes(
    tmp_path: Path, where: str, key: str, value: object
) -> None:
    snap = snapshot_dict()
    snap["device_traces"][0][1]["frames"] = [{"filename": "a.py", "line": 1, "name": "f"}]
    target = {
        "event": snap["device_traces"][0][1],
        "segment": snap["segments"][0],
        "block": snap["segments"][0]["blocks"][0],
        "top": snap,
        "frame": snap["device_traces"][0][1]["frames"][0],
    }[where]
    target[key] = value
    path = write(tmp_path, pickle.dumps(snap, protocol=4), "fuzzed.pickle")
    try:
        trace = load_trace(path)
    except TraceFormatError:
        return
    trace.validate()
    trace.to_snapshot()
    save_trace(trace, tmp_path / "again.pickle")
    load_trace(tmp_path / "again.pickle")  # (no ==: a NaN never equals itself)
    try:
        save_trace(trace, tmp_path / "again.agt")
    except ValueError as e:
        assert "save it as a pickle instead" in str(e)
        return
    load_trace(tmp_path / "again.agt")
