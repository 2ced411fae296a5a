"""whatif.simulate with the memoised trace-to-ops conversion (replay.build_ops_cached): identical
results to a fresh conversion for many configurations and profiles, and never a stale one."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator import replay as rp
from accel_graph.allocator.fidelity import find_npu_traces
from accel_graph.allocator.generate import generate
from accel_graph.allocator.snapshot import load_trace, save_trace
from accel_graph.allocator.trace import ACTION_CODE
from accel_graph.allocator.whatif import make_scenario, simulate
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
    rp.clear_ops_cache()
    scenarios = _scenarios(trace, random.Random(seed), n)
    for sc in scenarios + scenarios[::-1]:  # the second pass hits the memo for every one
        cached = simulate(trace, sc, device=device)
        fresh = simulate(trace, sc, device=device, cache_ops=False)
        assert _json(cached) == _json(fresh), sc.describe()
        assert cached.replay.summary() == fresh.replay.summary()
        assert cached.replay.final_stats == fresh.replay.final_stats
    memo = rp._OPS_MEMO[id(trace)]
    return len(memo.built)


@pytest.mark.parametrize("workload,seed", [("shapes", 0), ("train", 1), ("serve", 2), ("frag", 3)])
def test_cached_simulate_identical_generated(workload, seed):
    trace = generate(workload, seed=seed, steps=3)
    kept = _check_identical(trace, 40, seed)
    assert 1 <= kept <= rp.OPS_CACHE_SIZE


@pytest.mark.skipif(NPU is None, reason="shared/traces/npu not found")
@pytest.mark.parametrize("name", ["snapshot_expandable.pkl", "snapshot_with_empty_cache.pkl",
                                  "snapshot_1768383987920985470.pkl"])
def test_cached_simulate_identical_npu(name):
    trace = load_trace(NPU / name)
    _check_identical(trace, 24, seed=len(name))


@pytest.mark.skipif(NPU is None, reason="shared/traces/npu not found")
def test_cached_simulate_identical_npu_second_device():
    trace = load_trace(NPU / "snapshot_with_multi_devices.pkl")
    for device in (0, 1):
        sc = make_scenario(trace, "expandable_segments:True", profile="npu", device=device)
        a = simulate(trace, sc, device=device)
        b = simulate(trace, sc, device=device, cache_ops=False)
        assert _json(a) == _json(b)
    assert {k[0] for k in rp._OPS_MEMO[id(trace)].built} == {0, 1}


def test_memo_reuses_and_keys_on_inputs():
    trace = generate("shapes", seed=0, steps=2)
    rp.clear_ops_cache(trace)
    a = rp.build_ops_cached(trace, expandable=False)
    b = rp.build_ops_cached(trace, expandable=False)
    assert a["ops"] is b["ops"] and a is not b  # shared arrays, separate dicts
    assert not a["ops"].flags.writeable
    c = rp.build_ops_cached(trace, expandable=True)
    assert c["ops"] is not a["ops"]
    for kw in ({"profile": "npu"}, {"round_extra": 32}, {"empty_cache": False},
               {"empty_cache": [10, 20]}, {"start_state": False}):
        d = rp.build_ops_cached(trace, expandable=False, **kw)
        fresh = rp.build_ops(trace, expandable=False, **kw)
        assert d["ops"] is not a["ops"]
        assert np.array_equal(d["ops"], fresh["ops"])
        assert np.array_equal(d["prologue"], fresh["prologue"])
    # positions are keyed by value, not by object
    e1 = rp.build_ops_cached(trace, expandable=False, empty_cache=np.array([10, 20]))
    e2 = rp.build_ops_cached(trace, expandable=False, empty_cache=[10, 20])
    assert e1["ops"] is e2["ops"]
    assert len(rp._OPS_MEMO[id(trace)].built) <= rp.OPS_CACHE_SIZE


def _simulate_both(trace, config="expandable_segments:True"):
    sc = make_scenario(trace, config)
    return _json(simulate(trace, sc)), _json(simulate(trace, sc, cache_ops=False))


def test_never_stale_after_events_change_in_place():
    trace = generate("shapes", seed=0, steps=2)
    before, _ = _simulate_both(trace)
    ev = trace.events(0)
    alloc = np.nonzero(ev["action"] == ACTION_CODE["alloc"])[0]
    big = alloc[np.argmax(ev["size"][alloc])]
    ev["size"][big] *= 4  # in place: same array object
    cached, fresh = _simulate_both(trace)
    assert cached == fresh
    assert cached != before


def test_never_stale_after_events_replaced_or_segments_changed():
    trace = generate("shapes", seed=0, steps=2)
    before, _ = _simulate_both(trace)
    trace.device_traces[0] = trace.events(0)[: len(trace.events(0)) // 2].copy()
    cached, fresh = _simulate_both(trace)
    assert cached == fresh != before
    # the final segments decide the start state and the expandable default
    trace = generate("shapes", seed=0, steps=2)
    sc = make_scenario(trace, None)
    before = _json(simulate(trace, sc))
    trace.segments[0]["is_expandable"] = not trace.segments[0].get("is_expandable")
    assert _json(simulate(trace, sc)) == _json(simulate(trace, sc, cache_ops=False))
    trace.segments.clear()
    after = _json(simulate(trace, sc))
    assert after == _json(simulate(trace, sc, cache_ops=False))


def test_never_stale_after_stacks_change():
    """The frames decide which segment_free runs are empty_cache calls."""
    trace = generate("shapes", seed=0, steps=2)
    sc = make_scenario(trace, "")
    simulate(trace, sc)
    trace.stacks.append(({"name": "empty_cache", "filename": "x.py", "line": 1},))
    assert rp._OPS_MEMO[id(trace)].matches(trace) is False
    assert _json(simulate(trace, sc)) == _json(simulate(trace, sc, cache_ops=False))


def test_compact_trace_is_checked_by_identity(tmp_path):
    trace = generate("shapes", seed=0, steps=2)
    save_trace(trace, tmp_path / "t.agt", "compact")
    loaded = load_trace(tmp_path / "t.agt")
    assert not loaded.events(0).flags.writeable
    assert rp._immutable(loaded.events(0))
    assert not rp._immutable(trace.events(0))
    ro = trace.events(0).copy()
    ro.setflags(write=False)  # owns its data: can be made writeable again
    assert not rp._immutable(ro)
    a, b = _simulate_both(loaded)
    assert a == b
    assert rp._OPS_MEMO[id(loaded)].events[0].saved is None


def test_memo_dies_with_the_trace():
    trace = generate("shapes", seed=0, steps=2)
    simulate(trace, make_scenario(trace, ""))
    key = id(trace)
    assert key in rp._OPS_MEMO
    del trace
    gc.collect()
    assert key not in rp._OPS_MEMO
