"""tools/device_check.py on a CPU-only machine: it must exit cleanly with every row skipped.

The GPU rows themselves cannot run here; what is tested is the script's plumbing: the no-GPU
path end to end in a subprocess, the output files and their schema, row isolation (a raising
row becomes an ``error`` row and the others still run), the child-process protocol, and the
simulator detection that makes the trace row ``pending`` until a simulator exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "device_check.py"

needs_cpu_only = pytest.mark.skipif(
    torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()),
    reason="a GPU is present: the full script would run the GPU rows (minutes)",
)


def load_tool():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("device_check_tool", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_cpu_only
def test_cpu_run_skips_every_row_and_writes_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "device_check.json").read_text())
    tool = load_tool()
    assert report["schema"] == "accel-graph.device-check" and report["schema_version"] == 1
    assert [r["row"] for r in report["rows"]] == list(tool.ROWS)
    assert all(r["status"] == "skipped" and r["summary"] == "skipped: no GPU" for r in report["rows"])
    assert report["ok"] is True and report["gpu"] is None and report["torch"] == torch.__version__
    table = (out / "device_check.md").read_text()
    assert "| conformance | skipped | skipped: no GPU |" in table
    assert "GPU none" in table and report["date"] in table
    assert "| simulator_trace | skipped |" in proc.stdout


@needs_cpu_only
def test_out_defaults_to_the_OUT_variable(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "from_env")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--rows", "conformance"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "from_env" / "device_check.json").read_text())
    assert [r["row"] for r in report["rows"]] == ["conformance"]


def test_unknown_row_is_refused(tmp_path: Path) -> None:
    tool = load_tool()
    with pytest.raises(SystemExit) as info:
        tool.main(["--out", str(tmp_path), "--rows", "conformance,bogus"])
    assert info.value.code == 2


def test_a_raising_row_is_isolated(capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()

    def boom() -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rows = tool.run_rows(
        ["a", "b", "c"],
        {"a": boom, "b": lambda: tool._row("pass", "fine"), "c": lambda: tool._row("pending", "later")},
    )
    assert [r["status"] for r in rows] == ["error", "pass", "pending"]
    assert "illegal memory access" in rows[0]["summary"] and "Traceback" in rows[0]["details"]["traceback"]
    report = {"date": "d", "gpu": "G", "gpu_count": 1, "driver": "1", "torch": "t", "rows": rows}
    table = tool.report_markdown(report)
    assert "| a | error | RuntimeError: CUDA error" in table and "| b | pass | fine |" in table


def test_child_protocol_records_the_exception(tmp_path: Path) -> None:
    tool = load_tool()
    # On this machine the replay child raises (no CUDA): the parent gets an error row, not a crash.
    res = tool._run_child("replay_overhead", tmp_path, 120, "--iters", "10")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert res["status"] == "error" and res["summary"]
    assert "traceback" in res["details"]
    res = tool._run_child("no_such_row", tmp_path, 120)
    assert res["status"] == "error" and "unknown child row" in res["summary"]


def test_simulator_row_verdict_on_generated_recordings(tmp_path: Path) -> None:
    """The simulator row's comparison, on two generated recordings of one workload (the engine
    stands in for the device: a plumbing check of the verdict, not of GPU behaviour)."""
    from accel_graph.allocator.sim.generate import generate
    from accel_graph.allocator.traces import save_trace

    tool = load_tool()
    native, expandable = tmp_path / "n.pickle", tmp_path / "e.pickle"
    save_trace(generate("frag", seed=0), native)
    save_trace(generate("frag", seed=0, settings="expandable_segments:True"), expandable)
    res = tool.compare_recordings(native, expandable)
    assert res["status"] == "pass", res["summary"]
    assert res["details"]["peak_error_expandable"] == 0
    wrong = tmp_path / "w.pickle"  # another workload: the what-if cannot match it
    save_trace(generate("train", seed=0, steps=1, scale=0.125, layers=2,
                        settings="expandable_segments:True"), wrong)
    assert tool.compare_recordings(native, wrong)["status"] == "fail"


def test_script_is_ruff_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this interpreter")
    proc = subprocess.run([str(ruff), "check", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_multi_gpu_row_needs_two_cuda_or_rocm_gpus(tmp_path: Path) -> None:
    """The multi-GPU collectives row runs only with >= 2 CUDA/ROCm GPUs; elsewhere it is skipped
    with the reason (what runs on the GPUs is unverified here)."""
    tool = load_tool()
    assert "multi_gpu_collectives" in tool.ROWS and "multi_gpu_collectives" in tool.CHILDREN
    reason = tool.skip_reason
    assert reason("multi_gpu_collectives", {"native_backend": None}) == "skipped: no GPU"
    assert reason("multi_gpu_collectives", {"native_backend": "cuda", "gpu_count": 1}) == (
        "skipped: needs at least 2 GPUs, found 1")
    assert "NCCL" in reason("multi_gpu_collectives", {"native_backend": "xpu", "gpu_count": 4})
    assert reason("multi_gpu_collectives", {"native_backend": "hip", "gpu_count": 2}) is None
    assert reason("conformance", {"native_backend": "cuda", "gpu_count": 1}) is None
    if torch.cuda.is_available():
        return
    # The child itself, run here: no NCCL in a CPU build (or no second GPU): a clear row, no crash.
    res = tool._run_child("multi_gpu_collectives", tmp_path, 120)
    assert res["status"] in ("error", "skipped"), res
    assert "NCCL" in res["summary"] or "2 GPUs" in res["summary"], res


def test_control_flow_row_verdict_from_recorded_facts() -> None:
    """The control_flow row's verdict on facts a GPU run would record (plumbing: the capture
    itself needs a GPU). CUDA with if-nodes on torch 2.13: cond must replay right, while_loop
    must be a CaptureError; any miss is a fail, never a pass."""
    tool = load_tool()
    assert "control_flow" in tool.ROWS and tool.CHILDREN["control_flow"] is tool.child_control_flow
    assert tool.skip_reason("control_flow", {"native_backend": "xpu", "gpu_count": 1}) is None
    good = {"cond_missing": None, "cond_checks": [True] * 4,
            "random_error": ["CaptureError", "aten.rand_like.default draws random numbers ..."],
            "while_missing": "it needs torch's while-node capture", "while_error": ["CaptureError", "..."],
            "after_refusals_ok": True}
    res = tool.control_flow_verdict(good)
    assert res["status"] == "pass", res["summary"]
    assert "cond: 4 replays equal to eager" in res["summary"]
    bad_cases = [
        ({"cond_checks": [True, False, True, True]}, "do NOT follow the data"),
        ({"cond_error": ["RuntimeError", "CUDA error"]}, "should capture but raised RuntimeError"),
        ({"random_error": None}, "random op"),
        ({"while_error": ["AcceleratorError", "operation not permitted"]}, "not CaptureError"),
        ({"while_error": None, "while_checks": [True] * 3}, "captured although detection said"),
        ({"after_refusals_ok": False}, "after a refusal"),
    ]
    for change, words in bad_cases:
        res = tool.control_flow_verdict({**good, **change})
        assert res["status"] == "fail" and words in res["summary"], (change, res["summary"])
    # ROCm / XPU: no conditional nodes, so refusals are the expected outcome
    none = {"cond_missing": "no conditional nodes", "cond_error": ["CaptureError", "..."],
            "while_missing": "no conditional nodes", "while_error": ["CaptureError", "..."],
            "after_refusals_ok": True}
    assert tool.control_flow_verdict(none)["status"] == "pass"
    # torch with while-node capture: the loop must replay right
    later = {**good, "while_missing": None, "while_error": None, "while_checks": [True, True, True]}
    assert tool.control_flow_verdict(later)["status"] == "pass"


def test_control_flow_child_runs_end_to_end_with_the_recorder_standing_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control_flow child's own code, run here with the recorder (which captures cond and
    while_loop everywhere) standing in for the native backend: it must capture, replay and
    compare without tripping over itself. Says nothing about GPU behaviour."""
    import contextlib

    from accel_graph.backends import select_backend
    from accel_graph.backends.native.control_flow_support import ControlFlowSupport

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the row runs for real in tools/device_check.py")
    tool = load_tool()
    backend, _ = select_backend(None)
    assert backend.name == "recorder"
    monkeypatch.setattr(type(backend), "control_flow_support", lambda self: ControlFlowSupport(
        "recorder", "recorder", None, None, None), raising=False)
    monkeypatch.setattr(type(backend), "control_flow_warmup",
                        lambda self, spec: contextlib.nullcontext(), raising=False)
    facts = tool.child_control_flow(tmp_path, 1)["details"]
    assert facts["cond_checks"] == [True] * 4 and facts["while_checks"] == [True] * 3, facts
    assert facts["after_refusals_ok"] and facts["random_error"] is None  # the recorder allows it


