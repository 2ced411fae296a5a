"""The runner's state as one record (``runner.runtime``), capture and reports as functions over
it, and the runner package's import rules (its verification uses the L0 tolerances)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accel_graph
from accel_graph import GraphRunner
from accel_graph.backends import select_backend
from accel_graph.runner import RunnerRuntime
from accel_graph.runner.capture import capture_buckets
from accel_graph.runner.reports import memory_report, stats

RUNNER_DIR = Path(accel_graph.__file__).parent / "runner"


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_backend_is_routed_at_construction() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), buckets=[1, 2], progress=False)
    rt = r.runtime
    assert isinstance(rt, RunnerRuntime)
    assert rt.backend is select_backend(r.device)[0]
    assert rt.device_spec == rt.backend.device_spec(r.device)
    assert not rt.captured and rt.pool is None
    # The report keeps its documented contract: no backend named before capture.
    assert r.memory_report()["backend"] is None
    r.capture()
    assert rt.captured and rt.pool is not None
    assert r.memory_report()["backend"] == rt.backend.name


def test_capture_and_reports_are_functions_of_the_runtime() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), buckets=[1, 2], progress=False)
    capture_buckets(r.runtime)
    assert r.captured_buckets == [1, 2]
    for n in (1, 2, 2, 3):
        torch.testing.assert_close(r(torch.ones(n, 3)), affine(torch.ones(n, 3)))
    rt = r.runtime
    assert rt.graph_sizes[1:] == [1, 2] and rt.eager_calls == 1 and rt.eager_sizes == {3: 1}
    assert [b.replays for b in rt.buckets] == [1, 2]
    assert stats(rt) == r.stats() and memory_report(rt) == r.memory_report()
    r.reset_stats()
    assert r.stats()["calls"] == 0 and rt.graph_sizes == [0, 0, 0] and not rt.fallbacks


def test_runner_attributes_read_the_runtime() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), max_batch=5, progress=False)
    rt = r.runtime
    assert r.buckets == rt.ladder == [1, 2, 4, 5] and r.max_bucket == rt.max_bucket == 5
    assert r.device == rt.device and r.inputs is rt.inputs and r.fn is rt.fn
    # verify=True means two checked replays per bucket (the first and the second).
    assert (r.verify, r.strict, r.copy_outputs, r.compile) == (2, False, False, None)
    r.strict = True  # behaviour flags stay settable, as plain attributes were
    assert rt.strict is True
    r.verify = False
    assert rt.verify == 0
    with pytest.raises(accel_graph.ConfigError, match="verify must be"):
        r.verify = -1
    with pytest.raises(AttributeError):
        r.buckets = [1]  # the ladder is fixed once static inputs are sized for it


def test_graph_of_unknown_bucket_is_refused() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), buckets=[1, 2], progress=False).capture()
    assert r.graph(2) is not None
    with pytest.raises(accel_graph.ConfigError, match="not a bucket"):
        r.graph(3)


def test_tolerances_live_in_layer_zero_and_testing_reexports_them() -> None:
    import accel_graph.foundation.tolerances as tolerances
    import accel_graph.testing as testing
    import accel_graph.testing.tolerances as testing_tolerances

    for name in tolerances.__all__:
        assert getattr(testing, name) is getattr(tolerances, name)
        assert getattr(testing_tolerances, name) is getattr(tolerances, name)
    assert callable(testing.assert_replay_matches) and callable(testing.compiled_replay)
    # Importing the L0 module pulls in nothing above L0 (the package face loads lazily).
    code = ("import json, sys, accel_graph.foundation.tolerances; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('accel_graph.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # torch_support: the package face's import-time version check (stdlib only, no torch import).
    layer0 = {"accel_graph.errors", "accel_graph.foundation", "accel_graph.foundation.lazy",
              "accel_graph.foundation.config", "accel_graph.foundation.tolerances",
              "accel_graph.foundation.torch_support"}
    assert set(json.loads(out.stdout)) <= layer0, out.stdout


@pytest.mark.parametrize("path", sorted(RUNNER_DIR.glob("*.py")), ids=lambda p: p.name)
def test_runner_modules_are_small_and_import_no_private_sibling_names(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) < 500
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name} imports private {private} from {node.module}"
            assert node.module != "testing" and not (node.module or "").startswith("testing.")
