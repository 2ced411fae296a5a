"""What a replay reports: the :class:`Figures` every configuration is judged by, and the
full :class:`ReplayResult` of :func:`~.replayer.replay_trace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..traces.actions import (
    A_ALLOC,
    A_FREE_REQ,
    reserved_delta,
)

__all__ = ["Figures", "ReplayResult", "fragmentation_at_peak", "usage_curves"]


@dataclass
class Figures:
    """The figures every simulated configuration is judged by (shared by :class:`SimResult`
    and the tuner's candidates, and named alike in every JSON document)."""

    peak_reserved: int
    peak_allocated: int
    device_mallocs: int
    device_frees: int
    maps: int
    unmaps: int
    retries: int
    ooms: int
    fragmentation_at_peak: float
    #: the peak the recording itself produced (:func:`~..traces.actions.recording_peak`:
    #: the highest reserved right after a growth event), beside ``peak_reserved`` (the whole
    #: trace, the rebuilt start state included)
    peak_reserved_recording: int
    #: reserved bytes of the start state rebuilt under this configuration (the prologue)
    start_reserved: int

    @property
    def device_calls(self) -> int:
        """Synchronising device calls: mallocs + frees + expandable maps + unmaps."""
        return self.device_mallocs + self.device_frees + self.maps + self.unmaps

    def figures(self) -> dict[str, Any]:
        """The :class:`Figures` fields alone (picklable; for worker processes)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Figures)}

    def figures_json(self) -> dict[str, Any]:
        return {
            "peak_reserved": self.peak_reserved,
            "peak_allocated": self.peak_allocated,
            "device_mallocs": self.device_mallocs,
            "device_frees": self.device_frees,
            "segment_maps": self.maps,
            "segment_unmaps": self.unmaps,
            "device_calls": self.device_calls,
            "retries": self.retries,
            "ooms": self.ooms,
            "fragmentation_at_peak": round(self.fragmentation_at_peak, 6),
            "peak_reserved_recording": self.peak_reserved_recording,
            "start_reserved": self.start_reserved,
        }


@dataclass
class ReplayResult(Figures):
    """What a replay did (engine side) — compare with :func:`recorded_summary`. The
    :class:`Figures` are over the trace (the prologue that rebuilds the start state excluded,
    the start state included); ``fragmentation_at_peak`` is 1 - requested/reserved at the peak
    of reserved."""

    segment_events: np.ndarray  # engine EVENT_DTYPE records of segment_* actions, oldest first
    final_stats: dict[str, int]
    n_ops: int
    replay_seconds: float = 0.0
    inferred_empty_cache: int = 0
    #: the engine's final layout (``Engine.layout()``) with ``keep_layout=True``, else None
    layout: list[dict[str, Any]] | None = None
    #: more peaks, torch's definitions: allocated (a Figures field) = block bytes, active =
    #: allocated + pending cross-stream frees, requested = the callers' sizes
    peak_active: int = 0
    peak_requested: int = 0
    #: the profile simulated (name) and what it changed or could not model
    profile: str = ""
    notes: list[str] = field(default_factory=list)
    #: with keep_events=True: every engine event after the prologue (EVENT_DTYPE), and the
    #: memory_stats() at the trace's start (after the prologue)
    events: np.ndarray | None = None
    start_stats: dict[str, int] | None = None
    #: trace pool id -> engine private pool id (nonzero pools only)
    pools: dict[int, int] = field(default_factory=dict)

    @property
    def segment_allocs(self) -> int:
        return self.device_mallocs

    def curves(self) -> dict[str, np.ndarray]:
        """Per engine event (needs ``keep_events=True``): ``seq``, ``reserved`` and
        ``requested`` bytes after each event (vectorised; allocated block bytes are not in
        the events, see ``peak_allocated``)."""
        if self.events is None or self.start_stats is None:
            raise ValueError("replay with keep_events=True to get curves")
        ev = self.events
        res, req = usage_curves(ev, int(self.start_stats["reserved_bytes.all.current"]),
                           int(self.start_stats["requested_bytes.all.current"]))
        return {"seq": ev["seq"].astype(np.int64), "reserved": res, "requested": req}

    def summary(self) -> dict[str, Any]:
        return {
            "peak_reserved": self.peak_reserved,
            "segment_alloc": self.device_mallocs,
            "segment_free": self.device_frees,
            "segment_map": self.maps,
            "segment_unmap": self.unmaps,
            "final_reserved": self.final_stats.get("reserved_bytes.all.current", 0),
            "retries": self.retries,
            "ooms": self.ooms,
        }


def usage_curves(events: np.ndarray, start_reserved: int,
            start_requested: int) -> tuple[np.ndarray, np.ndarray]:
    """Reserved and requested bytes after each event of ``events`` (int64 arrays), from the
    bytes reserved and requested before the first."""
    act = events["action"].astype(np.int64)
    size = events["size"].astype(np.int64)
    res = start_reserved + np.cumsum(reserved_delta(events))
    req = start_requested + np.cumsum(np.select(
        [act == A_ALLOC, act == A_FREE_REQ], [size, -size], 0))
    return res, req


def fragmentation_at_peak(res: np.ndarray, req: np.ndarray, start_reserved: int,
                  start_requested: int) -> float:
    """1 - requested/reserved at the reserved peak of :func:`usage_curves`' ``res``/``req``
    (the start state's figure when there are no events)."""
    if not len(res):
        return 0.0 if not start_reserved else 1.0 - start_requested / start_reserved
    i = int(np.argmax(res))
    return float(1.0 - req[i] / res[i]) if res[i] else 0.0
