"""Allocator tuning: search ``PYTORCH_ALLOC_CONF`` settings for one recorded trace.

The library side of ``accel-alloc tune`` (docs/accel-alloc-tune.md). :func:`build_space` lists
the knobs a profile honours and the values tried (and which knobs are skipped, and why);
:func:`search_space` is its full grid as canonical config strings; :func:`tune` evaluates a
structured subset of it with :func:`~accel_graph.allocator.sim.scenario.simulate` (one C call per
configuration) and ranks the results.

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
is evaluated or recommended. Candidates under the other engine policies (``engine.POLICIES``) are
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError
from ..alloc_conf import AllocatorSettings, parse_config
from ..core.engine import POLICIES, POLICY_KEYS
from ..sim import profiles as _profiles
from ..sim.scenario import (
    CONFIG_DEVICE,
    CapacityError,
    Figures,
    UnsupportedTraceError,
    make_scenario,
    recorded_settings,
    scenario_profile,
    simulate,
)

__all__ = [
    "DEFAULT_BUDGET",
    "KNOB_VALUES",
    "MALLOCS_PEAK_SLACK",
    "OBJECTIVES",
    "Candidate",
    "SearchSpace",
    "TuneResult",
    "build_space",
    "pareto_front",
    "rank",
    "search_space",
    "tune",
]

MIB = 1 << 20
OBJECTIVES = ("peak", "mallocs", "pareto")
#: configurations evaluated by default (the policy comparison rows come on top).
DEFAULT_BUDGET = 256
#: ``mallocs`` objective: peak reserved may exceed the lowest peak by this fraction.
MALLOCS_PEAK_SLACK = 0.05

#: Values tried per knob (``None``/unset is always tried too). ``max_split`` is the pair
#: (max_split_size_mb, max_non_split_rounding_mb): the rounding window only acts with a split
#: limit, so it is searched inside it. ``gc`` is (garbage_collection_threshold,
#: per_process_memory_fraction): the threshold is inert without a fraction (pytorch#106660).
KNOB_VALUES: dict[str, tuple[Any, ...]] = {
    "max_split": tuple((ms, mnsr) for ms in (32, 64, 128, 256, 512)
                       for mnsr in (None, 64, 256, 1024)),
    "roundup_power2_divisions": ("2", "4", "8", "16", "[256:2,512:4,1024:8,>:16]",
                                 "[512:8,>:4]", "[512:4,>:8]", "[2:0,>:4]"),
    "large_segment_size_mb": (32, 64),
    "gc": tuple((thr, frac) for thr in (0.6, 0.8) for frac in (0.9, 0.95)),
}
_KNOBS = tuple(KNOB_VALUES)
_PAIR_TOP = 3
_COMBINE_TOP = 2
_REFINE_TOP = 5


# ---------------------------------------------------------------------------------------------
# the space


@dataclass(frozen=True)
class SearchSpace:
    """The knobs a profile honours, the values tried for each, and the knobs skipped (with the
    reason). ``expandable`` lists the expandable_segments values tried."""

    profile: _profiles.Profile
    policy: str
    device: str  # config.py's device vocabulary (cuda, hip, xpu)
    expandable: tuple[bool, ...]
    knobs: dict[str, tuple[Any, ...]]
    skipped: tuple[tuple[str, str], ...]
    cap: int | None = None

    def config_string(self, es: bool, choice: dict[str, Any]) -> str:
        """The (not yet canonical) config string of one grid point."""
        parts: list[str] = []
        lss = choice.get("large_segment_size_mb")
        if lss is not None:
            parts.append(f"large_segment_size_mb:{lss}")
        ms = choice.get("max_split")
        if ms is not None:
            parts.append(f"max_split_size_mb:{ms[0]}")
            if ms[1] is not None:
                parts.append(f"max_non_split_rounding_mb:{ms[1]}")
        rp2 = choice.get("roundup_power2_divisions")
        if rp2 is not None:
            parts.append(f"roundup_power2_divisions:{rp2}")
        if es:
            parts.append("expandable_segments:True")
        gc = choice.get("gc")
        if gc is not None:
            parts.append(f"garbage_collection_threshold:{gc[0]}")
            parts.append(f"per_process_memory_fraction:{gc[1]}")
        return ",".join(parts)

    def canonical(self, text: str) -> str | None:
        """The canonical form of ``text`` on this device, or None when torch would reject it."""
        try:
            return parse_config(text, self.device).to_string()
        except ConfigError:
            return None

    def grid(self) -> list[tuple[bool, dict[str, Any]]]:
        """Every grid point (valid or not), in a fixed order."""
        names = list(self.knobs)
        axes = [(None, *self.knobs[n]) for n in names]
        return [(es, dict(zip(names, combo))) for es in self.expandable
                for combo in itertools.product(*axes)]


def build_space(trace: Any, profile: str | _profiles.Profile | None = None,
                cap: int | None = None, policy: str | None = None) -> SearchSpace:
    """The knobs and values :func:`tune` searches for ``trace`` under ``profile``.

    Knobs the profile does not honour (``Profile.settings_keys``), or that its engine policy
    ignores, are skipped with the reason; so is expandable_segments where the build has none,
    and the garbage-collection pair without a capacity.
    """
    prof = scenario_profile(trace, profile)
    pol = policy or prof.policy
    keys = prof.settings_keys
    acts = POLICY_KEYS[pol]
    skipped: list[tuple[str, str]] = []

    def ignored_by_policy(key: str) -> bool:
        if key in acts:
            return False
        skipped.append((key, f"the {pol} policy ignores it; it would change nothing"))
        return True

    if not (prof.expandable_segments and "expandable_segments" in keys):
        expandable: tuple[bool, ...] = (False,)
        skipped.append(("expandable_segments",
                        f"profile {prof.name} has no expandable segments"
                        if not prof.expandable_segments else
                        f"profile {prof.name} does not honour expandable_segments"))
    elif ignored_by_policy("expandable_segments"):
        expandable = (False,)
    else:
        expandable = (False, True)
    knobs: dict[str, tuple[Any, ...]] = {}
    # max_split_size_mb (+ max_non_split_rounding_mb)
    if "max_split_size_mb" not in keys:
        skipped.append(("max_split_size_mb", f"profile {prof.name} does not honour it"))
    elif ignored_by_policy("max_split_size_mb"):
        pass
    else:
        values = KNOB_VALUES["max_split"]
        if "max_non_split_rounding_mb" not in keys:
            values = tuple(v for v in values if v[1] is None)
            skipped.append(("max_non_split_rounding_mb",
                            f"profile {prof.name} does not honour it"))
        knobs["max_split"] = values
    # roundup_power2_divisions
    if "roundup_power2_divisions" not in keys:
        skipped.append(("roundup_power2_divisions", f"profile {prof.name} does not honour it"))
    elif ignored_by_policy("roundup_power2_divisions"):
        pass
    elif prof.rounding == "xpu":
        skipped.append(("roundup_power2_divisions",
                        "the xpu allocator rounds to 512 bytes only; the divisions are not applied"))
    elif not prof.roundup_applied:
        skipped.append(("roundup_power2_divisions",
                        f"profile {prof.name} does not apply it (PR #160666)"))
    else:
        knobs["roundup_power2_divisions"] = KNOB_VALUES["roundup_power2_divisions"]
    # large_segment_size_mb
    if "large_segment_size_mb" in keys:
        if not ignored_by_policy("large_segment_size_mb"):
            knobs["large_segment_size_mb"] = KNOB_VALUES["large_segment_size_mb"]
    else:
        skipped.append(("large_segment_size_mb", f"profile {prof.name} does not honour it "
                        f"(fixed at {prof.large_segment_size // MIB} MiB; configurable from "
                        "torch 2.13)"))
    # garbage_collection_threshold + per_process_memory_fraction
    if cap is None:
        skipped.append(("garbage_collection_threshold",
                        "needs --cap: the threshold acts only with per_process_memory_fraction "
                        "(pytorch#106660), and a fraction needs the device's size"))
    elif "per_process_memory_fraction" not in keys or "garbage_collection_threshold" not in keys:
        skipped.append(("garbage_collection_threshold",
                        f"profile {prof.name} has no per_process_memory_fraction config key "
                        "(torch 2.13+), and the threshold is inert without a fraction "
                        "(pytorch#106660)"))
    elif not ignored_by_policy("garbage_collection_threshold"):
        knobs["gc"] = KNOB_VALUES["gc"]
    return SearchSpace(prof, pol, CONFIG_DEVICE.get(prof.device, "cuda"), expandable, knobs,
                       tuple(skipped), cap)


def search_space(trace: Any, profile: str | _profiles.Profile | None = None,
                 cap: int | None = None) -> list[str]:
    """The full grid for ``trace`` under ``profile`` as distinct canonical config strings (each
    one parses on the profile's device), in a fixed order. :func:`tune` evaluates a structured
    subset of it."""
    space = build_space(trace, profile, cap)
    seen: dict[str, None] = {}
    for es, choice in space.grid():
        c = space.canonical(space.config_string(es, choice))
        if c is not None:
            seen.setdefault(c, None)
    return list(seen)


# ---------------------------------------------------------------------------------------------
# candidates and ranking


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


def _entries(config: str | None) -> set[str]:
    from ..sim.scenario import top_level_entries

    return {e for e in top_level_entries(config or "") if e}


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
         seed: int = 0, compare_policies: bool = True) -> TuneResult:
    """Search allocator settings for one device of ``trace``.

    ``objective``: ``peak``, ``mallocs`` or ``pareto``; ``cap``: device size in bytes (enables
    the garbage-collection knobs; configurations that run out of memory rank last); ``profile``:
    a profile name or device (default: the trace's device, newest torch); ``budget``: how many
    configurations of the profile's policy to evaluate (at least 2); ``progress(done, total)``:
    called after each evaluation; ``jobs``: worker processes (fork); ``seed``: the fill stage's
    random order. Raises :class:`~accel_graph.allocator.sim.scenario.UnsupportedTraceError` (unknown
    profile, no events), :class:`~accel_graph.allocator.sim.scenario.CapacityError` (``cap`` below the
    largest allocation, or no ``cap`` for a trace recorded with a memory fraction) and
    ``ValueError`` for a bad objective or budget.
    """
    from ..sim.replayer import recorded_summary

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if budget < 2:
        raise ValueError(f"budget must be at least 2 (the baseline and one candidate); got {budget}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1; got {jobs}")
    t0 = time.perf_counter()
    if not len(trace.events(device)):
        raise UnsupportedTraceError(f"the trace has no events for device {device}")
    base_sc = make_scenario(trace, None, profile=profile, cap=cap, device=device)  # checks cap
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
        base_cfg: str | None = parse_config(rec.to_string(), space.device).to_string()
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
            order = rank(list(evaluated.values()), objective)
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
        best = [c for c in rank(list(evaluated.values()), objective) if c.choice is not None]
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
        ranked = rank(list(evaluated.values()), objective)
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
    ranked = rank(list(evaluated.values()), objective)
    front = pareto_front(ranked)
    recommended = ranked[0]
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
        seconds=time.perf_counter() - t0, private_pools=_private_pools(trace, device),
    )


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
