"""Fixtures for the ``accel-alloc`` tests: the CLI runner, the shared NPU traces, generated traces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from accel_graph.allocator.sim.fidelity import find_npu_traces
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import save_trace
from accel_graph.cli.alloc.main import main

REPO = Path(__file__).resolve().parents[2]


class CliRun:
    """One finished ``accel-alloc`` invocation."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliRun]:
    """``cli("simulate", path, "--json")`` -> :class:`CliRun` (in-process, output captured)."""

    def run(*argv: Any) -> CliRun:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return CliRun(code, out, err)

    return run


@pytest.fixture(scope="session")
def npu_dir() -> Path:
    """shared/traces/npu; the test skips with a reason when it is absent."""
    d = find_npu_traces(REPO)
    if d is None:
        pytest.skip("shared/traces/npu not found beside the repository or at /work/shared")
    return d


@pytest.fixture(scope="session")
def frag_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generator's ``frag`` workload (known fragmentation), saved as a compact trace."""
    path = tmp_path_factory.mktemp("traces") / "frag.agtrace"
    save_trace(generate("frag", seed=0), path, format="compact")
    return path


@pytest.fixture(scope="session")
def train_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dense-training trace saved as a snapshot pickle."""
    path = tmp_path_factory.mktemp("traces") / "train.pickle"
    save_trace(generate("train", seed=1, steps=1, scale=0.125, layers=2), path, format="pickle")
    return path
