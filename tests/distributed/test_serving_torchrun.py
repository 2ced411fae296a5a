"""The serving engine over the tensor-parallel decoder under ``torchrun --nproc-per-node 2``
(gloo, CPU): every request's tokens equal the single-process engine's on the full model.

torchrun is launched as ``python -m torch.distributed.run`` from this interpreter
(``--standalone``: a free rendezvous port on localhost); the demo module
(``accel_graph.serving.tp_demo``) writes rank 0's tokens to JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from accel_graph.serving.engine import Engine
from accel_graph.serving.executors import EagerExecutor, serving_config
from accel_graph.serving.workload import poisson_requests

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--requests", "12", "--prompt-lens", "4:40", "--max-new-tokens", "4:16", "--seed", "3",
        "--slots", "4", "--max-tokens", "32"]


def _single_process_tokens() -> list[list[int]]:
    cfg = serving_config(max_batch=4)
    stream = poisson_requests(12, float("inf"), (4, 40), (4, 16), vocab_size=cfg.vocab_size, seed=3)
    run = Engine(EagerExecutor.from_config(cfg, max_tokens=32)).run(stream)
    assert all(r.finish_reason == "length" for r in run.results)
    return [r.tokens for r in run.results]


@pytest.mark.parametrize("executor", [
    [], pytest.param(["--graph", "--no-compile"], marks=pytest.mark.slow)], ids=["eager", "graph"])
def test_torchrun_two_ranks_tokens_equal_single_process(tmp_path: Path, executor: list[str]) -> None:
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "accel_graph.serving.tp_demo", *ARGS, *executor, "--timeout", "60",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["executor"] == (executor and "graph" or "eager")
    assert report["finish_reasons"] == ["length"] * 12
    assert report["tokens"] == _single_process_tokens()
    assert "12 requests served" in proc.stdout
