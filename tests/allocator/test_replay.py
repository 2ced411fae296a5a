"""Whole-trace replay (accel_graph.allocator.sim.replayer): op arrays, start state, empty_cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.allocator.sim.replayer import replay_trace
from accel_graph.allocator.sim.trace_ops import build_ops, recorded_summary
from accel_graph.allocator.sim.trace_state import infer_empty_cache, infer_pools, pool_number
from accel_graph.allocator.traces import Trace, segments_from_layout
from accel_graph.allocator.traces.actions import ACTION_CODE

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


# -- private pools inferred from the final segments (torch's trace entries carry no pool id) --

P_ADDR, D_ADDR = 0x7F0000000000, 0x7F0000200000


def _entry(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}


def _alloc_free(addr, size=1000):
    return [_entry("alloc", addr, size), _entry("free_requested", addr, size),
            _entry("free_completed", addr, size)]


def _small_segment(addr, pool, live):
    blocks = [{"address": addr, "size": 1024, "requested_size": 1000,
               "state": "active_allocated", "frames": []}] if live else []
    used = 1024 if live else 0
    blocks.append({"address": addr + used, "size": 2 * MIB - used, "requested_size": 0,
                   "state": "inactive", "frames": []})
    return {"device": 0, "address": addr, "total_size": 2 * MIB, "allocated_size": used,
            "active_size": used, "requested_size": 1000 if live else 0, "stream": 0,
            "segment_type": "small", "segment_pool_id": pool, "is_expandable": False,
            "frames": [], "blocks": blocks}


def _graph_snapshot(private=(1, 0), graph_first=True):
    """As torch writes it: a CUDA graph's pool shows only in the final segments'
    segment_pool_id; the trace entries have no pool_id. The graph pool (segment at P_ADDR) and
    the default pool (D_ADDR) each free a block before the other pool allocates, then both
    allocate again into their own cached block."""
    graph = [_entry("segment_alloc", P_ADDR, 2 * MIB), *_alloc_free(P_ADDR)]
    default = [_entry("segment_alloc", D_ADDR, 2 * MIB), *_alloc_free(D_ADDR)]
    first, second = (graph, default) if graph_first else (default, graph)
    events = first + second + [_entry("alloc", P_ADDR, 1000), _entry("alloc", D_ADDR, 1000)]
    return {"segments": [_small_segment(P_ADDR, private, True),
                         _small_segment(D_ADDR, (0, 0), True)],
            "device_traces": [events], "allocator_settings": {}}


@pytest.mark.parametrize("graph_first", [True, False])
def test_private_pool_inferred_from_final_segments(graph_first):
    trace = Trace.from_snapshot(_graph_snapshot(graph_first=graph_first))
    assert not trace.events(0)["pool"].any()  # no pool ids in the entries
    pools = infer_pools(trace)
    act = trace.events(0)["action"]
    at_p = (trace.events(0)["addr"] == P_ADDR) & (act == 0)
    assert set(pools[at_p].tolist()) == {1 << 32} and not pools[~at_p].any()
    r = replay_trace(trace, EngineSettings(), keep_layout=True)
    rec = recorded_summary(trace)
    assert r.summary()["segment_alloc"] == rec["segment_alloc"] == 2
    assert r.peak_reserved == rec["peak_reserved"] == 4 * MIB
    assert r.pools == {1 << 32: 1}
    assert any("segment_pool_id" in n for n in r.notes)
    # each pool's live block sits in its own segment: neither reused the other's cached block
    live = sorted((s["pool_id"], len([b for b in s["blocks"] if b["state"] == "active_allocated"]))
                  for s in r.layout)
    assert live == [(0, 1), (1, 1)]
    # with the segment in the default pool the second pool's allocation reuses the cached block
    flat = Trace.from_snapshot(_graph_snapshot(private=(0, 0), graph_first=graph_first))
    r0 = replay_trace(flat, EngineSettings())
    assert r0.device_mallocs == 1 and not r0.pools and r0.peak_reserved == 2 * MIB


def test_inferred_pool_only_after_the_last_release():
    """An address whose segment was released and later re-made in a graph pool: only the
    allocations after the release are in the private pool. A pool id on the event wins."""
    events = [_entry("segment_alloc", P_ADDR, 2 * MIB), *_alloc_free(P_ADDR),
              _entry("segment_free", P_ADDR, 2 * MIB),
              _entry("segment_alloc", P_ADDR, 2 * MIB), _entry("alloc", P_ADDR, 1000)]
    snap = {"segments": [_small_segment(P_ADDR, (0, 7), True)], "device_traces": [events]}
    trace = Trace.from_snapshot(snap)
    pools = infer_pools(trace)
    assert pools.tolist() == [0, 0, 0, 0, 0, 0, 7]
    ev = trace.events(0).copy()
    ev["pool"][1] = 3
    trace.device_traces[0] = ev
    assert infer_pools(trace).tolist() == [0, 3, 0, 0, 0, 0, 7]
    r = replay_trace(trace, EngineSettings())
    assert r.pools == {3: 1, 7: 2}
    assert r.device_mallocs == recorded_summary(trace)["segment_alloc"] == 2


def test_inferred_pool_from_a_pooled_segment_alloc():
    """A freed segment whose segment_alloc carries a pool id (engine-made or newer traces):
    allocations inside it without their own id go to that pool until its segment_free."""
    ev = np.zeros(8, dtype=Trace.from_snapshot(_graph_snapshot()).events(0).dtype)
    rows = [("segment_alloc", P_ADDR, 2 * MIB, 5), ("alloc", P_ADDR, 1000, 0),
            ("free_requested", P_ADDR, 1000, 0), ("free_completed", P_ADDR, 1000, 0),
            ("segment_free", P_ADDR, 2 * MIB, 5), ("segment_alloc", P_ADDR, 2 * MIB, 0),
            ("alloc", P_ADDR, 1000, 0), ("alloc", D_ADDR, 1000, 0)]
    for i, (a, addr, size, pool) in enumerate(rows):
        ev[i]["action"], ev[i]["addr"], ev[i]["size"], ev[i]["pool"] = (
            ACTION_CODE[a], addr, size, pool)
    ev["frames"] = -1
    trace = Trace([ev], [], None, "cuda")
    assert infer_pools(trace).tolist() == [5, 5, 0, 0, 5, 0, 0, 0]


def test_pool_number():
    assert pool_number((0, 0)) == 0 and pool_number(None) == 0
    assert pool_number((0, 3)) == 3 and pool_number([0, 3]) == 3
    assert pool_number((1, 0)) == 1 << 32 and pool_number((2, 5)) == (2 << 32) | 5
    assert pool_number(4) == 4
    with pytest.raises(ValueError):
        pool_number((1, 2, 3))
