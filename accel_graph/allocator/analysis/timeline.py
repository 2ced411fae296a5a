"""Memory over time: allocated and reserved bytes after every event of a trace or a replay.

:func:`recorded_timeline` reads the curves from what a trace recorded; :func:`simulated_timeline`
from the engine events of a replay (``simulate(..., keep_events=True)``). Both are vectorised
(one ``cumsum`` over the signed event sizes, started from the state at the trace's start) and
share one x axis: **the position in the trace's alloc/free sequence** (the number of ``alloc``,
``oom`` and completed-free events up to and including the point), so curves of one trace under
different configurations line up even though they have different segment events.

- ``allocated``: bytes the callers asked for and have not freed (the ``requested`` sizes of the
  ``alloc`` and ``free_completed`` events; torch's ``requested_bytes``, what memory_viz's active
  timeline shows). Block rounding is not in the events; ``SimResult.peak_allocated`` has the
  block-bytes peak of a replay.
- ``reserved``: bytes held from the device (``segment_alloc``/``segment_map`` minus
  ``segment_free``/``segment_unmap``), started from the reserved bytes at the trace's start
  (:func:`~accel_graph.allocator.sim.trace_ops.recorded_summary`'s ``start_reserved`` for a recording,
  the replay's ``start_stats`` for a simulation).

The first point (x = 0) is the start state, so ``timeline.peak_reserved`` equals
``recorded_summary(...)["peak_reserved"]`` and ``SimResult.peak_reserved``, and the last point
is the final state. :meth:`Timeline.downsample` thins a million-event timeline to a few thousand
points keeping every bucket's minimum and maximum of both curves (so peaks survive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..traces.actions import A_ALLOC, A_FREE, A_FREE_REQ, A_OOM, reserved_delta
from ..traces.record import NO_TIME

__all__ = ["Timeline", "recorded_timeline", "simulated_timeline"]



@dataclass(frozen=True)
class Timeline:
    """Allocated and reserved bytes at a sequence of points (int64 arrays of equal length).

    ``x``: position in the trace's alloc/free sequence (non-decreasing; 0 = the start state);
    ``time_us``: the recorded time of each point (None when the trace has no timestamps);
    ``label``: what the curves are (``"recorded"``, a config string, ...).
    """

    x: np.ndarray
    allocated: np.ndarray
    reserved: np.ndarray
    time_us: np.ndarray | None = None
    label: str = ""

    def __len__(self) -> int:
        return len(self.x)

    @property
    def peak_reserved(self) -> int:
        return int(self.reserved.max()) if len(self.reserved) else 0

    @property
    def peak_allocated(self) -> int:
        return int(self.allocated.max()) if len(self.allocated) else 0

    @property
    def final_reserved(self) -> int:
        return int(self.reserved[-1]) if len(self.reserved) else 0

    @property
    def final_allocated(self) -> int:
        return int(self.allocated[-1]) if len(self.allocated) else 0

    @property
    def peak_index(self) -> int:
        """Index (into the arrays) of the first point where reserved is at its peak."""
        return int(np.argmax(self.reserved)) if len(self.reserved) else 0

    @property
    def waste(self) -> np.ndarray:
        """Reserved minus allocated at each point (cached and fragmented bytes)."""
        return self.reserved - self.allocated

    def downsample(self, max_points: int) -> Timeline:
        """At most about ``max_points`` points, a subset of these: the points are cut into
        ``max_points // 4`` buckets, and each keeps the points where reserved and allocated
        reach their minimum and maximum in it (so the peaks and troughs of both curves stay
        exact), plus the first and last point. Returns ``self`` when already small enough."""
        n = len(self.x)
        if max_points < 8:
            raise ValueError("max_points must be >= 8")
        if n <= max_points:
            return self
        nb = max(1, (max_points - 2) // 4)
        bs = -(-n // nb)  # ceil
        pad = nb * bs - n
        keep = [np.array([0, n - 1])]
        base = np.arange(nb) * bs
        for arr in (self.reserved, self.allocated):
            a = np.concatenate((arr, np.full(pad, arr[-1]))).reshape(nb, bs) if pad else \
                arr.reshape(nb, bs)
            keep.append(np.minimum(base + a.argmax(axis=1), n - 1))
            keep.append(np.minimum(base + a.argmin(axis=1), n - 1))
        idx = np.unique(np.concatenate(keep))
        return Timeline(self.x[idx], self.allocated[idx], self.reserved[idx],
                        None if self.time_us is None else self.time_us[idx], self.label)

    def relabel(self, label: str) -> Timeline:
        return replace(self, label=label)


def _curves(ev: np.ndarray, free_code: int, start_alloc: int,
            start_res: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, allocated, reserved, counted) with the start point first; ``counted`` marks the
    events that advance x."""
    act = ev["action"].astype(np.int64)
    size = ev["size"].astype(np.int64)
    counted = (act == A_ALLOC) | (act == A_OOM) | (act == free_code)
    x = np.concatenate(([0], np.cumsum(counted)))
    d_alloc = np.where(act == A_ALLOC, size, 0) - np.where(act == free_code, size, 0)
    d_res = reserved_delta(ev)
    alloc = np.concatenate(([0], np.cumsum(d_alloc)))
    res = np.concatenate(([0], np.cumsum(d_res)))
    return x.astype(np.int64), alloc + start_alloc, res + start_res, counted


