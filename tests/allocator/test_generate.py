"""The calibrated trace generator (accel_graph.allocator.sim.generate).

Calibration targets are allocator-semantics.md section 3.1's measured training-step statistics;
tolerances are stated next to each check.
"""

from __future__ import annotations

import numpy as np
import pytest

from accel_graph.allocator.sim.generate import WORKLOADS, generate, trace_stats
from accel_graph.allocator.traces import load_trace, save_trace
from accel_graph.allocator.traces.actions import ACTION_CODE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def traces():
    return {w: generate(w, seed=1) for w in WORKLOADS}


def test_workload_names():
    assert set(WORKLOADS) == {"train", "shapes", "moe", "serve", "rl", "frag", "pin"}
    with pytest.raises(ValueError, match="unknown workload"):
        generate("nope")


def test_deterministic():
    for w in ("shapes", "moe", "serve"):
        assert generate(w, seed=3, steps=2) == generate(w, seed=3, steps=2)
    a, b = generate("moe", seed=3, steps=2), generate("moe", seed=4, steps=2)
    assert not np.array_equal(a.events(0)["size"][: len(b.events(0))],
                              b.events(0)["size"][: len(a.events(0))])  # fmt: skip


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_valid_and_consistent(traces, workload):
    t = traces[workload]
    report = t.validate()
    assert report.ok, report.errors[:5]
    assert report.pre_existing_frees == 0
    counts = t.action_counts()
    assert counts["alloc"] > 50 and counts["segment_alloc"] >= 1
    assert counts["free_requested"] == counts["free_completed"]
    gen = t.allocator_settings["accel_graph_generator"]
    assert gen["workload"] == workload and gen["seed"] == 1
    assert t.allocator_settings["expandable_segments"] is False
    # every address freed was allocated, and live blocks sit inside the final segments
    s = trace_stats(t)
    assert s["never_freed"] == sum(
        1 for seg in t.segments for b in seg["blocks"] if b["state"] == "active_allocated"
    )


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_round_trip_compact(traces, workload, tmp_path):
    t = traces[workload]
    path = tmp_path / f"{workload}.agt"
    save_trace(t, path, format="compact")
    back = load_trace(path)
    assert np.array_equal(back.events(0)["addr"], t.events(0)["addr"])
    assert np.array_equal(back.events(0)["action"], t.events(0)["action"])
    assert back.allocator_settings == t.allocator_settings


def test_train_calibration(traces):
    """allocator-semantics.md 3.1: ~25 distinct sizes; 42 % freed within two allocations;
    median lifetime 3; p90 in the hundreds+ (activations held to backward); a never-freed tail;
    ~25 % of allocations <= 1 MiB with a tiny share of bytes; utilisation 0.88-0.90."""
    s = trace_stats(traces["train"])
    assert 15 <= s["distinct_sizes"] <= 35  # target 25
    assert 0.32 <= s["short_lived"] <= 0.52  # target 0.42
    assert 1 <= s["lifetime_median"] <= 6  # target 3
    assert s["lifetime_p90"] >= 100  # long-lived tail
    assert s["never_freed"] >= 100  # parameters, optimiser state
    assert 0.15 <= s["small_fraction"] <= 0.45  # target 0.25
    assert s["small_bytes"] < 0.02  # target < 0.002
    assert 0.80 <= s["utilisation"] <= 0.97  # target 0.88-0.90


def test_training_family_calibration(traces):
    for w in ("shapes", "moe", "rl"):
        s = trace_stats(traces[w])
        assert 0.30 <= s["short_lived"] <= 0.60, w
        assert s["lifetime_p90"] >= 100, w
    # varying shapes and MoE produce more distinct sizes than the fixed training step
    base = trace_stats(traces["train"])["distinct_sizes"]
    assert trace_stats(traces["shapes"])["distinct_sizes"] > base
    assert trace_stats(traces["moe"])["distinct_sizes"] > 2 * base


def test_serve_uses_private_pool_and_kv_cache(traces):
    t = traces["serve"]
    a = t.events(0)
    allocs = a[a["action"] == ACTION_CODE["alloc"]]
    assert (allocs["pool"] != 0).any()  # graph capture into a private pool
    big = allocs["size"].max()
    assert big >= 50 * (1 << 20)  # KV cache chunks


def test_known_fragmentation_removed_by_expandable_segments():
    """`frag`: reserved grows with the sum of the growing requests under defaults;
    expandable_segments:True keeps it near the largest request (docs/trace-generator.md)."""
    native = trace_stats(generate("frag"))
    es_trace = generate("frag", settings="expandable_segments:True")
    es = trace_stats(es_trace)
    assert es_trace.allocator_settings["expandable_segments"] is True
    assert native["utilisation"] < 0.2
    assert es["peak_reserved"] * 5 < native["peak_reserved"]
    assert es["utilisation"] > 0.6
    assert es_trace.action_counts().get("segment_map", 0) > 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        generate("train", steps=0)
    with pytest.raises(ValueError):
        generate("train", settings="expandable_segments:maybe")


@pytest.mark.parametrize("suffix", [".json", ".pickle"])
def test_round_trip_exact(traces, suffix, tmp_path):
    path = tmp_path / f"serve{suffix}"
    save_trace(traces["serve"], path)
    assert load_trace(path) == traces["serve"]
