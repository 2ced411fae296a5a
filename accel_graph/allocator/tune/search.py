"""Allocator tuning: search ``PYTORCH_ALLOC_CONF`` settings for one recorded trace.

The library side of ``accel-alloc tune`` (docs/accel-alloc-tune.md). :func:`build_space` lists
the knobs a profile honours and the values tried (and which knobs are skipped, and why);
:func:`search_space` is its full grid as canonical config strings; :func:`tune` evaluates a
structured subset of it with :func:`~accel_graph.allocator.sim.scenario.simulate` (one C call per
configuration) and ranks the results (:mod:`.ranking`). :func:`build_space`/:func:`search_space`
live in :mod:`.space` (with :data:`~.space.KNOB_VALUES` and :class:`~.space.SearchSpace`), the
ranking (:func:`~.ranking.rank`, :func:`~.ranking.pareto_front`, :class:`~.ranking.Candidate`) in
:mod:`.ranking`, the evaluation of one configuration (and the fork pool) in :mod:`.evaluator`,
:class:`TuneResult` and the choice among the best in :mod:`.recommend`; this module is the search
itself, the front of ``accel-alloc tune``.

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
from typing import Any

import numpy as np

from ...errors import CapacityError, ConfigError, UnsupportedTraceError
from ..alloc_conf import AllocatorSettings, parse_config
from ..core.settings import POLICIES, POLICY_KEYS
from ..sim import profiles as _profiles
from ..sim.scenario import make_scenario, recorded_settings, top_level_entries
from ..units import MIB
from .evaluator import Evaluator, evaluate_one
from .ranking import OBJECTIVES, PEAK_SCOPES, Candidate, pareto_front, rank
from .recommend import (
    WARNING_FREE_SLACK,
    TuneResult,
    accuracy_report,
    high_warnings,
    prefer_warning_free,
    uses_private_pools,
)
from .space import KNOB_VALUES, SearchSpace, build_space, search_space

__all__ = ["DEFAULT_BUDGET", "WARNING_FREE_SLACK", "TuneResult", "high_warnings", "tune"]

#: configurations evaluated by default (the policy comparison rows come on top).
DEFAULT_BUDGET = 256
_KNOBS = tuple(KNOB_VALUES)
_PAIR_TOP = 3
_COMBINE_TOP = 2
_REFINE_TOP = 5


def _entries(config: str | None) -> set[str]:
    return {e for e in top_level_entries(config or "") if e}


# ---------------------------------------------------------------------------------------------
# the search


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
    ev = Evaluator(trace, space, device, jobs, progress, budget + n_alt)
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
            baseline = Candidate(config=None, policy=pol, stage="baseline", **evaluate_one(
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
    private = uses_private_pools(trace, device)
    recommended, passed_over = prefer_warning_free(ranked, peak, space.profile, space.device,
                                                    uses, private)
    # Imported here for start-up time only (not a cycle): it loads the engine's module, which
    # `accel-alloc tune --help` does not need.
    from ..sim.trace_ops import recorded_summary

    summary = recorded_summary(trace, device)
    if cap is None or rec.per_process_memory_fraction < 1.0:
        acc_base = baseline  # a recorded fraction needs the cap to have a size
    else:  # the validate comparison replays the recording as it ran: without a cap
        acc_base = Candidate(config=None, policy=pol, stage="validate", **evaluate_one(
            trace, None, pol, space.profile, None, device, ev.ops_cache))
    accuracy = accuracy_report(acc_base, summary, base_cfg is not None)
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


