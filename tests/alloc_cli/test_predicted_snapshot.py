"""Predicted snapshots (``accel-alloc simulate --write-snapshot``): consistent, and read by
PyTorch's own ``torch.cuda._memory_viz`` (stats/segsum, trace, trace_plot, segment_plot,
segments, memory) on the CPU."""

from __future__ import annotations

import base64
import copy
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from accel_graph.allocator.analysis.inspect import inspect_trace
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.sim.predicted import PREDICTION_KEY, predicted_trace
from accel_graph.allocator.sim.scenario import make_scenario, simulate
from accel_graph.allocator.traces import load_trace, save_trace
from accel_graph.allocator.traces.actions import A_ALLOC, A_FREE_REQ, A_OOM
from accel_graph.allocator.traces.snapshot_check import snapshot_problems

ES = "expandable_segments:True"
CONFIGS = (None, ES, "max_split_size_mb:64,roundup_power2_divisions:4")


def _busiest(trace: Any) -> int:
    return max(range(len(trace.device_traces)), key=lambda i: len(trace.device_traces[i]))


def _predict(trace: Any, config: str | None, device: int) -> tuple[Any, Any]:
    sim = simulate(trace, make_scenario(trace, config, device=device), device=device,
                   keep_events=True, keep_layout=True)
    return sim, predicted_trace(trace, sim, source="test")


