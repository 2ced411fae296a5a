"""Allocator tuning: search ``PYTORCH_ALLOC_CONF`` settings for one recorded trace.

The library side of ``accel-alloc tune`` (docs/accel-alloc-tune.md). :func:`build_space` lists
the knobs a profile honours and the values tried (and which knobs are skipped, and why);
:func:`search_space` is its full grid as canonical config strings; :func:`tune` evaluates a
structured subset of it with :func:`~accel_graph.allocator.sim.scenario.simulate` (one C call per
configuration) and ranks the results (:mod:`.ranking`). :func:`build_space`/:func:`search_space`
live in :mod:`.space` (with :data:`~.space.KNOB_VALUES` and :class:`~.space.SearchSpace`), the
ranking (:func:`~.ranking.rank`, :func:`~.ranking.pareto_front`, :class:`~.ranking.Candidate`) in
:mod:`.ranking`; this module is the search itself, the front of ``accel-alloc tune``.

Search design (a full grid is about a thousand configurations; the default budget is 256):

1. ``baseline``: the recorded settings (and torch's defaults);
2. ``single``: every single-knob variation, from defaults and from ``expandable_segments:True``;
3. ``pairs``: every pair of knobs at their three best values (unset included), with and without
   expandable segments;
4. ``combine``: the product of every knob's two best values;
5. ``refine``: every one-knob neighbour of the five best configurations so far;
6. ``fill``: seeded random grid points until the budget is spent.

Every candidate is parsed with :func:`~accel_graph.allocator.alloc_conf.parse_config` for the
profile's device and deduplicated by its canonical string
(:meth:`~accel_graph.allocator.alloc_conf.AllocatorSettings.to_string`), so nothing torch would reject
is evaluated or recommended. Candidates under the other engine policies (``core.settings.POLICIES``) are
evaluated too, for comparison: a policy is not selectable with an environment variable, so they
are never ranked or recommended.

Objectives: ``peak`` (lowest peak reserved), ``mallocs`` (fewest synchronising device calls --
mallocs, frees, maps, unmaps -- among configurations within 5 % of the lowest peak), ``pareto``
(the Pareto front of peak reserved vs device calls; the recommendation is its knee). Ties go to
fewer device calls, fewer out-of-memory events, then the configuration closest to the baseline
(fewest changed entries, then the shortest string). With a capacity, configurations that run
out of memory are ranked last and flagged.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CapacityError, ConfigError, UnsupportedTraceError
from ..alloc_conf import AllocatorSettings, parse_config
from ..core.settings import POLICIES, POLICY_KEYS
from ..sim import profiles as _profiles
from ..sim.scenario import make_scenario, recorded_settings, simulate
from ..units import MIB
from .ranking import OBJECTIVES, PEAK_SCOPES, Candidate, pareto_front, peak_of, rank
from .space import KNOB_VALUES, SearchSpace, build_space, search_space

__all__ = ["DEFAULT_BUDGET", "WARNING_FREE_SLACK", "TuneResult", "high_warnings", "tune"]

#: configurations evaluated by default (the policy comparison rows come on top).
DEFAULT_BUDGET = 256
_KNOBS = tuple(KNOB_VALUES)
_PAIR_TOP = 3
_COMBINE_TOP = 2
_REFINE_TOP = 5


def _entries(config: str | None) -> set[str]:
    from ..sim.scenario import top_level_entries

    return {e for e in top_level_entries(config or "") if e}


# ---------------------------------------------------------------------------------------------
# evaluation


_WORKER: dict[str, Any] = {}


def _evaluate_one(trace: Any, config: str | None, policy: str, profile: _profiles.Profile,
                  cap: int | None, device: int,
                  ops_cache: dict[Any, Any] | None = None) -> dict[str, Any]:
    sc = make_scenario(trace, config, policy=policy, profile=profile, cap=cap, device=device)
    r = simulate(trace, sc, device=device, ops_cache=ops_cache)
    return {**r.figures(), "notes": tuple(sc.notes) + tuple(r.notes)}


def _worker_init(trace: Any, profile: _profiles.Profile, cap: int | None, device: int) -> None:
    _WORKER.update(trace=trace, profile=profile, cap=cap, device=device, ops={})


def _worker_eval(job: tuple[str, str]) -> dict[str, Any]:
    w = _WORKER
    return _evaluate_one(w["trace"], job[0], job[1], w["profile"], w["cap"], w["device"],
                         w["ops"])


class _Evaluator:
    """Evaluates batches of (config, policy), in this process or in a fork pool."""

    def __init__(self, trace: Any, space: SearchSpace, device: int, jobs: int,
                 progress: Callable[[int, int], None] | None, total: int) -> None:
        self.trace, self.space, self.device = trace, space, device
        #: one search, one unchanging trace: each distinct conversion is made once
        self.ops_cache: dict[Any, Any] = {}
        self.progress, self.total, self.done = progress, total, 0
        self.pool = None
        if jobs > 1:
            import multiprocessing as mp

            methods = mp.get_all_start_methods()
            ctx = mp.get_context("fork" if "fork" in methods else None)
            self.pool = ctx.Pool(jobs, initializer=_worker_init,
                                 initargs=(trace, space.profile, space.cap, device))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None

    def run(self, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        if self.pool is not None and len(jobs) > 1:
            out = []
            for r in self.pool.imap(_worker_eval, jobs, chunksize=max(1, len(jobs) // 32)):
                out.append(r)
                self._tick()
            return out
        out = []
        for cfg, pol in jobs:
            out.append(_evaluate_one(self.trace, cfg, pol, self.space.profile, self.space.cap,
                                     self.device, self.ops_cache))
            self._tick()
        return out

    def _tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.total = max(self.total, self.done)
            self.progress(self.done, self.total)


# ---------------------------------------------------------------------------------------------
# the search


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


def _baseline_choice(space: SearchSpace, s: AllocatorSettings,
                     canonical: str) -> dict[str, Any] | None:
    """The recorded settings as a grid-style choice (so the search can refine around them), or
    None when they use keys or values the choice cannot express."""
    ch: dict[str, Any] = {}
    if s.large_segment_size != 20 * MIB:
        ch["large_segment_size_mb"] = s.large_segment_size // MIB
    if s.max_split_size is not None:
        mnsr = s.max_non_split_rounding_size
        ch["max_split"] = (s.max_split_size // MIB,
                           None if mnsr == s.large_segment_size else mnsr // MIB)
    for entry in _entries(canonical):
        if entry.startswith("roundup_power2_divisions:"):
            ch["roundup_power2_divisions"] = entry.split(":", 1)[1]
    if s.garbage_collection_threshold > 0 and s.per_process_memory_fraction < 1.0:
        ch["gc"] = (s.garbage_collection_threshold, s.per_process_memory_fraction)
    if space.canonical(space.config_string(s.expandable_segments, ch)) != canonical:
        return None
    return ch


def tune(trace: Any, *, objective: str = "peak", cap: int | None = None,
         profile: str | _profiles.Profile | None = None, budget: int = DEFAULT_BUDGET,
         progress: Callable[[int, int], None] | None = None, device: int = 0, jobs: int = 1,
         seed: int = 0, compare_policies: bool = True, peak: str = "recording",
         uses: tuple[str, ...] = (), torch: str | None = None) -> TuneResult:
    """Search allocator settings for one device of ``trace``.

    ``objective``: ``peak``, ``mallocs`` or ``pareto``; ``cap``: device size in bytes (enables
    the garbage-collection knobs; configurations that run out of memory rank last); ``profile``:
    a profile name or device (default: the trace's device, newest torch); ``budget``: how many
    configurations of the profile's policy to evaluate (at least 2); ``progress(done, total)``:
    called after each evaluation; ``jobs``: worker processes (fork); ``seed``: the fill stage's
    random order; ``peak``: the peak reserved the objective minimises (``recording``: the
    recording's own, the default; ``trace``: the whole trace's, the rebuilt start state
    included; :data:`~.ranking.PEAK_SCOPES`); ``uses``: the program's features that conflict
    with expandable segments (:data:`~.advice.USES`), for the high-severity warnings that keep a
    configuration from being recommended when a warning-free one is within
    :data:`WARNING_FREE_SLACK` of it; ``torch``: the trace's torch version when known (picks
    the config rules and, without ``profile``, the profile: :func:`~..sim.scenario.make_scenario`).
    Raises :class:`~accel_graph.errors.UnsupportedTraceError` (unknown
    profile, no events), :class:`~accel_graph.errors.CapacityError` (``cap`` below the
    largest allocation, or no ``cap`` for a trace recorded with a memory fraction) and
    ``ValueError`` for a bad objective or budget.
    """
    from ..sim.trace_ops import recorded_summary

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if peak not in PEAK_SCOPES:
        raise ValueError(f"peak must be one of {', '.join(PEAK_SCOPES)}; got {peak!r}")
    if budget < 2:
        raise ValueError(f"budget must be at least 2 (the baseline and one candidate); got {budget}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1; got {jobs}")
    t0 = time.perf_counter()
    if not len(trace.events(device)):
        raise UnsupportedTraceError(f"the trace has no events for device {device}")
    base_sc = make_scenario(trace, None, profile=profile, cap=cap, device=device,  # checks cap
                            torch=torch)
    space = build_space(trace, base_sc.profile, cap)
    pol = space.policy
    rec = recorded_settings(trace, device)
    if rec.per_process_memory_fraction < 1.0 and cap is None:
        raise CapacityError(
            f"the trace was recorded with per_process_memory_fraction:"
            f"{rec.per_process_memory_fraction!r}, which limits memory to a fraction of the "
            "device; pass --cap with the device's memory (e.g. --cap 80GiB) so the baseline "
            "can be replayed")
    try:
        # read with the scenario's rules: a recorded key this torch refuses (a --torch older
        # than the recording) leaves the baseline "as recorded", with make_scenario's note,
        # instead of a candidate string every replay would refuse
        base_cfg: str | None = parse_config(rec.to_string(), space.device,
                                            base_sc.rules).to_string()
    except ConfigError:
        base_cfg = None
    base_entries = _entries(base_cfg or "")
    alt_policies = [p for p in POLICIES if p != pol] if compare_policies else []
    n_alt = 3 * len(alt_policies)
    ev = _Evaluator(trace, space, device, jobs, progress, budget + n_alt)
    evaluated: dict[str, Candidate] = {}
    rejected = 0
    stages: dict[str, int] = {}

    def make(cfg: str | None, stage: str, metrics: dict[str, Any], policy: str,
             es: bool | None, choice: dict[str, Any] | None) -> Candidate:
        return Candidate(config=cfg, policy=policy, stage=stage, distance=len(
            _entries(cfg) ^ base_entries), es=es, choice=choice, **metrics)

    def submit(stage: str, points: Iterable[tuple[bool | None, dict[str, Any] | None, str]]
               ) -> None:
        nonlocal rejected
        batch: list[tuple[str, bool | None, dict[str, Any] | None]] = []
        queued: set[str] = set()
        for es, choice, text in points:
            if len(evaluated) + len(batch) >= budget:
                break
            cfg = space.canonical(text)
            if cfg is None:
                rejected += 1
                continue
            if cfg in evaluated or cfg in queued:
                continue
            queued.add(cfg)
            batch.append((cfg, es, choice))
        results = ev.run([(cfg, pol) for cfg, _, _ in batch])
        for (cfg, es, choice), m in zip(batch, results, strict=True):
            evaluated[cfg] = make(cfg, stage, m, pol, es, choice)
        stages[stage] = stages.get(stage, 0) + len(batch)

    def point(es: bool, choice: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
        ch = {k: v for k, v in choice.items() if v is not None}
        return es, ch, space.config_string(es, ch)

    try:
        # 1. baseline (the recorded settings) and torch's defaults
        if base_cfg is None:
            # the recorded settings cannot be written as a config string for this profile:
            # simulate them as recorded; the defaults are searched like any candidate
            baseline = Candidate(config=None, policy=pol, stage="baseline", **_evaluate_one(
                trace, None, pol, space.profile, cap, device, ev.ops_cache))
            ev._tick()
        else:
            submit("baseline", [(rec.expandable_segments,
                                 _baseline_choice(space, rec, base_cfg), base_cfg)])
            baseline = evaluated[base_cfg]
        submit("baseline", [point(False, {})])
        # 2. single-knob variations, from defaults and from expandable segments
        submit("single", [point(es, {}) for es in space.expandable]
               + [point(es, {k: v}) for es in space.expandable
                  for k, values in space.knobs.items() for v in values])

        def best_values(top: int) -> dict[str, list[Any]]:
            order = rank(list(evaluated.values()), objective, peak)
            pos = {id(c): i for i, c in enumerate(order)}
            out: dict[str, list[Any]] = {}
            for k, values in space.knobs.items():
                score: dict[Any, int] = {}
                for c in evaluated.values():
                    if c.choice is None:
                        continue
                    v = c.choice.get(k)
                    if v is None or v in values:
                        score[v] = min(score.get(v, 1 << 30), pos[id(c)])
                ranked_v = sorted(score, key=lambda v: (score[v], v is not None, repr(v)))
                if None not in ranked_v[:top]:  # unset is always a candidate value
                    ranked_v = [*ranked_v[:top - 1], None]
                out[k] = ranked_v[:top]
            return out

        # 3. pairs of knobs at their best values
        top = best_values(_PAIR_TOP)
        pts = []
        for es in space.expandable:
            for k1, k2 in itertools.combinations(space.knobs, 2):
                for v1 in top[k1]:
                    for v2 in top[k2]:
                        pts.append(point(es, {k1: v1, k2: v2}))
        submit("pairs", pts)
        # 4. every knob at one of its two best values
        top = best_values(_COMBINE_TOP)
        names = list(space.knobs)
        submit("combine", [point(es, dict(zip(names, combo))) for es in space.expandable
                           for combo in itertools.product(*(top[n] for n in names))])
        # 5. one-knob neighbours of the best few
        best = [c for c in rank(list(evaluated.values()), objective, peak) if c.choice is not None]
        pts = []
        for c in best[:_REFINE_TOP]:
            assert c.choice is not None and c.es is not None
            for es in space.expandable:
                if es != c.es:
                    pts.append(point(es, c.choice))
            for k, values in space.knobs.items():
                for v in (None, *values):
                    if c.choice.get(k) != v:
                        pts.append(point(c.es, {**c.choice, k: v}))
        submit("refine", pts)
        # 6. random grid points until the budget is spent
        if len(evaluated) < budget:
            grid = space.grid()
            order = np.random.default_rng(seed).permutation(len(grid))
            submit("fill", (point(*grid[i]) for i in order.tolist()))
        # the other engine policies, for comparison
        alts: list[Candidate] = []
        ranked = rank(list(evaluated.values()), objective, peak)
        for ap in alt_policies:
            cfgs = dict.fromkeys([c for c in (baseline.config, "", ranked[0].config)
                                  if c is not None]
                                 + (["expandable_segments:True"] if True in space.expandable
                                    else []))
            # configs that differ only in keys the policy ignores give the same row: keep one
            acts = POLICY_KEYS[ap]
            distinct = {frozenset(e for e in _entries(c) if e.split(":")[0] in acts): c
                        for c in reversed(cfgs)}
            jobs_alt = [(c, ap) for c in cfgs if c in distinct.values()][:3]
            for (cfg, _), m in zip(jobs_alt, ev.run(jobs_alt), strict=True):
                alts.append(make(cfg, "policy", m, ap, None, None))
        if progress is not None:
            progress(ev.done, ev.done)
    finally:
        ev.close()
    ranked = rank(list(evaluated.values()), objective, peak)
    front = pareto_front(ranked, peak)
    private = _private_pools(trace, device)
    recommended, passed_over = _prefer_warning_free(ranked, peak, space.profile, space.device,
                                                    uses, private)
    summary = recorded_summary(trace, device)
    if cap is None or rec.per_process_memory_fraction < 1.0:
        acc_base = baseline  # a recorded fraction needs the cap to have a size
    else:  # the validate comparison replays the recording as it ran: without a cap
        acc_base = Candidate(config=None, policy=pol, stage="validate", **_evaluate_one(
            trace, None, pol, space.profile, None, device, ev.ops_cache))
    accuracy = _accuracy(acc_base, summary, base_cfg is not None)
    return TuneResult(
        profile=space.profile, policy=pol, objective=objective, cap=cap, device=device,
        budget=budget, baseline=baseline, baseline_config=base_cfg, candidates=ranked,
        pareto=front, alternatives=alts, recommended=recommended, accuracy=accuracy,
        skipped=list(space.skipped), stages=stages, rejected=rejected,
        space_size=len(search_space(trace, space.profile, cap)),
        seconds=time.perf_counter() - t0, private_pools=private,
        peak_scope=peak, passed_over=passed_over,
        config_rules={"torch": base_sc.rules, "chosen_by": base_sc.rules_chosen_by},
    )


#: A configuration that carries one of the tool's own high-severity warnings is recommended
#: only when no warning-free configuration comes within this fraction of its peak.
WARNING_FREE_SLACK = 0.001


def high_warnings(c: Candidate, profile: _profiles.Profile, device: str,
                  uses: tuple[str, ...] = (), private_pools: bool = False) -> list[str]:
    """Codes of the high-severity warnings :func:`~.advice.advise` gives ``c``'s config (the
    environment not considered: it is the same for every configuration)."""
    from .advice import advise

    if c.config is None:
        return []
    settings = parse_config(c.config, device)
    return [a.code for a in advise(settings, profile, uses=uses, private_pools=private_pools)
            if a.severity == "high"]


def _prefer_warning_free(ranked: list[Candidate], scope: str, profile: _profiles.Profile,
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


def _accuracy(baseline: Candidate, rec: dict[str, Any], as_config: bool) -> dict[str, Any]:
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


def _private_pools(trace: Any, device: int) -> bool:
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
