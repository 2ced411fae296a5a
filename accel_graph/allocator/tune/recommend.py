"""What a search found, and how the recommendation is chosen from its ranking.

:class:`TuneResult` is :func:`~.search.tune`'s answer. :func:`prefer_warning_free` passes over a
best-ranked configuration that draws a high-severity warning of :func:`~.advice.advise` when a
warning-free one comes within :data:`WARNING_FREE_SLACK`; :func:`accuracy_report` compares the
baseline replay with the recording (``accel-alloc validate``'s figures);
:func:`uses_private_pools` says whether the trace allocates into private pools (which the advice
depends on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..alloc_conf import parse_config
from ..sim import profiles as _profiles
from .advice import advise
from .ranking import Candidate, peak_of

__all__ = ["WARNING_FREE_SLACK", "TuneResult", "accuracy_report", "high_warnings",
           "prefer_warning_free", "uses_private_pools"]


@dataclass
class TuneResult:
    """What :func:`tune` found. ``candidates``: every evaluated configuration of the profile's
    policy, best first; ``alternatives``: the same trace under the other engine policies (for
    comparison, never recommended); ``recommended``: ``candidates[0]`` (``peak``/``mallocs``) or
    the front's knee (``pareto``)."""

    profile: _profiles.Profile
    policy: str
    objective: str
    cap: int | None
    device: int
    budget: int
    baseline: Candidate
    baseline_config: str | None  # canonical recorded settings; None when they do not parse
    candidates: list[Candidate]
    pareto: list[Candidate]
    alternatives: list[Candidate]
    recommended: Candidate
    accuracy: dict[str, Any]
    skipped: list[tuple[str, str]]
    stages: dict[str, int]
    rejected: int
    space_size: int
    seconds: float
    private_pools: bool = False
    #: the peak reserved the ranking minimised (:data:`~.ranking.PEAK_SCOPES`)
    peak_scope: str = "recording"
    #: the best-ranked configuration when it carried a high-severity warning and a
    #: warning-free one within :data:`WARNING_FREE_SLACK` was recommended instead: its
    #: ``config``, warning ``codes`` and ``peak_difference`` (bytes the recommendation gives up)
    passed_over: dict[str, Any] | None = None
    #: the torch config-parser rules the configs were read with and why: ``{"torch": "2.14",
    #: "chosen_by": ...}`` (:class:`~..sim.scenario.Scenario`'s ``rules``/``rules_chosen_by``)
    config_rules: dict[str, str] | None = None

    @property
    def evaluated(self) -> int:
        """Distinct configurations evaluated (the profile's policy; alternatives not counted)."""
        return len(self.candidates)

    def groups(self) -> list[tuple[Candidate, list[Candidate]]]:
        """The ranked candidates with equivalent results folded: (best, others), in rank
        order."""
        out: dict[tuple[int, ...], tuple[Candidate, list[Candidate]]] = {}
        for c in self.candidates:
            k = c.metrics()
            if k in out:
                out[k][1].append(c)
            else:
                out[k] = (c, [])
        return list(out.values())


#: A configuration that carries one of the tool's own high-severity warnings is recommended
#: only when no warning-free configuration comes within this fraction of its peak.
WARNING_FREE_SLACK = 0.001


def high_warnings(c: Candidate, profile: _profiles.Profile, device: str,
                  uses: tuple[str, ...] = (), private_pools: bool = False) -> list[str]:
    """Codes of the high-severity warnings :func:`~.advice.advise` gives ``c``'s config (the
    environment not considered: it is the same for every configuration)."""
    if c.config is None:
        return []
    settings = parse_config(c.config, device)
    return [a.code for a in advise(settings, profile, uses=uses, private_pools=private_pools)
            if a.severity == "high"]


def prefer_warning_free(ranked: list[Candidate], scope: str, profile: _profiles.Profile,
                         device: str, uses: tuple[str, ...], private_pools: bool
                         ) -> tuple[Candidate, dict[str, Any] | None]:
    """``ranked[0]``, unless it carries a high-severity warning and a warning-free candidate
    with no more out-of-memory events is within :data:`WARNING_FREE_SLACK` of its peak (of
    ``scope``): then the best such one, and what was passed over."""
    top = ranked[0]
    codes = high_warnings(top, profile, device, uses, private_pools)
    if not codes:
        return top, None
    limit = peak_of(top, scope) * (1 + WARNING_FREE_SLACK)
    for c in ranked[1:]:
        if c.ooms <= top.ooms and peak_of(c, scope) <= limit and not high_warnings(
                c, profile, device, uses, private_pools):
            return c, {"config": top.config, "label": top.label, "codes": codes,
                       "peak_difference": peak_of(c, scope) - peak_of(top, scope),
                       "peak_scope": scope}
    return top, None


def accuracy_report(baseline: Candidate, rec: dict[str, Any], as_config: bool) -> dict[str, Any]:
    """The validate comparison (``accel-alloc validate``): the baseline replay vs the recording."""
    pairs = {"peak_reserved": baseline.peak_reserved, "segment_alloc": baseline.device_mallocs,
             "segment_free": baseline.device_frees, "segment_map": baseline.maps,
             "segment_unmap": baseline.unmaps}
    metrics = {}
    for key, s in pairs.items():
        r = int(rec[key])
        metrics[key] = {"simulated": int(s), "recorded": r, "error": int(s) - r,
                        "relative_error": (round((s - r) / r, 6) if r
                                           else (0.0 if s == 0 else None))}
    rel = metrics["peak_reserved"]["relative_error"]
    return {
        "metrics": metrics,
        "peak_error_pct": None if rel is None else round(abs(rel) * 100, 3),
        "exact": all(m["error"] == 0 for m in metrics.values()),
        "baseline_as_config": as_config,
    }


def uses_private_pools(trace: Any, device: int) -> bool:
    """Whether the trace allocates into private pools (CUDA graphs, MemPool): a nonzero event
    ``pool`` or a segment with a nonzero ``segment_pool_id``."""
    ev = trace.events(device)
    if "pool" in (ev.dtype.names or ()) and len(ev) and bool((ev["pool"] != 0).any()):
        return True
    for s in trace.segments:
        if s.get("device", device) != device:
            continue
        pid = s.get("segment_pool_id")
        if pid is not None and any(int(x) for x in (pid if isinstance(pid, (tuple, list))
                                                    else (pid,))):
            return True
    return False
