"""sim.scenario.simulate with a caller-owned conversion cache (sim.trace_ops.build_ops_reusing, as
tune uses it): identical results to a fresh conversion for many configurations and profiles, each
distinct conversion made once."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.sim import replayer as rp
from accel_graph.allocator.sim.fidelity import find_npu_traces
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.sim.scenario import make_scenario, simulate
from accel_graph.allocator.traces import load_trace
from accel_graph.allocator.traces.actions import A_ALLOC
from accel_graph.errors import ConfigError

NPU = find_npu_traces(Path(__file__).resolve().parents[2])

CONFIGS = [
    None,
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "large_segment_size_mb:64,expandable_segments:True",
    "max_split_size_mb:128,expandable_segments:True",
    "max_non_split_rounding_mb:40,roundup_power2_divisions:[256:8,>:2]",
]
PROFILES = [None, "cuda-2.9", "cuda-2.13", "rocm-6", "npu", "xpu"]


def _json(r) -> dict:
    out = r.to_json()
    out.pop("replay_seconds")
    return out


def _scenarios(trace, rng: random.Random, n: int):
    combos = [(c, p, pol) for c in CONFIGS for p in PROFILES for pol in (None, "bfc")]
    rng.shuffle(combos)
    out = []
    for config, profile, policy in combos:
        try:
            out.append(make_scenario(trace, config, profile=profile, policy=policy))
        except ConfigError:  # a key the profile's device rejects
            continue
        if len(out) == n:
            break
    return out


def _check_identical(trace, n: int, seed: int = 0, device: int = 0) -> int:
    cache: dict = {}
    scenarios = _scenarios(trace, random.Random(seed), n)
    for sc in scenarios + scenarios[::-1]:  # the second pass reuses every conversion
        cached = simulate(trace, sc, device=device, ops_cache=cache)
        fresh = simulate(trace, sc, device=device)
        assert _json(cached) == _json(fresh), sc.describe()
        assert cached.replay.summary() == fresh.replay.summary()
        assert cached.replay.final_stats == fresh.replay.final_stats
    return len(cache)


@pytest.mark.parametrize("workload,seed", [("shapes", 0), ("train", 1), ("serve", 2), ("frag", 3)])
def test_cached_simulate_identical_generated(workload, seed):
    trace = generate(workload, seed=seed, steps=3)
    kept = _check_identical(trace, 40, seed)
    assert 1 <= kept < 40  # far fewer conversions than scenarios


@pytest.mark.skipif(NPU is None, reason="shared/traces/npu not found")
@pytest.mark.parametrize("name", ["snapshot_expandable.pkl", "snapshot_with_empty_cache.pkl",
                                  "snapshot_1768383987920985470.pkl"])
def test_cached_simulate_identical_npu(name):
    trace = load_trace(NPU / name)
    _check_identical(trace, 24, seed=len(name))


@pytest.mark.skipif(NPU is None, reason="shared/traces/npu not found")
def test_cached_simulate_identical_npu_second_device():
    trace = load_trace(NPU / "snapshot_with_multi_devices.pkl")
    cache: dict = {}
    for device in (0, 1):
        sc = make_scenario(trace, "expandable_segments:True", profile="npu", device=device)
        a = simulate(trace, sc, device=device, ops_cache=cache)
        b = simulate(trace, sc, device=device)
        assert _json(a) == _json(b)
    assert {k[0] for k in cache} == {0, 1}


def test_cache_reuses_and_keys_on_inputs():
    trace = generate("shapes", seed=0, steps=2)
    cache: dict = {}
    a = rp.build_ops_reusing(cache, trace, expandable=False)
    b = rp.build_ops_reusing(cache, trace, expandable=False)
    assert a is b and not a["ops"].flags.writeable
    c = rp.build_ops_reusing(cache, trace, expandable=True)
    assert c["ops"] is not a["ops"]
    for kw in ({"profile": "npu"}, {"round_extra": 32}, {"empty_cache": False},
               {"empty_cache": [10, 20]}, {"start_state": False}):
        d = rp.build_ops_reusing(cache, trace, expandable=False, **kw)
        fresh = rp.build_ops(trace, expandable=False, **kw)
        assert d["ops"] is not a["ops"]
        assert np.array_equal(d["ops"], fresh["ops"])
        assert np.array_equal(d["prologue"], fresh["prologue"])
    # positions are keyed by value, not by object
    e1 = rp.build_ops_reusing(cache, trace, expandable=False, empty_cache=np.array([10, 20]))
    e2 = rp.build_ops_reusing(cache, trace, expandable=False, empty_cache=[10, 20])
    assert e1 is e2


def test_without_a_cache_every_call_converts_afresh():
    """No hidden state: a trace changed between calls gives the new answer."""
    trace = generate("shapes", seed=0, steps=2)
    sc = make_scenario(trace, "expandable_segments:True")
    before = _json(simulate(trace, sc))
    ev = trace.events(0)
    alloc = np.nonzero(ev["action"] == A_ALLOC)[0]
    ev["size"][alloc[np.argmax(ev["size"][alloc])]] *= 4  # in place: same array object
    assert _json(simulate(trace, sc)) != before


def test_tune_converts_each_distinct_input_once(monkeypatch):
    from accel_graph.allocator.sim import trace_ops
    from accel_graph.allocator.tune.search import tune

    calls = []
    real = trace_ops.build_ops
    counting = lambda *a, **k: calls.append(k) or real(*a, **k)  # noqa: E731
    # replay_trace converts through rp.build_ops, or through trace_ops.build_ops via the cache
    monkeypatch.setattr(rp, "build_ops", counting)
    monkeypatch.setattr(trace_ops, "build_ops", counting)
    r = tune(generate("frag", seed=0), budget=40, compare_policies=False)
    assert r.evaluated >= 30
    assert 0 < len(calls) <= 4  # expandable off/on (plus the floor/validate rows' own)
