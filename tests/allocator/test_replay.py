"""Whole-trace replay (accel_graph.allocator.replay): op arrays, start state, empty_cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from accel_graph.allocator.engine import Engine, EngineSettings
from accel_graph.allocator.replay import (
    build_ops,
    infer_empty_cache,
    recorded_summary,
    replay_trace,
)
from accel_graph.allocator.snapshot import Trace, segments_from_layout

MIB = 1 << 20


def _program(seed: int, n: int = 400, empty_cache_every: int = 0):
    """Random mallocs/frees (some big, some small) as a list of ops."""
    rng = random.Random(seed)
    live: list[int] = []
    prog = []
    for _ in range(n):
        if live and rng.random() < 0.45:
            prog.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, MIB), rng.randint(MIB, 40 * MIB)])
            prog.append(("malloc", size))
            live.append(len(prog) - 1)
        if empty_cache_every and len(prog) % empty_cache_every == empty_cache_every - 1:
            prog.append(("empty_cache", 0))
    return prog


def _record(prog, settings: EngineSettings, skip: int = 0):
    """Drive an engine op by op; return (trace of the events after op `skip`, engine stats,
    layout). Events before `skip` are dropped: a recording that began mid-run."""
    e = Engine("native", "counting", settings)
    ptr: dict[int, int] = {}
    for i, (op, arg) in enumerate(prog):
        if i == skip:
            e.drain_events() if i else None
            e.enable_events()
        if op == "malloc":
            ptr[i] = e.malloc(arg)
        elif op == "free":
            e.free(ptr.pop(arg))
        else:
            e.empty_cache()
    if skip >= len(prog):
        e.enable_events()
    events = e.drain_events()
    layout = e.layout()
    trace = Trace.from_events(events, segments=segments_from_layout(layout))
    if settings.expandable_segments:
        trace.allocator_settings = {"expandable_segments": True}
    return trace, e.memory_stats(), layout


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_replay_equals_engine_op_by_op(seed, expandable):
    prog = _program(seed, empty_cache_every=97)
    settings = EngineSettings(expandable_segments=expandable)
    trace, stats, layout = _record(prog, settings)
    r = replay_trace(trace, settings, keep_layout=True, profile="cuda")
    assert r.peak_reserved == stats["reserved_bytes.all.peak"]
    assert r.device_mallocs == stats["accel.device_mallocs"]
    assert r.device_frees == stats["accel.device_frees"]
    assert r.maps == stats["accel.device_maps"]
    assert r.unmaps == stats["accel.device_unmaps"]
    assert r.final_stats["reserved_bytes.all.current"] == stats["reserved_bytes.all.current"]
    assert r.final_stats["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]
    shape = [(s["size"], [(b["size"], b["state"]) for b in s["blocks"]]) for s in layout]
    assert [(s["size"], [(b["size"], b["state"]) for b in s["blocks"]]) for s in r.layout] == shape
    summary = recorded_summary(trace)
    assert r.summary()["peak_reserved"] == summary["peak_reserved"]


def test_one_replay_call_per_trace(monkeypatch):
    prog = _program(7)
    trace, _, _ = _record(prog, EngineSettings())
    calls = []
    real = Engine.replay
    monkeypatch.setattr(Engine, "replay", lambda self, ops, n_slots=None: (
        calls.append(len(ops)), real(self, ops, n_slots))[1])
    replay_trace(trace)
    # one call on the throw-away prologue engine (empty here: skipped) and one for the trace
    # (plus the reset_peak_stats op between prologue and trace)
    assert len(calls) == 1 and calls[0] == len(build_ops(trace)["ops"]) + 1


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_mid_run_reconstruction(seed, expandable):
    """Recording starts after 150 ops: frees of blocks never allocated in the trace and live
    blocks untouched by it are rebuilt; the replay reproduces the recorded segment events."""
    prog = _program(seed + 10)
    settings = EngineSettings(expandable_segments=expandable)
    trace, stats, _ = _record(prog, settings, skip=150)
    rec = recorded_summary(trace)
    assert rec["start_reserved"] > 0
    r = replay_trace(trace, settings)
    assert r.start_reserved == rec["start_reserved"]
    assert r.peak_reserved == rec["peak_reserved"]
    assert r.final_stats["reserved_bytes.all.current"] == rec["final_reserved"]
    got = r.summary()
    for k in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
        assert got[k] == rec[k], k


def test_empty_cache_inferred_from_segment_free_runs():
    prog = _program(3, empty_cache_every=50)
    trace, stats, _ = _record(prog, EngineSettings())
    ev = trace.events(0)
    starts = infer_empty_cache(trace, ev)
    assert len(starts) > 0
    assert all(ev["action"][i] == 4 for i in starts)
    with_ec = replay_trace(trace)
    without = replay_trace(trace, empty_cache=False)
    assert with_ec.device_frees == stats["accel.device_frees"] > 0
    assert without.device_frees == 0


def test_empty_cache_frames_must_name_it():
    prog = _program(3, empty_cache_every=50)
    trace, _, _ = _record(prog, EngineSettings())
    a = trace.events(0).copy()
    trace.stacks = [({"name": "malloc", "filename": "x.py", "line": 1},)]
    a["frames"] = 0
    trace.device_traces[0] = a
    assert len(infer_empty_cache(trace, a)) == 0
    trace.stacks = [({"name": "empty_cache", "filename": "memory.py", "line": 1},)]
    assert len(infer_empty_cache(trace, a)) > 0


def test_npu_rounding_in_the_engine():
    """The NPU rule runs in the engine (round_extra): ops carry the requested sizes."""
    prog = [("malloc", 40), ("malloc", 512), ("malloc", 41943040)]
    trace, _, _ = _record(prog, EngineSettings())
    trace.device_type = "npu"
    b = build_ops(trace)
    assert b["ops"]["size"].tolist() == [40, 512, 41943040]
    r = replay_trace(trace, keep_layout=True)
    assert r.profile == "npu"
    sizes = sorted(blk["size"] for s in r.layout for blk in s["blocks"]
                   if blk["state"] == "active_allocated")
    assert sizes == [512, 1024, 41943552]
    assert r.final_stats["requested_bytes.all.current"] == 40 + 512 + 41943040


def test_ops_are_vectorised_and_ordered():
    prog = _program(5)
    trace, _, _ = _record(prog, EngineSettings())
    b = build_ops(trace)
    ops = b["ops"]
    ev = trace.events(0)
    assert int((ops["op"] == 0).sum()) == int((ev["action"] == 0).sum())
    assert int((ops["op"] == 1).sum()) == int((ev["action"] == 2).sum())
    assert np.array_equal(ops["size"][ops["op"] == 0], ev["size"][ev["action"] == 0].astype(np.int64))
