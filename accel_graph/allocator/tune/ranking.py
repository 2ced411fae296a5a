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

__all__ = ["MALLOCS_PEAK_SLACK", "OBJECTIVES", "Candidate", "delta", "pareto_front", "rank"]

OBJECTIVES = ("peak", "mallocs", "pareto")
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

    def metrics(self) -> tuple[int, int, int, int, int, int]:
        """What two configurations must share to be equivalent results."""
        return (self.peak_reserved, self.device_mallocs, self.device_frees, self.maps,
                self.unmaps, self.ooms)

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
    return {
        "peak_reserved": d,
        "peak_reserved_relative": (round(d / baseline.peak_reserved, 6)
                                   if baseline.peak_reserved else None),
        "device_calls": c.device_calls - baseline.device_calls,
        "ooms": c.ooms - baseline.ooms,
    }



def _tie(c: Candidate) -> tuple[int, int, str]:
    return (c.distance, len(c.config or ""), c.config or "")


def pareto_front(cands: Iterable[Candidate]) -> list[Candidate]:
    """The non-dominated candidates on (peak reserved, device calls), both minimised, among
    those without out-of-memory events (all of them when every one has some); one per point
    (the one closest to the baseline), sorted by peak reserved."""
    pool = list(cands)
    ok = [c for c in pool if c.ooms == 0] or pool
    best: dict[tuple[int, int], Candidate] = {}
    for c in ok:
        k = (c.peak_reserved, c.device_calls)
        if k not in best or _tie(c) < _tie(best[k]):
            best[k] = c
    front: list[Candidate] = []
    min_calls = None
    for k in sorted(best):  # by peak, then calls: a point is kept when its calls improve
        if min_calls is None or k[1] < min_calls:
            front.append(best[k])
            min_calls = k[1]
    return front


def _layers(cands: Sequence[Candidate]) -> dict[int, int]:
    """Non-dominated sorting on (peak reserved, device calls): id(candidate) -> front index
    (0 = the Pareto front). Equal points share a front."""
    left = list(cands)
    out: dict[int, int] = {}
    layer = 0
    while left:
        pts = sorted(left, key=lambda c: (c.peak_reserved, c.device_calls))
        keep: set[int] = set()
        min_calls: int | None = None  # fewest calls among strictly lower peaks
        i = 0
        while i < len(pts):
            j = i
            while j < len(pts) and pts[j].peak_reserved == pts[i].peak_reserved:
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


def rank(cands: Sequence[Candidate], objective: str = "peak") -> list[Candidate]:
    """``cands`` best first under ``objective`` (see the module docstring)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    cands = list(cands)
    if objective == "peak":
        return sorted(cands, key=lambda c: (c.ooms > 0, c.peak_reserved, c.device_calls,
                                            c.ooms, *_tie(c)))
    if objective == "mallocs":
        ok = [c.peak_reserved for c in cands if c.ooms == 0] or [c.peak_reserved for c in cands]
        limit = min(ok) * (1 + MALLOCS_PEAK_SLACK) if ok else 0
        return sorted(cands, key=lambda c: (c.ooms > 0, c.peak_reserved > limit, c.device_calls,
                                            c.peak_reserved, c.ooms, *_tie(c)))
    ok = [c for c in cands if c.ooms == 0]
    layer = _layers(ok)
    knee = _knee(pareto_front(ok)) if ok else None
    return sorted(cands, key=lambda c: (c.ooms > 0, c is not knee, layer.get(id(c), 1 << 30),
                                        c.peak_reserved, c.device_calls, *_tie(c)))


def _knee(front: Sequence[Candidate]) -> Candidate | None:
    """The front point with the smallest summed relative excess over the front's best on each
    axis: ``peak / min_peak + (calls + 1) / (min_calls + 1)``; ties to the lower peak."""
    if not front:
        return None
    p0 = min(c.peak_reserved for c in front) or 1
    k0 = min(c.device_calls for c in front) + 1
    return min(front, key=lambda c: (c.peak_reserved / p0 + (c.device_calls + 1) / k0,
                                     c.peak_reserved))

