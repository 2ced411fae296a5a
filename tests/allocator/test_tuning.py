"""accel_graph.allocator.tune.search: the search space, the search, ranking and the Pareto front."""

from __future__ import annotations

import pytest

from accel_graph.allocator.alloc_conf import parse_config
from accel_graph.allocator.core.settings import POLICIES
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.sim.profiles import PROFILES
from accel_graph.allocator.sim.scenario import largest_request
from accel_graph.allocator.tune.ranking import MALLOCS_PEAK_SLACK, Candidate, pareto_front, rank
from accel_graph.allocator.tune.search import tune
from accel_graph.allocator.tune.space import build_space, search_space
from accel_graph.errors import CapacityError, UnsupportedTraceError

MIB = 1 << 20


@pytest.fixture(scope="module")
def frag():
    return generate("frag", seed=0)


@pytest.fixture(scope="module")
def frag_result(frag):
    return tune(frag)


def _cand(config: str, peak: int, calls: int, ooms: int = 0, distance: int = 0) -> Candidate:
    return Candidate(config=config, policy="native", stage="t", peak_reserved=peak,
                     peak_allocated=None, device_mallocs=calls, device_frees=0, maps=0, unmaps=0,
                     retries=0, ooms=ooms, fragmentation_at_peak=0.0, distance=distance,
                     peak_reserved_recording=peak, start_reserved=0)


def _dominates(a: Candidate, b: Candidate) -> bool:
    return (a.peak_reserved <= b.peak_reserved and a.device_calls <= b.device_calls
            and (a.peak_reserved, a.device_calls) != (b.peak_reserved, b.device_calls))


# ---------------------------------------------------------------------------------------------
# the space


def test_search_space_is_large_valid_canonical_and_distinct(frag):
    space = search_space(frag, "cuda-2.13")
    assert len(space) >= 200
    assert len(set(space)) == len(space)
    for s in space:
        assert parse_config(s, "cuda").to_string() == s  # canonical, and torch accepts it
    assert "" in space and "expandable_segments:True" in space
    assert any("roundup_power2_divisions:[" in s for s in space)  # per-interval lists
    assert any("large_segment_size_mb:64" in s for s in space)
    assert not any("garbage_collection_threshold" in s for s in space)  # no cap: skipped
    for s in space:  # the rounding window only with a split limit; limits >= segment size
        p = parse_config(s)
        if "max_non_split_rounding_mb" in s:
            assert p.max_split_size is not None
        if p.max_split_size is not None:
            assert p.max_split_size >= p.large_segment_size


