"""Issue 28 item 5: a plan written as a memory-snapshot trace (``plan_memory(trace=)`` and
``accel-alloc plan``) that ``accel-alloc tune`` ranks settings on, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import accel_graph
from accel_graph.allocator.traces import load_trace
from accel_graph.cli.alloc.main import main
from accel_graph.models.decoder import Decoder, DecoderConfig


def test_accel_alloc_plan_writes_a_trace_that_tune_ranks(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "pool.pkl"
    assert main(["plan", "--model", "decoder", "--buckets", "1,2,4,8", "--vocab", "40000",
                 "-o", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["schema"] == "accel_graph.runner.memory-plan/1"
    assert [b["bucket"] for b in plan["buckets"]] == [1, 2, 4, 8]
    trace = load_trace(str(out))
    # The trace is the planned pool: its peak reserved is the plan's.
    assert main(["tune", str(out), "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    peak = tuned["accuracy"]["metrics"]["peak_reserved"]
    assert peak["recorded"] == plan["pool_peak_reserved_bytes"] and peak["error"] == 0
    assert trace.num_events > 0


def test_plan_memory_trace_matches_the_plan(tmp_path: Path) -> None:
    model = Decoder(DecoderConfig(dim=128, vocab_size=40000, max_batch=8))
    ex = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    runner = accel_graph.GraphRunner(model.decode_step, ex, buckets=[2, 8], progress=False)
    path = tmp_path / "pool.json"
    plan = runner.plan_memory(trace=str(path))
    assert plan["trace"] == str(path)
    trace = load_trace(str(path))
    assert trace.allocator_settings["accel_graph_memory_plan"]["policy"] == "native"
    assert main(["inspect", str(path), "--json"]) == 0


@pytest.mark.parametrize("argv, words", [
    (["plan", "--model", "decoder", "--buckets", "0,2", "-o", "x.pkl"], "--buckets"),
    (["plan", "--model", "decoder", "--buckets", "a", "-o", "x.pkl"], "--buckets"),
    (["plan", "--model", "decoder", "--config", "expandable_segments:maybe", "-o", "x.pkl"],
     "expandable_segments"),
])
def test_bad_input_is_a_clear_error(argv: list[str], words: str, capsys: pytest.CaptureFixture,
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "x.pkl").exists()


def test_device_check_memory_plan_row_runs_with_the_recorder_standing_in(tmp_path: Path) -> None:
    """The GPU row's own code, run here on the recorder (plumbing: the GPU compares torch's pool)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "device_check", Path(__file__).resolve().parents[1] / "tools" / "device_check.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert "memory_plan" in tool.ROWS and tool.CHILDREN["memory_plan"] is tool.child_memory_plan
    assert tool.skip_reason("memory_plan", {"native_backend": None}) == "skipped: no GPU"
    res = tool.child_memory_plan(tmp_path, 1)
    assert res["status"] == "pass", res
    bad = tool.memory_plan_verdict(
        {"pool_reserved_bytes": 100 << 20, "pool_peak_reserved_bytes": 0, "warmup_peak_bytes": 0,
         "planning_seconds": 0.0, "buckets": [{"bucket": 1, "incremental_bytes": 100 << 20}]},
        {"pool_reserved_bytes": 50 << 20, "pool_peak_reserved_bytes": 0,
         "buckets": [{"bucket": 1, "incremental_bytes": 50 << 20}]})
    assert bad["status"] == "fail"