def test_islands_row_verdict_from_recorded_facts() -> None:
    """The islands row's verdict on facts a GPU run would record (plumbing): every replay must
    equal eager, a bad island output must be a ReplayError with a right replay after it."""
    tool = load_tool()
    assert "islands" in tool.ROWS and tool.CHILDREN["islands"] is tool.child_islands
    assert tool.skip_reason("islands", {"native_backend": "xpu", "gpu_count": 1}) is None
    assert tool.skip_reason("islands", {"native_backend": None}) == "skipped: no GPU"
    good = {"checks": [True] * 8, "bad_output_error": ["ReplayError", "eager island ...", True],
            "after_error_ok": True, "pieces": 2, "allocation": "routed", "replay_s": 2e-5,
            "eager_s": 4e-5, "timed_calls": 200}
    res = tool.islands_verdict(good)
    assert res["status"] == "pass", res["summary"]
    assert "8 replays (2 pieces, buffers routed) equal to eager" in res["summary"]
    assert "20.0 us per replay vs 40.0 us eager (0.50x" in res["summary"]
    for change, words in (({"checks": [True, False] * 4}, "do NOT equal eager"),
                          ({"checks": []}, "do NOT equal eager"),
                          ({"bad_output_error": None}, "not a ReplayError"),
                          ({"bad_output_error": ["RuntimeError", "x", False]}, "not a ReplayError"),
                          ({"after_error_ok": False}, "did not equal eager")):
        res = tool.islands_verdict({**good, **change})
        assert res["status"] == "fail" and words in res["summary"], (change, res["summary"])