def test_gc_only_with_a_cap_and_always_with_a_fraction(frag):
    space = search_space(frag, "cuda-2.13", cap=8 << 30)
    gc = [s for s in space if "garbage_collection_threshold" in s]
    assert gc and all("per_process_memory_fraction" in s for s in gc)
    assert not any("per_process_memory_fraction" in s and "garbage" not in s for s in space)
    reasons = dict(build_space(frag, "cuda-2.13").skipped)
    assert "--cap" in reasons["garbage_collection_threshold"]
    assert "pytorch#106660" in reasons["garbage_collection_threshold"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_space_respects_the_profile(frag, profile):
    p = PROFILES[profile]
    sp = build_space(frag, profile, cap=8 << 30)
    space = search_space(frag, profile, cap=8 << 30)
    for s in space:
        keys = {e.split(":", 1)[0] for e in s.split(",") if ":" in e and not e[0].isdigit()
                and not e.startswith(">")}
        assert keys <= p.settings_keys, (s, keys - p.settings_keys)
    if not p.expandable_segments:
        assert not any("expandable_segments" in s for s in space)
        assert "expandable_segments" in dict(sp.skipped)
    if "large_segment_size_mb" not in p.settings_keys:
        assert "large_segment_size_mb" in dict(sp.skipped)
    if p.policy == "xpu":
        assert "max_split" not in sp.knobs and "roundup_power2_divisions" not in sp.knobs


# ---------------------------------------------------------------------------------------------
# the search


def test_tune_frag_removes_the_fragmentation(frag_result):
    r = frag_result
    assert r.evaluated >= 200
    assert len({c.config for c in r.candidates}) == r.evaluated
    assert r.baseline.config == ""  # the generator records torch's defaults
    assert any(c.config == r.baseline_config for c in r.candidates)  # baseline is a candidate
    assert r.baseline.peak_reserved > 1000 * MIB  # ~1432 MiB: one new segment per request
    rec = r.recommended
    assert rec.peak_reserved < r.baseline.peak_reserved / 10  # ~88 MiB
    assert "expandable_segments:True" in rec.config
    assert rec.config == "expandable_segments:True"  # ties go to the simplest config
    for c in r.candidates:
        assert parse_config(c.config or "", "cuda").to_string() == c.config
    assert r.accuracy["peak_error_pct"] == 0.0  # a generated trace replays exactly
    assert {c.policy for c in r.alternatives} == set(POLICIES) - {"native"}
    assert all(c.policy == "native" for c in r.candidates)


def test_pareto_front_is_non_dominated(frag_result):
    front = frag_result.pareto
    assert front
    for f in front:
        assert not any(_dominates(c, f) for c in frag_result.candidates if c.ooms == 0)
    for c in frag_result.candidates:  # everything else is dominated by or equal to a front point
        assert any(_dominates(f, c) or (f.peak_reserved, f.device_calls) ==
                   (c.peak_reserved, c.device_calls) for f in front)
    assert [f.peak_reserved for f in front] == sorted(f.peak_reserved for f in front)


def test_pareto_front_synthetic():
    a, b, c, d = _cand("a", 10, 5), _cand("b", 8, 9), _cand("c", 12, 6), _cand("d", 8, 9, distance=3)
    front = pareto_front([a, b, c, d])
    assert front == [b, a]  # c is dominated by a; d is b's point, farther from the baseline


def test_rank_objectives_and_oom_last():
    c = [_cand("p", 100, 50), _cand("q", 104, 10), _cand("r", 90, 80, ooms=1), _cand("s", 120, 1)]
    assert [x.config for x in rank(c, "peak")] == ["p", "q", "s", "r"]
    # mallocs: fewest calls within 5 % of the lowest non-OOM peak (100): q
    assert [x.config for x in rank(c, "mallocs")][:2] == ["q", "p"]
    assert rank(c, "peak")[-1].ooms  # OOM ranks last even with the lowest peak
    top = rank(c, "pareto")[0]
    assert top in pareto_front(c)
    with pytest.raises(ValueError):
        rank(c, "speed")


def test_mallocs_objective_keeps_peak_within_slack(frag):
    r = tune(frag, objective="mallocs", budget=60)
    best_peak = min(c.peak_reserved for c in r.candidates if not c.ooms)
    rec = r.recommended
    assert rec.peak_reserved <= best_peak * (1 + MALLOCS_PEAK_SLACK)
    assert rec.device_calls == min(c.device_calls for c in r.candidates
                                   if c.peak_reserved <= best_peak * (1 + MALLOCS_PEAK_SLACK))


def test_pareto_objective_recommends_a_front_point(frag):
    r = tune(frag, objective="pareto", budget=60)
    assert r.recommended in r.pareto


def test_budget_progress_and_jobs(frag):
    ticks = []
    r1 = tune(frag, budget=30, progress=lambda d, t: ticks.append((d, t)))
    assert r1.evaluated <= 30
    assert ticks[-1][0] == ticks[-1][1] == r1.evaluated + len(r1.alternatives)
    r2 = tune(frag, budget=30, jobs=2)
    assert [(c.config, c.metrics()) for c in r1.candidates] == \
        [(c.config, c.metrics()) for c in r2.candidates]


def test_cap_errors_and_gc_candidates(frag):
    need = largest_request(frag)
    with pytest.raises(CapacityError):
        tune(frag, cap=need - 1)
    r = tune(frag, cap=1 << 30, budget=120)
    assert r.stages.get("single", 0) > 0
    assert any("garbage_collection_threshold" in (c.config or "") for c in r.candidates)
    ranked = r.candidates
    flags = [c.ooms > 0 for c in ranked]
    assert flags == sorted(flags)  # every OOM after every non-OOM
    # the accuracy is the uncapped validate comparison, not the capped baseline
    assert r.accuracy["peak_error_pct"] == 0.0


def test_bad_arguments(frag):
    with pytest.raises(UnsupportedTraceError):
        tune(frag, profile="cuda-1.0")
    with pytest.raises(ValueError):
        tune(frag, objective="speed")
    with pytest.raises(ValueError):
        tune(frag, budget=1)


def test_recorded_settings_are_the_baseline():
    t = generate("frag", seed=0, settings="max_split_size_mb:100,roundup_power2_divisions:8")
    r = tune(t, budget=30)
    assert r.baseline_config == "max_split_size_mb:100,roundup_power2_divisions:8"
    assert r.baseline.config == r.baseline_config and r.baseline.stage == "baseline"
    assert any(c.config == "" for c in r.candidates)  # torch's defaults are searched too
    assert r.accuracy["peak_error_pct"] == 0.0


def test_recorded_fraction_needs_a_cap():
    t = generate("frag", seed=0)
    t.allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] = "per_process_memory_fraction:0.9"
    with pytest.raises(CapacityError, match="--cap"):
        tune(t, budget=10)
    r = tune(t, budget=10, cap=4 << 30)
    assert "per_process_memory_fraction:0.9" in r.baseline_config


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_keys_table_matches_the_engine(policy):
    """core.settings.POLICY_KEYS says which knobs a policy acts on; every other knob must leave its
    replay unchanged (checked on traces where each knob does matter under native)."""
    from accel_graph.allocator.core.settings import POLICY_KEYS
    from accel_graph.allocator.sim.scenario import make_scenario, simulate

    knob_values = {
        "max_split_size_mb": "max_split_size_mb:32",
        "max_non_split_rounding_mb": "max_split_size_mb:32,max_non_split_rounding_mb:1024",
        "roundup_power2_divisions": "roundup_power2_divisions:4",
        "expandable_segments": "expandable_segments:True",
        "large_segment_size_mb": "large_segment_size_mb:64",
        "garbage_collection_threshold":
            "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    }
    for workload in ("frag", "shapes"):
        trace = generate(workload, seed=0, steps=2)
        cap = 4 << 30

        def figures(config, pol, trace=trace, cap=cap):
            sc = make_scenario(trace, config, policy=pol, cap=cap)
            return simulate(trace, sc).figures()

        base = figures("per_process_memory_fraction:0.9", policy)
        for key, config in knob_values.items():
            if key in POLICY_KEYS[policy]:
                continue
            with_fraction = config if "fraction" in config else (
                config + ",per_process_memory_fraction:0.9")
            assert figures(with_fraction, policy) == base, (policy, key, workload)