def _check_prediction(trace: Any, config: str | None, device: int) -> dict[str, Any]:
    """Every consistency property of one predicted trace; returns its snapshot dict."""
    sim, pred = _predict(trace, config, device)
    snap = pred.to_snapshot()
    assert snapshot_problems(snap, device) == []
    segs = [s for s in snap["segments"] if s["device"] == device]
    for s in segs:  # blocks tile each segment
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert s["blocks"][0]["address"] == s["address"]
    stats = sim.replay.final_stats
    assert sum(s["total_size"] for s in segs) == stats["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segs) == stats["allocated_bytes.all.current"]
    assert sum(s["active_size"] for s in segs) == stats["active_bytes.all.current"]
    assert sum(s["requested_size"] for s in segs) == stats["requested_bytes.all.current"]
    # the events: the replay's, in order, one alloc (or oom) per recorded alloc
    ev, rec = pred.events(device), trace.events(device)
    assert len(ev) == len(sim.replay.events)
    assert ((ev["action"] == A_ALLOC) | (ev["action"] == A_OOM)).sum() == \
        (rec["action"] == A_ALLOC).sum()
    assert set(np.unique(ev["stream"]).tolist()) <= set(np.unique(rec["stream"]).tolist())
    if trace.has_time:
        assert (np.diff(ev["time_us"].astype(np.int64)) >= 0).all()
    else:
        assert (ev["time_us"] == -1).all()
    # frames: the k-th simulated alloc carries the k-th recorded alloc's stack
    sim_allocs = ev["frames"][(ev["action"] == A_ALLOC) | (ev["action"] == A_OOM)]
    assert np.array_equal(sim_allocs, rec["frames"][rec["action"] == A_ALLOC])
    # the same analysis that reads recordings reads it back to the replay's figures
    report = inspect_trace(pred, device, top=3)
    assert report["peaks"]["reserved"] == sim.peak_reserved
    assert report["peaks"]["final_reserved"] == sim.final_reserved
    assert report["start"]["reserved"] == sim.start_reserved
    assert snap[PREDICTION_KEY]["config"] == config and snap[PREDICTION_KEY]["device"] == device
    return snap


def test_predicted_snapshots_of_npu_traces_are_consistent(npu_dir: Path) -> None:
    files = sorted(npu_dir.glob("*.pkl"))
    assert files
    for path in files:
        trace = load_trace(path)
        dev = _busiest(trace)
        for config in CONFIGS if path.name == "snapshot_with_empty_cache.pkl" else CONFIGS[:2]:
            _check_prediction(trace, config, dev)


@pytest.mark.parametrize("workload", ["train", "serve", "moe"])
def test_predicted_snapshots_of_generated_traces_are_consistent(workload: str) -> None:
    trace = generate(workload, seed=0, steps=1)
    for config in CONFIGS:
        _check_prediction(trace, config, 0)


def test_predicted_snapshot_with_out_of_memory_events() -> None:
    trace = generate("train", seed=0, steps=1)
    sim0 = simulate(trace, make_scenario(trace, None))
    cap = (sim0.peak_reserved * 3) // 4  # below the peak: some allocations must fail
    sim = simulate(trace, make_scenario(trace, None, cap=cap), keep_events=True,
                   keep_layout=True)
    assert sim.ooms > 0
    pred = predicted_trace(trace, sim)
    ev = pred.events(0)
    assert (ev["action"] == A_OOM).sum() == sim.ooms
    assert snapshot_problems(pred.to_snapshot()) == []
    assert pred.extra[PREDICTION_KEY]["cap"] == cap


def test_predicted_snapshot_of_a_trace_that_ends_with_nothing_reserved() -> None:
    from accel_graph.allocator.traces import Trace
    from accel_graph.allocator.traces.actions import ACTION_CODE as C

    a, mib = 0x7F0000000000, 1 << 20
    trace = Trace.from_events([(C["segment_alloc"], a, 20 * mib, 0, 0),
                               (C["alloc"], a, 8 * mib, 0, 0),
                               (C["free_requested"], a, 8 * mib, 0, 0),
                               (C["free_completed"], a, 8 * mib, 0, 0),
                               (C["segment_free"], a, 20 * mib, 0, 0)], segments=[])
    sim, pred = _predict(trace, None, 0)
    assert pred.segments == [] and sim.final_reserved == 0
    assert snapshot_problems(pred.to_snapshot()) == []
    with pytest.raises(ValueError, match="keep_layout"):
        predicted_trace(trace, simulate(trace, make_scenario(trace, None), keep_events=True))


def test_predicted_frees_carry_the_recorded_free_frames(npu_dir: Path) -> None:
    trace = load_trace(npu_dir / "snapshot_expandable.pkl")
    _, pred = _predict(trace, None, 0)
    rec, ev = trace.events(0), pred.events(0)
    got = ev["frames"][ev["action"] == A_FREE_REQ]
    want = rec["frames"][rec["action"] == A_FREE_REQ]
    assert len(got) == len(want)
    # same multiset of stacks on the frees (their order differs where the allocator differs)
    assert sorted(got.tolist()) == sorted(want.tolist()) and (got >= 0).any()


# ---------------------------------------------------------------------------------------------
# torch's own reader


@pytest.fixture(scope="module")
def memory_viz() -> Any:
    return pytest.importorskip("torch.cuda._memory_viz")


def _embedded_snapshot(page: str) -> Any:
    """The snapshot memory_viz's HTML embeds (base64 pickle in a JSON list)."""
    m = re.search(r"const local_files = (\[.*?\])\n", page)
    assert m, "memory_viz page layout changed"
    raw = base64.b64decode(json.loads(m.group(1))[0]["base64"])
    return pickle.loads(raw.rstrip(b"\x00"))


def test_torch_memory_viz_reads_predicted_snapshots(npu_dir: Path, tmp_path: Path,
                                                     memory_viz: Any) -> None:
    cases = [(load_trace(p), None) for p in sorted(npu_dir.glob("*.pkl"))[:3]]
    cases.append((generate("serve", seed=0, steps=1), ES))
    for i, (trace, config) in enumerate(cases):
        dev = _busiest(trace)
        _, pred = _predict(trace, config, dev)
        path = tmp_path / f"p{i}.pickle"
        save_trace(pred, path, "pickle")
        with open(path, "rb") as f:
            snap = pickle.load(f)  # noqa: S301 - our own file
        segs = snap["segments"]
        stats = memory_viz.segsum(snap)  # raises on any segment/block accounting mismatch
        assert f"segments: {len(segs)}" in stats
        reserved = sum(s["total_size"] for s in segs)
        assert f"total_reserved: {memory_viz.Bytes(reserved)}" in stats
        text = memory_viz.trace(snap)
        assert f"Device {dev} ----" in text and f"{len(snap['device_traces'][dev])} entries" in text
        for page in (memory_viz.trace_plot(snap), memory_viz.segment_plot(snap)):
            assert _embedded_snapshot(page) == snap
        # the flamegraph views, with the flamegraph.pl download replaced by the identity
        assert isinstance(memory_viz.segments(snap, format_flamegraph=lambda lines: lines), str)
        assert isinstance(memory_viz.memory(snap, format_flamegraph=lambda lines: lines), str)


def test_python_m_memory_viz_subcommands(npu_dir: Path, tmp_path: Path, memory_viz: Any) -> None:
    """``python -m torch.cuda._memory_viz stats|trace|trace_plot|segment_plot FILE``, as a user
    runs them (in one child process: torch imports once)."""
    trace = load_trace(npu_dir / "snapshot_with_empty_cache.pkl")
    _, pred = _predict(trace, ES, 0)
    path = tmp_path / "pred.pickle"
    save_trace(pred, path, "pickle")
    runs = [["stats", str(path)], ["trace", str(path)],
            ["trace_plot", str(path), "-o", str(tmp_path / "trace_plot.html")],
            ["segment_plot", str(path), "-o", str(tmp_path / "segment_plot.html")]]
    child = (
        "import runpy, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        f"for argv in {runs!r}:\n"
        "    sys.argv = ['_memory_viz', *argv]\n"
        "    print('=== ' + argv[0], flush=True)\n"
        "    runpy.run_module('torch.cuda._memory_viz', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    stats = out[out.index("=== stats"):out.index("=== trace\n")]
    assert "total_reserved" in stats and f"segments: {len(pred.segments)}" in stats
    assert f"{len(pred.events(0))} entries" in out[out.index("=== trace\n"):]
    for cmd in ("trace_plot", "segment_plot"):
        assert _embedded_snapshot((tmp_path / f"{cmd}.html").read_text()) == pred.to_snapshot()


# ---------------------------------------------------------------------------------------------
# the checker finds what it is for


def _sample_snapshot() -> dict[str, Any]:
    trace = generate("train", seed=0, steps=1)
    _, pred = _predict(trace, None, 0)
    return pred.to_snapshot()


def test_snapshot_checker_finds_broken_snapshots() -> None:
    good = _sample_snapshot()
    assert snapshot_problems(good) == []
    ev = good["device_traces"][0]

    def broken(edit: Any) -> list[str]:
        snap = copy.deepcopy(good)
        edit(snap)
        return snapshot_problems(snap)

    seg = next(i for i, s in enumerate(good["segments"]) if len(s["blocks"]) > 1)
    assert any("blocks sum" in p or "block at" in p for p in broken(
        lambda s: s["segments"][seg]["blocks"].pop()))
    assert any("allocated_size" in p for p in broken(
        lambda s: s["segments"][seg].update(allocated_size=s["segments"][seg]["allocated_size"] + 512)))
    i_seg = next(i for i, e in enumerate(ev) if e["action"] == "segment_alloc")
    assert any("no such segment" in p for p in broken(
        lambda s: s["device_traces"][0][i_seg].update(size=s["device_traces"][0][i_seg]["size"] * 2)))
    i_free = next(i for i, e in enumerate(ev) if e["action"] == "free_requested")
    assert any("free_requested" in p for p in broken(
        lambda s: s["device_traces"][0][i_free].update(addr=s["device_traces"][0][i_free]["addr"] + 512)))
    i_fc = max(i for i, e in enumerate(ev) if e["action"] == "free_completed")
    assert any("outside every segment" in p or "already live" in p for p in broken(
        lambda s: s["device_traces"][0][i_fc].update(addr=1 << 60)))
    timed = [i for i, e in enumerate(ev) if "time_us" in e]
    assert any("time_us" in p for p in broken(
        lambda s: s["device_traces"][0][timed[1]].update(time_us=s["device_traces"][0][timed[0]]["time_us"] - 1)))
    many = broken(lambda s: [e.update(addr=e["addr"] + 1) for e in s["device_traces"][0]])
    assert len(many) == 21 and many[-1].startswith("... and more")


# ---------------------------------------------------------------------------------------------
# the command


def test_simulate_write_snapshot(cli, npu_dir: Path, tmp_path: Path) -> None:
    src = npu_dir / "snapshot_with_empty_cache.pkl"
    out = tmp_path / "pred.pickle"
    r = cli("simulate", src, "--config", ES, "--write-snapshot", out, "--json")
    assert r.code == 0, r.err
    body = r.json()
    snap = body["snapshot"]
    assert snap["path"] == str(out) and snap["device"] == 0
    back = load_trace(out)
    assert back.extra[PREDICTION_KEY]["config"] == ES
    assert snap["events"] == len(back.events(0)) and snap["segments"] == len(back.segments)
    assert snap["events_with_frames"] == int((back.events(0)["frames"] >= 0).sum()) > 0
    assert back.device_type == "npu" and back.allocator_settings["expandable_segments"] is True
    assert not back.validate().errors
    final = sum(s["total_size"] for s in back.segments)
    assert final == body["predicted"]["final_reserved"]
    text = cli("simulate", src, "--config", ES, "--write-snapshot", out)
    assert text.code == 0 and f"wrote the predicted snapshot {out}" in text.out


def test_simulate_write_snapshot_unwritable(cli, train_trace: Path, tmp_path: Path) -> None:
    r = cli("simulate", train_trace, "--write-snapshot", tmp_path / "no" / "such" / "dir.pickle")
    assert r.code == 2 and "cannot write" in r.err and "\n" not in r.err.strip()