def test_islands_child_runs_end_to_end_with_the_recorder_standing_in(tmp_path: Path) -> None:
    """The islands child's own code, run here with the recorder (which runs islands on every
    device) standing in for the native backend: it must capture, replay, compare and time
    without tripping over itself. Says nothing about GPU behaviour."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the row runs for real in tools/device_check.py")
    res = load_tool().child_islands(tmp_path, 5)
    facts = res["details"]
    assert res["status"] == "pass", res["summary"]
    assert facts["backend"] == "recorder" and facts["checks"] == [True] * 8
    assert facts["bad_output_error"][0] == "ReplayError" and facts["after_error_ok"]
    assert facts["timed_calls"] == 5 and facts["replay_s"] > 0


def test_serving_row_verdict_and_child_with_the_recorder_standing_in(tmp_path: Path) -> None:
    """The serving row's verdict on recorded facts, then its child end to end with the
    recorder standing in for the native backend (plumbing: says nothing about GPU behaviour)."""
    tool = load_tool()
    assert "serving" in tool.ROWS and tool.CHILDREN["serving"] is tool.child_serving
    good = {"device": "cuda", "eager_tokens_per_s": 100.0, "modes": {
        "full": {"tokens_equal": True, "tokens_per_s": 300.0, "capture_s": 1.0, "eager_steps": 0,
                 "pool_bytes": 1}}}
    res = tool.serving_verdict(good)
    assert res["status"] == "pass" and "full 3.00x eager tokens/s" in res["summary"]
    bad = {**good, "modes": {"full": {**good["modes"]["full"], "tokens_equal": False},
                             "piecewise": {"error": "CaptureError: x"}}}
    res = tool.serving_verdict(bad)
    assert res["status"] == "fail" and "do NOT equal" in res["summary"] and "capture failed" in res["summary"]
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the row runs for real in tools/device_check.py")
    res = tool.child_serving(tmp_path, 1)
    assert res["status"] == "pass", res["summary"]
    assert set(res["details"]["modes"]) == {"piecewise", "full_and_piecewise", "full"}
