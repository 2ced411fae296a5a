"""Issue 29 item 11: ``accel-alloc inspect`` and ``tune`` agree, allocator frames are never user
sites, and a Pareto-front point worse than the baseline on peak says why it is listed.

No real CUDA training-step trace ships with the repository (shared/traces holds NPU ones), so
the generator's ``frag`` workload (wholly free cached segments at the peak) stands in for it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

from accel_graph.allocator.analysis.sites import ALLOCATOR_ONLY_SITE
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import save_trace

SNAPSHOT_FRAME = {"filename": "/pytorch/torch/csrc/profiler/combined_traceback.cpp", "line": 0,
                  "name": "torch::CapturedTraceback::gather"}
GATHER = {"filename": "memory_snapshot.cpp", "line": 0, "name": "gather_with_cpp"}
ALLOC = {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 1234,
         "name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"}
USER = {"filename": "/home/me/train.py", "line": 42, "name": "step"}


def test_wholly_free_segments_advice_agrees_with_tune(tmp_path: Path, cli: Callable) -> None:
    path = tmp_path / "frag.agtrace"
    save_trace(generate("frag", seed=0), path, format="compact")
    ins = cli("inspect", path, "--json").json()
    waste = ins["waste_at_peak"]
    assert waste["wholly_free_segments"] > 0.5 * sum(v for v in waste.values() if v > 0)
    advice = {a["component"]: a["advice"] for a in ins["advice"]}["wholly_free_segments"]
    assert "nothing to fix" not in advice
    assert "expandable_segments:True" in advice and "accel-alloc tune" in advice
    tune = cli("tune", path, "--json", "--budget", "20").json()
    rec = tune["recommendation"]
    assert "expandable_segments:True" in rec["label"], rec["label"]
    assert rec["peak_reserved_recording"] < tune["baseline"]["peak_reserved_recording"]


def test_allocator_frames_are_never_user_sites(tmp_path: Path, cli: Callable) -> None:
    snap = generate("frag", seed=0).to_snapshot()
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    half = len(allocs) // 2
    for e in allocs[:half]:
        e["frames"] = [GATHER, SNAPSHOT_FRAME, ALLOC, USER]
    for e in allocs[half:]:
        e["frames"] = [GATHER, SNAPSHOT_FRAME, ALLOC]  # nothing but the machinery
    path = tmp_path / "frames.pkl"
    path.write_bytes(pickle.dumps(snap))
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.err[-500:]
    doc = run.json()
    labels = [s["site"] for key in ("sites", "sites_over_run") for s in doc[key]]
    labels += [s["stack"] for key in ("stacks", "stacks_over_run") for s in doc[key]]
    assert labels
    for label in labels:
        for bad in ("memory_snapshot.cpp", "gather_with_cpp", "CUDACachingAllocator",
                    "combined_traceback"):
            assert bad not in label, label
    assert any("train.py:42 (step)" in label for label in labels), labels
    assert any(label == ALLOCATOR_ONLY_SITE for label in labels), labels
    text = cli("inspect", path).out
    assert "gather_with_cpp" not in text and "train.py:42" in text


def test_front_points_worse_than_the_baseline_say_why(tmp_path: Path, cli: Callable) -> None:
    path = tmp_path / "pin.agtrace"
    save_trace(generate("pin", seed=0), path, format="compact")
    doc = cli("tune", path, "--json", "--budget", "40").json()
    base = doc["baseline"]["peak_reserved_recording"]
    worse = [r for r in doc["pareto"] if r["peak_reserved_recording"] > base]
    assert worse, "the pin workload has front points that trade peak for device calls"
    for r in doc["pareto"]:
        assert r["worse_peak_than_baseline"] == (r["peak_reserved_recording"] > base)
        assert (r["why"] is not None) == r["worse_peak_than_baseline"]
    assert all("peak vs the baseline for" in r["why"] and "fewer device calls" in r["why"]
               for r in worse)
    text = cli("tune", path, "--budget", "40").out
    front = text.split("Pareto front")[1].split("recommendation:")[0]
    good, _, trade = front.partition("WORSE than the baseline on peak")
    assert trade, front
    for r in worse:
        assert r["label"] in trade and r["why"] in trade
