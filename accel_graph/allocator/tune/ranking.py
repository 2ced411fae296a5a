"""Ranking evaluated configurations: objectives, the Pareto front and its knee.

A :class:`Candidate` is one evaluated configuration; :func:`rank` orders them for an objective
(``peak``, ``mallocs``, ``pareto``; the module docstring of :mod:`.search` states the rules)
and :func:`pareto_front` gives the front of peak reserved vs device calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..sim.results import Figures

__all__ = ["MALLOCS_PEAK_SLACK", "OBJECTIVES", "PEAK_SCOPES", "Candidate", "delta", "pareto_front",
           "peak_of", "rank"]

OBJECTIVES = ("peak", "mallocs", "pareto")
#: Which peak reserved an objective minimises: ``recording``, the peak the recording itself
#: produced (the highest reserved right after a growth event; what a setting can change when the
#: trace starts from a full cache that it empties), or ``trace``, the whole-trace peak (the
#: rebuilt start state included).
PEAK_SCOPES = ("recording", "trace")
#: ``mallocs`` objective: peak reserved may exceed the lowest peak by this fraction.
MALLOCS_PEAK_SLACK = 0.05

@dataclass
class Candidate(Figures):
    """One evaluated configuration. ``config`` is canonical (``""`` = torch's defaults)."""

    config: str | None  # None: the recorded settings, not expressible as a config string
    policy: str
    stage: str
    notes: tuple[str, ...] = ()
    #: entries (``key:value``) that differ from the baseline's canonical string
    distance: int = 0
    es: bool | None = None
    choice: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        if self.config is None:
            return "(as recorded)"
        return self.config or "(defaults)"

    def metrics(self) -> tuple[int, ...]:
        """What two configurations must share to be equivalent results."""
        return (self.peak_reserved, self.peak_reserved_recording, self.device_mallocs,
                self.device_frees, self.maps, self.unmaps, self.ooms)

    def to_json(self, baseline: Candidate | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config,
            "label": self.label,
            "policy": self.policy,
            "stage": self.stage,
            **self.figures_json(),
            "oom": self.ooms > 0,
            "changed_entries": self.distance,
            "notes": list(self.notes),
        }
        if baseline is not None:
            out["delta"] = delta(self, baseline)
        return out


def delta(c: Candidate, baseline: Candidate) -> dict[str, Any]:
    """``c`` minus ``baseline``: peak reserved (bytes and relative) and device calls."""
    d = c.peak_reserved - baseline.peak_reserved
    dr = c.peak_reserved_recording - baseline.peak_reserved_recording
    return {
        "peak_reserved": d,
        "peak_reserved_relative": (round(d / baseline.peak_reserved, 6)
                                   if baseline.peak_reserved else None),
        "peak_reserved_recording": dr,
        "peak_reserved_recording_relative": (
            round(dr / baseline.peak_reserved_recording, 6)
            if baseline.peak_reserved_recording else None),
        "start_reserved": c.start_reserved - baseline.start_reserved,
        "device_calls": c.device_calls - baseline.device_calls,
        "ooms": c.ooms - baseline.ooms,
    }



def peak_of(c: Figures, scope: str = "recording") -> int:
    """``c``'s peak reserved in ``scope`` (:data:`PEAK_SCOPES`)."""
    if scope not in PEAK_SCOPES:
        raise ValueError(f"peak scope must be one of {', '.join(PEAK_SCOPES)}; got {scope!r}")
    return c.peak_reserved_recording if scope == "recording" else c.peak_reserved


def _tie(c: Candidate) -> tuple[int, int, str]:
    return (c.distance, len(c.config or ""), c.config or "")


def pareto_front(cands: Iterable[Candidate], scope: str = "recording") -> list[Candidate]:
    """The non-dominated candidates on (peak reserved, device calls), both minimised, among
    those without out-of-memory events (all of them when every one has some); one per point
    (the one closest to the baseline), sorted by peak reserved."""
    pool = list(cands)
    ok = [c for c in pool if c.ooms == 0] or pool
    best: dict[tuple[int, int], Candidate] = {}
    for c in ok:
        k = (peak_of(c, scope), c.device_calls)
        if k not in best or _tie(c) < _tie(best[k]):
            best[k] = c
    front: list[Candidate] = []
    min_calls = None
    for k in sorted(best):  # by peak, then calls: a point is kept when its calls improve
        if min_calls is None or k[1] < min_calls:
            front.append(best[k])
            min_calls = k[1]
    return front


def _layers(cands: Sequence[Candidate], scope: str) -> dict[int, int]:
    """Non-dominated sorting on (peak reserved, device calls): id(candidate) -> front index
    (0 = the Pareto front). Equal points share a front."""
    left = list(cands)
    out: dict[int, int] = {}
    layer = 0
    while left:
        pts = sorted(left, key=lambda c: (peak_of(c, scope), c.device_calls))
        keep: set[int] = set()
        min_calls: int | None = None  # fewest calls among strictly lower peaks
        i = 0
        while i < len(pts):
            j = i
            while j < len(pts) and peak_of(pts[j], scope) == peak_of(pts[i], scope):
                j += 1
            lo = pts[i].device_calls  # the group's fewest calls (sorted)
            if min_calls is None or lo < min_calls:
                keep.update(id(c) for c in pts[i:j] if c.device_calls == lo)
                min_calls = lo
            i = j
        for c in left:
            if id(c) in keep:
                out[id(c)] = layer
        left = [c for c in left if id(c) not in keep]
        layer += 1
    return out


def rank(cands: Sequence[Candidate], objective: str = "peak", scope: str = "recording"
         ) -> list[Candidate]:
    """``cands`` best first under ``objective`` (see the module docstring), minimising the peak
    reserved of ``scope`` (:data:`PEAK_SCOPES`); ties go to the other scope's peak."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    cands = list(cands)
    other = "trace" if scope == "recording" else "recording"
    if objective == "peak":
        return sorted(cands, key=lambda c: (c.ooms > 0, peak_of(c, scope), c.device_calls,
                                            peak_of(c, other), c.ooms, *_tie(c)))
    if objective == "mallocs":
        lead = _mallocs_key(cands, scope)
        return sorted(cands, key=lambda c: (*lead(c), peak_of(c, other), c.ooms, *_tie(c)))
    ok = [c for c in cands if c.ooms == 0]
    layer = _layers(ok, scope)
    knee = _knee(pareto_front(ok, scope), scope) if ok else None
    return sorted(cands, key=lambda c: (c.ooms > 0, c is not knee, layer.get(id(c), 1 << 30),
                                        peak_of(c, scope), c.device_calls, peak_of(c, other),
                                        *_tie(c)))


def _mallocs_key(cands: Sequence[Candidate], scope: str) -> Any:
    """The ``mallocs`` order's leading key over ``cands``: out of memory last, then within
    :data:`MALLOCS_PEAK_SLACK` of the lowest peak, fewest device calls, lowest peak."""
    ok = [peak_of(c, scope) for c in cands if c.ooms == 0] or [peak_of(c, scope) for c in cands]
    limit = min(ok) * (1 + MALLOCS_PEAK_SLACK) if ok else 0
    return lambda c: (c.ooms > 0, peak_of(c, scope) > limit, c.device_calls, peak_of(c, scope))


def _knee(front: Sequence[Candidate], scope: str = "recording") -> Candidate | None:
    """The front point with the smallest summed relative excess over the front's best on each
    axis: ``peak / min_peak + (calls + 1) / (min_calls + 1)``; ties to the lower peak."""
    if not front:
        return None
    p0 = min(peak_of(c, scope) for c in front) or 1
    k0 = min(c.device_calls for c in front) + 1
    return min(front, key=lambda c: (peak_of(c, scope) / p0 + (c.device_calls + 1) / k0,
                                     peak_of(c, scope)))

