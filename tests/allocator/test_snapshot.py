"""Snapshot traces: the NPU recordings, every format's round trip, engine events, memory_viz."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.alloc_conf import parse_config
from accel_graph.allocator.traces import (
    TRACE_DTYPE,
    Trace,
    load_trace,
    save_trace,
)
from accel_graph.allocator.traces.actions import ACTION_CODE as C

MIB = 1 << 20
NPU = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "npu"
needs_npu = pytest.mark.skipif(
    not (NPU / "SHA256SUMS").exists(), reason=f"NPU traces not found at {NPU} (../shared absent)"
)

# From shared/traces/npu/README.md: events by action per file (device 0 unless noted).
NPU_COUNTS = {
    "snapshot_1768383987920985470.pkl": {
        "alloc": 3216, "free_requested": 3216, "free_completed": 3216, "segment_alloc": 52},
    "snapshot_expandable.pkl": {
        "alloc": 2899, "free_requested": 2574, "free_completed": 2574, "segment_map": 45},
    "snapshot_with_empty_cache.pkl": {
        "alloc": 2899, "free_requested": 2574, "free_completed": 2574, "segment_alloc": 79,
        "segment_free": 54},
    "snapshot_with_empty_cache_expandable.pkl": {
        "alloc": 2899, "free_requested": 2574, "free_completed": 2574, "segment_map": 75,
        "segment_unmap": 10},
}  # fmt: skip


def npu_files() -> list[str]:
    return sorted(NPU_COUNTS) + ["snapshot_with_multi_devices.pkl"]


def _strip_meta(snapshot: dict) -> dict:
    snapshot = dict(snapshot)
    snapshot.pop("accel_graph", None)
    return snapshot


# --- the real Ascend NPU recordings ----------------------------------------------------------


@needs_npu
def test_npu_files_are_the_reviewed_bytes() -> None:
    for line in (NPU / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((NPU / name.lstrip("*")).read_bytes()).hexdigest() == digest


@needs_npu
@pytest.mark.parametrize("name", sorted(NPU_COUNTS))
def test_npu_file_loads(name: str) -> None:
    trace = load_trace(NPU / name)
    assert trace.device_type == "npu"
    assert trace.action_counts(0) == NPU_COUNTS[name]
    assert not trace.has_time  # these recordings carry no time_us
    assert trace.allocator_settings is None
    report = trace.validate()
    assert report.ok, report.errors[:5]


@needs_npu
def test_npu_multi_device_is_the_two_single_device_files() -> None:
    multi = load_trace(NPU / "snapshot_with_multi_devices.pkl")
    assert multi.devices == [0, 1]
    assert len(multi.device_traces) == 8
    a = load_trace(NPU / "snapshot_with_empty_cache_expandable.pkl")
    b = load_trace(NPU / "snapshot_1768383987920985470.pkl")
    for field in ("action", "addr", "size", "stream"):
        assert np.array_equal(multi.events(0)[field], a.events(0)[field])
        assert np.array_equal(multi.events(1)[field], b.events(0)[field])


@needs_npu
def test_npu_twins_record_the_same_alloc_free_sequence() -> None:
    names = [
        "snapshot_expandable.pkl",
        "snapshot_with_empty_cache.pkl",
        "snapshot_with_empty_cache_expandable.pkl",
    ]
    seqs = []
    for name in names:
        e = load_trace(NPU / name).events(0)
        keep = np.isin(e["action"], [C["alloc"], C["free_requested"], C["free_completed"]])
        seqs.append(e[keep][["action", "size"]])
    assert len(seqs[0]) == 8047
    assert all(np.array_equal(seqs[0], s) for s in seqs[1:])


@needs_npu
@pytest.mark.parametrize("name", npu_files())
def test_npu_pickle_round_trip_is_exact(name: str, tmp_path: Path) -> None:
    original = pickle.loads((NPU / name).read_bytes())
    trace = load_trace(NPU / name)
    assert _strip_meta(trace.to_snapshot()) == original
    save_trace(trace, tmp_path / "out.pickle")
    again = load_trace(tmp_path / "out.pickle")
    assert again == trace
    with open(tmp_path / "out.pickle", "rb") as f:
        assert _strip_meta(pickle.load(f)) == original


@needs_npu
@pytest.mark.parametrize("fmt", ["json", "compact"])
def test_npu_other_formats_round_trip(fmt: str, tmp_path: Path) -> None:
    trace = load_trace(NPU / "snapshot_with_multi_devices.pkl")
    save_trace(trace, tmp_path / "out", format=fmt)
    again = load_trace(tmp_path / "out")
    if fmt == "json":
        assert again == trace
    else:  # compact keeps no frames
        for d in range(len(trace.device_traces)):
            expect = trace.events(d).copy()
            expect["frames"] = -1
            assert np.array_equal(again.events(d), expect)
        assert again.device_type == "npu"
        assert _strip_meta(again.to_snapshot()) == _strip_meta(trace.to_snapshot(frames=False))


# --- synthetic traces: every format, every field ----------------------------------------------


def rich_trace() -> Trace:
    """A trace using every feature: frames, time, oom, pools, extras, annotations, two devices."""
    snapshot = {
        "segments": [
            {
                "device": 0, "address": 1 << 40, "total_size": 2 * MIB, "allocated_size": 512,
                "active_size": 512, "requested_size": 100, "stream": 0, "segment_type": "small",
                "segment_pool_id": (0, 0), "is_expandable": False,
                "frames": [{"filename": "a.py", "line": 1, "name": "f"}],
                "blocks": [
                    {"address": 1 << 40, "size": 512, "requested_size": 100,
                     "state": "active_allocated", "frames": []},
                    {"address": (1 << 40) + 512, "size": 2 * MIB - 512, "requested_size": 0,
                     "state": "inactive", "frames": []},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "segment_alloc", "addr": 1 << 40, "size": 2 * MIB, "stream": 0,
                 "time_us": 10, "frames": [{"filename": "a.py", "line": 1, "name": "f"}]},
                {"action": "alloc", "addr": 1 << 40, "size": 100, "stream": 0, "time_us": 11,
                 "frames": [{"filename": "a.py", "line": 2, "name": "g"},
                            {"filename": "b.py", "line": 3, "name": "h"}],
                 "compile_context": "N/A", "user_metadata": ""},
                {"action": "oom", "device_free": 4096, "size": 64 * MIB, "stream": 0,
                 "time_us": 12, "frames": []},
                {"action": "snapshot", "addr": 0, "size": 512, "stream": 0, "time_us": 13,
                 "frames": [], "pool_id": 3},
            ],
            [],
            [
                {"action": "segment_map", "addr": 2 << 40, "size": 20 * MIB, "stream": 5,
                 "time_us": 20, "frames": []},
                {"action": "segment_unmap", "addr": 2 << 40, "size": 20 * MIB, "stream": 5,
                 "time_us": 21, "frames": []},
            ],
        ],
        "allocator_settings": parse_config("max_split_size_mb:200").to_snapshot_dict(),
        "external_annotations": [{"device": 0, "time_us": 11, "stage": "forward"}],
        "some_future_key": {"x": [1, 2, 3]},
    }  # fmt: skip
    return Trace.from_snapshot(snapshot)


def test_rich_trace_model() -> None:
    t = rich_trace()
    assert t.num_events == 6
    assert t.devices == [0, 2]
    assert t.has_time
    assert len(t.stacks) == 2
    oom = t.events(0)[2]
    assert oom["action"] == C["oom"] and oom["addr"] == 4096  # device_free lives in addr
    assert t.event_extras[(0, 1)] == {"compile_context": "N/A", "user_metadata": ""}
    assert t.events(0)[3]["pool"] == 3
    assert t.extra == {"some_future_key": {"x": [1, 2, 3]}}
    assert t.events(7).shape == (0,)
    assert t.action_counts() == {
        "alloc": 1, "segment_alloc": 1, "segment_map": 1, "segment_unmap": 1, "oom": 1,
        "snapshot": 1}  # fmt: skip


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_round_trip(fmt: str, tmp_path: Path) -> None:
    t = rich_trace()
    t.device_type = "xpu"
    save_trace(t, tmp_path / "t", format=fmt)
    again = load_trace(tmp_path / "t")
    assert again == t
    assert again.to_snapshot() == t.to_snapshot()


def test_round_trip_compact(tmp_path: Path) -> None:
    t = rich_trace()
    t.device_type = "rocm"
    save_trace(t, tmp_path / "t.agt")
    again = load_trace(tmp_path / "t.agt")
    assert again.device_type == "rocm"
    assert again.extra == t.extra
    assert again.event_extras == {}  # per-event extras, like frames, are not kept
    for d in range(3):
        e = t.events(d).copy()
        e["frames"] = -1
        assert np.array_equal(again.events(d), e)
    assert again.segments[0]["segment_pool_id"] == (0, 0)
    assert again.allocator_settings == t.allocator_settings
    assert again.external_annotations == t.external_annotations


def test_suffix_picks_format(tmp_path: Path) -> None:
    t = rich_trace()
    save_trace(t, tmp_path / "a.json")
    save_trace(t, tmp_path / "a.agt")
    save_trace(t, tmp_path / "a.pickle")
    assert (tmp_path / "a.json").read_bytes()[:1] == b"{"
    assert (tmp_path / "a.agt").read_bytes()[:8] == b"\x89AGTRACE"
    assert (tmp_path / "a.pickle").read_bytes()[:1] == b"\x80"
    with pytest.raises(ValueError, match="format must be"):
        save_trace(t, tmp_path / "a", format="xml")


def test_failed_save_keeps_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "keep.pickle"
    target.write_bytes(b"precious")
    bad = rich_trace()
    bad.extra["oops"] = {1.5: float("nan")}  # json refuses NaN
    with pytest.raises(ValueError):
        save_trace(bad, target, format="json")
    assert target.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.pickle"]


def test_legacy_list_format(tmp_path: Path) -> None:
    segments = rich_trace().segments
    (tmp_path / "legacy.pickle").write_bytes(pickle.dumps(segments))
    t = load_trace(tmp_path / "legacy.pickle")
    assert t.segments == segments and t.num_events == 0


def test_legacy_history_blocks_are_kept() -> None:
    seg = {"address": 0, "total_size": 1024, "stream": 0,
           "blocks": [{"size": 1024, "state": "active_allocated",
                       "history": [{"addr": 0, "real_size": 1000, "frames": []}]}]}  # fmt: skip
    t = Trace.from_snapshot([seg])
    assert t.segments[0]["blocks"][0]["history"][0]["real_size"] == 1000


def test_device_type_override(tmp_path: Path) -> None:
    save_trace(rich_trace(), tmp_path / "t.pickle")
    assert load_trace(tmp_path / "t.pickle", device_type="xpu").device_type == "xpu"
    with pytest.raises(ValueError):
        load_trace(tmp_path / "t.pickle", device_type="tpu")


# --- engine events ----------------------------------------------------------------------------

BASE = 0x7F00_0000_0000


def engine_events() -> list[tuple[int, int, int, int, int, int]]:
    """(action, addr, size, stream, pool, seq), deliberately out of seq order."""
    return [
        (C["alloc"], BASE, 3 * MIB, 0, 0, 1),
        (C["segment_alloc"], BASE, 20 * MIB, 0, 0, 0),
        (C["alloc"], BASE + 3 * MIB, 1000, 0, 0, 2),
        (C["free_requested"], BASE, 3 * MIB, 0, 0, 3),
        (C["free_completed"], BASE, 3 * MIB, 0, 0, 4),
        (C["oom"], 123456, 40 * MIB, 0, 0, 5),
        (C["segment_map"], BASE - 64 * MIB, 40 * MIB, 1, 0, 6),
        (C["alloc"], BASE - 64 * MIB, 30 * MIB, 1, 0, 7),
        (C["segment_map"], BASE - 24 * MIB, 20 * MIB, 1, 0, 8),
        (C["segment_unmap"], BASE - 34 * MIB, 20 * MIB, 1, 0, 9),
    ]


def test_from_events_orders_by_seq_and_derives_segments() -> None:
    t = Trace.from_events(engine_events(), device=1, device_type="cuda")
    assert t.devices == [1]
    assert t.events(1)["action"][0] == C["segment_alloc"]
    assert t.validate().ok
    segs = {s["address"]: s for s in t.segments}
    assert set(segs) == {BASE - 64 * MIB, BASE - 14 * MIB, BASE}
    for s in t.segments:  # blocks tile each segment exactly
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert s["device"] == 1
    assert segs[BASE]["allocated_size"] == 1024 and segs[BASE]["requested_size"] == 1000
    assert segs[BASE - 64 * MIB]["is_expandable"]
    assert segs[BASE - 64 * MIB]["total_size"] == 30 * MIB  # unmap cut the mapped range


def test_from_events_accepts_engine_arrays() -> None:
    # The engine drains (seq, addr, size, pool_id, stream, action) records.
    engine_dtype = np.dtype(
        [("seq", "<i8"), ("addr", "<u8"), ("size", "<u8"), ("pool_id", "<i8"),
         ("stream", "<i4"), ("action", "<i4")]
    )  # fmt: skip
    rows = engine_events()
    arr = np.array([(r[5], r[1], r[2], r[4], r[3], r[0]) for r in rows], dtype=engine_dtype)
    a = Trace.from_events(arr)
    b = Trace.from_events(rows)
    assert a == b
    own = Trace.from_events(a.events(0))
    assert own == a


@pytest.mark.parametrize(
    "rows",
    [
        [(99, 0, 0, 0, 0)],
        [(-1, 0, 0, 0, 0)],
        [(0, -5, 0, 0, 0)],
        [(0, 0, 1 << 64, 0, 0)],
        [(0, 0, 0)],
    ],
)
def test_from_events_rejects_bad_rows(rows: list[tuple[int, ...]]) -> None:
    with pytest.raises(ValueError):
        Trace.from_events(rows)


# --- torch's own viewer ---------------------------------------------------------------------

_VIZ_SCRIPT = """
import contextlib, io, runpy, sys
for command, path in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["_memory_viz", command, path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
    sys.__stdout__.write(out.getvalue() + "\\n=====\\n")
"""


def memory_viz(*runs: tuple[str, Path]) -> list[str]:
    """Run ``python -m torch.cuda._memory_viz COMMAND FILE`` for each run, in one subprocess
    (importing torch takes seconds), and return each run's output."""
    args = [str(x) for run in runs for x in run]
    result = subprocess.run(
        [sys.executable, "-c", _VIZ_SCRIPT, *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.split("\n=====\n")[:-1]
    assert len(outputs) == len(runs)
    return outputs


def test_saved_pickles_open_in_memory_viz(tmp_path: Path) -> None:
    engine = Trace.from_events(
        engine_events(),
        allocator_settings=parse_config("expandable_segments:True").to_snapshot_dict(),
    )
    save_trace(engine, tmp_path / "engine.pickle")
    save_trace(rich_trace(), tmp_path / "rich.pickle")
    (tmp_path / "legacy.pickle").write_bytes(pickle.dumps(rich_trace().segments))
    runs = [
        ("stats", tmp_path / "engine.pickle"),
        ("trace", tmp_path / "engine.pickle"),
        ("trace", tmp_path / "rich.pickle"),
        ("stats", tmp_path / "legacy.pickle"),
    ]
    if (NPU / "SHA256SUMS").exists():
        save_trace(load_trace(NPU / "snapshot_with_empty_cache.pkl"), tmp_path / "npu.pickle")
        runs += [("stats", tmp_path / "npu.pickle"), ("trace", tmp_path / "npu.pickle")]
    out = memory_viz(*runs)
    assert "segments: 3" in out[0] and "total_reserved: 60.0MiB" in out[0]
    assert "10 entries" in out[1] and "cudaMalloc(" in out[1]
    assert "raise OutOfMemoryError # 64.0MiB requested, 4.0KiB free" in out[2]
    assert "segments: 1" in out[3]
    if len(out) > 4:
        assert "segments: 34" in out[4]
        assert "8180 entries" in out[5]


# --- validate() -------------------------------------------------------------------------------


def _trace(rows: list[tuple[int, int, int]], segments: list[dict] | None = None) -> Trace:
    return Trace.from_events([(a, addr, size, 0, 0) for a, addr, size in rows], segments=segments)


def test_validate_reports_frees_of_never_allocated_addresses() -> None:
    t = _trace([(C["segment_alloc"], BASE, 2 * MIB), (C["free_requested"], 0xDEAD000, 512)])
    report = t.validate()
    assert not report.ok
    assert "never allocated" in report.errors[0]


def test_validate_double_free_and_orphan_completion() -> None:
    t = _trace(
        [
            (C["segment_alloc"], BASE, 2 * MIB),
            (C["alloc"], BASE, 512),
            (C["free_requested"], BASE, 512),
            (C["free_completed"], BASE, 512),
            (C["free_requested"], BASE, 512),
            (C["free_completed"], BASE + 4096, 512),
            (C["alloc"], BASE + 512, 512),
            (C["alloc"], BASE + 512, 512),
        ]
    )
    errors = t.validate().errors
    assert any("double free" in e for e in errors)
    assert any("without a free_requested" in e for e in errors)
    assert any("allocates over a live block" in e for e in errors)


def test_validate_counts_pre_existing_blocks() -> None:
    # A mid-run recording frees a block allocated before it began, inside a known segment.
    seg = Trace.from_events([(C["segment_alloc"], BASE, 2 * MIB, 0, 0)]).segments
    t = _trace([(C["free_requested"], BASE, 512), (C["free_completed"], BASE, 512)], seg)
    report = t.validate()
    assert report.ok and report.pre_existing_frees == 1


def test_validate_caps_messages() -> None:
    rows = [(C["free_requested"], 0x1000 * (i + 1), 512) for i in range(500)]
    report = _trace(rows).validate(max_messages=10)
    assert len(report.errors) == 10 and report.truncated == 490


# --- scale --------------------------------------------------------------------------------------


def test_compact_million_events(tmp_path: Path) -> None:
    n = 1_000_000
    rng = np.random.default_rng(0)
    a = np.zeros(n, TRACE_DTYPE)
    a["action"] = rng.integers(0, 3, n)
    a["addr"] = rng.integers(0, 1 << 47, n)
    a["size"] = rng.integers(1, 1 << 30, n)
    a["time_us"] = np.arange(n)
    a["frames"] = -1
    t = Trace([a], device_type="cuda")
    save_trace(t, tmp_path / "big.agt")
    assert (tmp_path / "big.agt").stat().st_size < 49 * 10**6
    again = load_trace(tmp_path / "big.agt")
    assert again == t


# --- the C engine's own events and layout ---------------------------------------------------------


def _engine():  # noqa: ANN202
    engine_mod = pytest.importorskip("accel_graph.allocator.core.engine")
    try:
        return engine_mod.Engine, engine_mod.EngineSettings
    except AttributeError:
        pytest.skip("engine API not available")


@pytest.mark.parametrize("config", ["max_split_size_mb:200", "expandable_segments:True"])
def test_engine_events_become_a_snapshot(tmp_path: Path, config: str) -> None:
    from accel_graph.allocator.traces import segments_from_layout

    engine_cls, settings_cls = _engine()
    try:
        settings = settings_cls.from_allocator_settings(parse_config(config))
        engine = engine_cls(policy="native", upstream="counting", settings=settings)
    except Exception as e:  # noqa: BLE001 - a missing build is not this test's subject
        pytest.skip(f"engine unavailable: {e}")
    engine.enable_events()
    ptrs = [engine.malloc(size) for size in (100, 3 * MIB, 12 * MIB, 5000, 25 * MIB)]
    engine.free(ptrs[1])
    engine.free(ptrs[0])
    events = engine.drain_events()
    trace = Trace.from_events(events, allocator_settings=parse_config(config).to_snapshot_dict())
    assert trace.validate().ok
    assert trace.action_counts()["alloc"] == 5
    exact = segments_from_layout(engine.layout())
    assert [(s["address"], s["total_size"]) for s in exact] == [
        (s["address"], s["total_size"]) for s in trace.segments
    ]
    for seg in exact:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    trace.segments = exact
    save_trace(trace, tmp_path / "engine.pickle")
    assert load_trace(tmp_path / "engine.pickle") == trace


def _segment_with_blocks(slacks: list[int]) -> dict:
    blocks, addr = [], 1 << 40
    for i, slack in enumerate(slacks):
        req = 512 * (i + 1)
        blocks.append({"address": addr, "size": req + slack, "requested_size": req,
                       "state": "active_allocated", "frames": []})  # fmt: skip
        addr += req + slack
    total = addr - (1 << 40)
    return {"address": 1 << 40, "total_size": total, "stream": 0, "blocks": blocks}


@pytest.mark.parametrize(
    "slacks,expected",
    [([512] * 8, "npu"), ([512] * 7, None), ([512] * 8 + [0], None), ([0] * 10, None)],
)
def test_ascend_rounding_identifies_npu(slacks: list[int], expected: str | None) -> None:
    assert Trace.from_snapshot([_segment_with_blocks(slacks)]).device_type == expected


def test_frames_identify_the_device() -> None:
    for filename, expected in [
        ("/x/site-packages/torch_npu/npu/memory.py", "npu"),
        ("/x/site-packages/torch/xpu/memory.py", "xpu"),
        ("/x/site-packages/torch/cuda/memory.py", "cuda"),
        ("/x/train.py", None),
    ]:
        snap = {"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 0, "size": 1, "stream": 0,
             "frames": [{"filename": filename, "line": 1, "name": "f"}]}]]}  # fmt: skip
        assert Trace.from_snapshot(snap).device_type == expected
