"""The predicted trace: what the simulated allocator did, as a trace PyTorch's memory_viz reads.

:func:`predicted_trace` turns one replay (``simulate(..., keep_events=True, keep_layout=True)``)
into a :class:`~accel_graph.allocator.traces.model.Trace` whose events are the engine's events
after the start-state prologue and whose final segments are the engine's final layout, so that
``save_trace(predicted, "pred.pickle")`` writes a snapshot that ``torch.cuda._memory_viz``
(``stats``/``segsum``, ``trace``, ``trace_plot``, ``segment_plot``) and memory_viz's web page
open like a recorded one. What is carried over from the recording, and how:

- **addresses** are the engine's own (the simulated device's address space, not the recorded
  one): a predicted snapshot is consistent with itself, not with the recorded addresses;
- **streams** are the recorded stream ids (the engine numbers them 0..n-1 in order of first
  appearance, :func:`~.trace_ops.build_ops`); **pools** the recorded pool numbers;
- **stack frames**: the k-th simulated ``alloc`` (or ``oom``) is the k-th recorded ``alloc``
  (one engine malloc per recorded alloc, in order), so it gets that allocation's frames; its
  ``free_requested``/``free_completed`` get the frames of the recorded frees of the same
  allocation; a ``segment_alloc``/``segment_map`` gets the frames of the allocation that caused
  it (the next ``alloc``/``oom``), as torch records them; frees of blocks that existed before
  the recording get the recorded frees' frames in order; final active blocks get their
  allocation's frames. When the alloc counts differ (never seen; it would be an engine bug) no
  frames are carried and a note says so;
- **times**: the recorded time of the same position in the alloc/free sequence (as
  :func:`~accel_graph.allocator.analysis.timeline.simulated_timeline`), made non-decreasing;
  absent when the recording has none (the engine's own clock is when the replay ran, which
  means nothing here).

The start state the prologue rebuilt appears as memory_viz shows a mid-run recording: blocks
freed without an ``alloc`` event and active blocks of the final segments that no event touches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.stats import snapshot_segments
from ..traces.actions import A_ALLOC, A_FREE, A_FREE_REQ, A_MAP, A_OOM, A_SEG_ALLOC
from ..traces.model import Trace
from ..traces.record import NO_FRAMES, NO_TIME, TRACE_DTYPE
from .scenario import recorded_settings

__all__ = ["PREDICTION_KEY", "predicted_trace"]

#: Top-level snapshot key of a predicted snapshot: what was simulated (memory_viz ignores it).
PREDICTION_KEY = "accel_graph_prediction"
_ACTIVE = ("active_allocated", "active_pending_free", "active_awaiting_free")


def _owner_rank(ev: np.ndarray) -> np.ndarray:
    """For every event, the rank (0, 1, ... in event order among ``alloc`` events) of the
    allocation it belongs to: the alloc itself, or for a ``free_requested``/``free_completed``
    the last alloc at the same address before it; -1 for other events and for frees with no
    alloc before them (blocks that existed before the events began)."""
    act = ev["action"]
    mem = np.flatnonzero((act == A_ALLOC) | (act == A_FREE_REQ) | (act == A_FREE))
    out = np.full(len(ev), -1, np.int64)
    if not len(mem):
        return out
    is_alloc = act[mem] == A_ALLOC
    rank = np.cumsum(is_alloc) - 1
    addr = ev["addr"][mem]
    order = np.lexsort((mem, addr))  # by address, then event order
    a_s, alloc_s = addr[order], is_alloc[order]
    pos = np.maximum.accumulate(np.where(alloc_s, np.arange(len(order)), -1))
    ok = pos >= 0
    ok[ok] = a_s[pos[ok]] == a_s[ok]  # the alloc found is at the same address
    owner = np.where(ok, rank[order][np.maximum(pos, 0)], -1)
    out[mem[order]] = owner
    return out


def _frames_by_rank(ev: np.ndarray, owner: np.ndarray, action: int, n: int) -> np.ndarray:
    """frames of the ``action`` event of each allocation rank 0..n-1 (first one; -1 none)."""
    out = np.full(n, NO_FRAMES, np.int64)
    sel = np.flatnonzero((ev["action"] == action) & (owner >= 0))[::-1]  # first wins below
    out[owner[sel]] = ev["frames"][sel]
    return out


def _carry_frames(rec: np.ndarray, sim: np.ndarray) -> bool:
    """Set ``sim["frames"]`` from the recorded events ``rec`` (see the module docstring).
    Returns False (frames left empty) when the allocation sequences do not line up."""
    rec_allocs = np.flatnonzero(rec["action"] == A_ALLOC)
    sim_act = sim["action"]
    sim_allocs = np.flatnonzero((sim_act == A_ALLOC) | (sim_act == A_OOM))
    if len(rec_allocs) != len(sim_allocs):
        return False
    n = len(rec_allocs)
    frames = np.full(len(sim), NO_FRAMES, np.int64)
    frames[sim_allocs] = rec["frames"][rec_allocs]
    rec_owner, sim_owner = _owner_rank(rec), _owner_rank(sim)
    # an oom takes the alloc's place in the sequence: ranks of the simulated allocs among the
    # recorded ones
    sim_rank = np.full(len(sim), -1, np.int64)
    sim_rank[sim_allocs] = np.arange(n)
    combined = sim_rank[sim_act == A_ALLOC]  # the r-th alloc's place in the alloc/oom sequence
    if len(combined):
        sim_owner = np.where(sim_owner >= 0, combined[np.maximum(sim_owner, 0)], -1)
    for action in (A_FREE_REQ, A_FREE):
        by_rank = _frames_by_rank(rec, rec_owner, action, n)
        m = (sim_act == action) & (sim_owner >= 0)
        frames[m] = by_rank[sim_owner[m]]
        # frees of blocks from before the recording: in order, when the counts agree
        rec_pre = np.flatnonzero((rec["action"] == action) & (rec_owner < 0))
        sim_pre = np.flatnonzero((sim_act == action) & (sim_owner < 0))
        if len(rec_pre) == len(sim_pre):
            frames[sim_pre] = rec["frames"][rec_pre]
    # a segment grows for the allocation that follows it
    trig = np.flatnonzero((sim_act == A_ALLOC) | (sim_act == A_OOM))
    grow = np.flatnonzero((sim_act == A_SEG_ALLOC) | (sim_act == A_MAP))
    nxt = np.searchsorted(trig, grow)
    ok = nxt < len(trig)
    frames[grow[ok]] = frames[trig[nxt[ok]]]
    sim["frames"] = frames
    return True


def _counted(act: np.ndarray) -> np.ndarray:
    """Events that advance the position in the alloc/free sequence (timeline.py's x)."""
    return (act == A_ALLOC) | (act == A_OOM) | (act == A_FREE)


def _carry_times(rec: np.ndarray, sim: np.ndarray) -> None:
    t = rec["time_us"].astype(np.int64)
    have = t != NO_TIME
    if not have.any():
        sim["time_us"] = NO_TIME
        return
    # fill untimed events with the previous time (the first timed one before any)
    idx = np.maximum.accumulate(np.where(have, np.arange(len(t)), -1))
    t = np.where(idx >= 0, t[np.maximum(idx, 0)], t[np.argmax(have)])
    by_x = np.concatenate((t[:1], t[_counted(rec["action"])]))
    x = np.cumsum(_counted(sim["action"]))
    sim["time_us"] = np.maximum.accumulate(by_x[np.minimum(x, len(by_x) - 1)])


def _pool_pair(p: int) -> tuple[int, int]:
    """Inverse of :func:`~.trace_state.pool_number`: the snapshot's ``segment_pool_id`` pair."""
    return (p >> 32, p & 0xFFFFFFFF) if p >> 32 else (0, p)


def predicted_trace(trace: Trace, sim: Any, *, source: str | None = None) -> Trace:
    """The simulated allocator's trace of one replay, ready for ``save_trace``.

    ``sim``: a :class:`~.scenario.SimResult` from ``simulate(trace, scenario, device=...,
    keep_events=True, keep_layout=True)``. The result has one device's events (at the replayed
    device index), the engine's final segments in torch's snapshot form, the scenario's
    allocator settings (``allocator_settings``), the recording's stacks and device type, and a
    :data:`PREDICTION_KEY` entry saying what was simulated (config, profile, policy, cap,
    source, notes). Raises ValueError when the replay kept no events or layout.
    """
    replay = sim.replay
    if replay is None or replay.events is None or replay.layout is None:
        raise ValueError("predicted_trace needs simulate(..., keep_events=True, "
                         "keep_layout=True)")
    device = int(sim.device)
    rec = trace.events(device)
    streams = np.unique(rec["stream"]) if len(rec) else np.zeros(1, np.int64)
    to_trace_pool = {engine: int(p) for p, engine in replay.pools.items()}
    ev = replay.events
    out = np.zeros(len(ev), TRACE_DTYPE)
    out["action"], out["addr"], out["size"] = ev["action"], ev["addr"], ev["size"]
    es = ev["stream"].astype(np.int64)
    out["stream"] = np.where(es < len(streams), streams[np.clip(es, 0, len(streams) - 1)], es)
    if to_trace_pool:
        pools = ev["pool_id"].astype(np.int64)
        out["pool"] = [to_trace_pool.get(int(p), int(p)) if p else 0 for p in pools.tolist()]
    out["frames"] = NO_FRAMES
    notes: list[str] = []
    if not _carry_frames(rec, out):
        notes.append("the simulated alloc sequence does not line up with the recorded one; "
                     "no stack frames carried")
    _carry_times(rec, out)
    segments = snapshot_segments(replay.layout, device)
    _finish_segments(segments, out, trace.stacks, streams, to_trace_pool)
    scenario = sim.scenario
    settings = scenario.settings
    if settings is None:
        settings = recorded_settings(trace, device)
    prediction = {"config": scenario.config, "label": scenario.label,
                  "profile": scenario.profile.name, "policy": scenario.policy,
                  "cap": scenario.cap, "device": device, "source": source,
                  "notes": list(scenario.notes) + list(sim.notes) + notes}
    traces = [np.empty(0, TRACE_DTYPE) for _ in range(device)] + [out]
    return Trace(traces, segments, settings.to_snapshot_dict(), trace.device_type,
                 list(trace.stacks), extra={PREDICTION_KEY: prediction})


def _finish_segments(segments: list[dict[str, Any]], ev: np.ndarray, stacks: list[Any],
                     streams: np.ndarray, to_trace_pool: dict[int, int]) -> None:
    """Recorded stream ids and pool numbers on the engine's segments, and the frames of the
    allocation that made each active block and each segment."""
    act = ev["action"]
    # the last alloc at each address: the allocation a final active block comes from
    allocs = np.flatnonzero(act == A_ALLOC)
    last_alloc: dict[int, int] = dict(zip(ev["addr"][allocs].tolist(),
                                          ev["frames"][allocs].tolist()))
    grows = np.flatnonzero((act == A_SEG_ALLOC) | (act == A_MAP))
    seg_frames: dict[int, int] = dict(zip(ev["addr"][grows].tolist(),
                                          ev["frames"][grows].tolist()))

    def frames(i: int | None) -> list[dict[str, Any]]:
        return [dict(f) for f in stacks[i]] if i is not None and i >= 0 else []

    for seg in segments:
        s = int(seg["stream"])
        seg["stream"] = int(streams[s]) if 0 <= s < len(streams) else s
        engine_pool = int(seg["segment_pool_id"][1])
        seg["segment_pool_id"] = _pool_pair(to_trace_pool.get(engine_pool, engine_pool))
        seg["frames"] = frames(seg_frames.get(int(seg["address"])))
        for b in seg["blocks"]:
            if b["state"] in _ACTIVE:
                b["frames"] = frames(last_alloc.get(int(b["address"])))