def _free_code(ev: np.ndarray) -> int:
    """The free action to count: ``free_completed`` when the trace has any, else
    ``free_requested`` (traces that record only one kind of free)."""
    act = ev["action"]
    if (act == A_FREE).any() or not (act == A_FREE_REQ).any():
        return A_FREE
    return A_FREE_REQ


def _final_live(trace: Any, device: int) -> int:
    """Requested bytes of the blocks still allocated in the trace's final segments."""
    total = 0
    for seg in trace.segments:
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", ()) or ():
            if str(b.get("state", "")).startswith("active"):
                req = b.get("requested_size")
                total += int(req if req is not None else b.get("size", 0))
    return total


def _times(ev: np.ndarray) -> np.ndarray | None:
    """Per-event times with the start point first (None when the events have none); events
    without a time take the previous event's."""
    if not len(ev):
        return None
    t = ev["time_us"].astype(np.int64)
    have = t != NO_TIME
    if not have.any():
        return None
    idx = np.maximum.accumulate(np.where(have, np.arange(len(t)), -1))
    first = int(t[np.argmax(have)])
    filled = np.where(idx >= 0, t[np.maximum(idx, 0)], first)
    return np.concatenate(([first], filled))


def recorded_timeline(trace: Any, device: int = 0, *, label: str = "recorded") -> Timeline:
    """The allocated and reserved bytes the trace recorded for ``device``, one point per event
    plus the start state.

    Start state: reserved = the final segments' total minus the net segment change over the
    trace (as :func:`~accel_graph.allocator.sim.trace_ops.recorded_summary`); allocated = the
    requested bytes of the final segments' active blocks minus the net allocation change, raised
    where needed so that the curve never goes below zero (a trace whose final segments are
    missing)."""
    ev = trace.events(device)
    fc = _free_code(ev)
    final_res = sum(int(s.get("total_size", 0)) for s in trace.segments
                    if s.get("device", device) == device)
    x, alloc, res, _ = _curves(ev, fc, 0, 0)
    start_res = final_res - int(res[-1])
    start_alloc = _final_live(trace, device) - int(alloc[-1])
    start_alloc = max(start_alloc, -int(alloc.min()))
    return Timeline(x, alloc + start_alloc, res + start_res, _times(ev), label)


def simulated_timeline(sim: Any, trace: Any = None, *, label: str | None = None) -> Timeline:
    """The allocated and reserved bytes of a replay, one point per engine event after the
    start-state prologue plus the start state.

    ``sim``: a :class:`~accel_graph.allocator.sim.scenario.SimResult` from ``simulate(...,
    keep_events=True)`` or the :class:`~accel_graph.allocator.sim.results.ReplayResult` itself.
    ``trace``: the trace that was replayed; when given and it has timestamps, ``time_us`` is
    the recorded time of the same position in the alloc/free sequence. ``label``: default the
    scenario's label (``"(as recorded)"``, the config string, ...).
    """
    replay = getattr(sim, "replay", None) or sim
    events = getattr(replay, "events", None)
    start = getattr(replay, "start_stats", None)
    if events is None or start is None:
        raise ValueError("simulated_timeline needs a replay run with keep_events=True "
                         "(simulate(trace, scenario, keep_events=True))")
    if label is None:
        scenario = getattr(sim, "scenario", None)
        label = scenario.label if scenario is not None else "simulated"
    x, alloc, res, _ = _curves(events, A_FREE, int(start.get("requested_bytes.all.current", 0)),
                               int(start.get("reserved_bytes.all.current", 0)))
    time_us = None
    if trace is not None:
        device = int(getattr(sim, "device", 0) or 0)
        ev = trace.events(device)
        t = _times(ev)
        if t is not None:
            _, _, _, counted = _curves(ev, _free_code(ev), 0, 0)
            # time of the x-th counted event of the recording (x = 0: the first event)
            by_x = np.concatenate((t[:1], t[1:][counted]))
            time_us = by_x[np.minimum(x, len(by_x) - 1)]
    return Timeline(x, alloc, res, time_us, label)
