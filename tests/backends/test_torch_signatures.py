"""Our feature detection against the installed torch's real classes (signatures only: nothing is
instantiated and no device is touched). On the CI torch (2.13, CPU build) this pins what the
adapters will pass to torch's own graph classes on a GPU host with the same torch."""

from __future__ import annotations

import inspect

import pytest
import torch

from accel_graph.backends.native.backend import capture_begin_params


def test_cuda_graph_capture_begin_takes_pool_and_mode() -> None:
    params = capture_begin_params(torch.cuda.CUDAGraph)
    assert {"pool", "capture_error_mode"} <= params


@pytest.mark.skipif(not hasattr(torch.xpu, "XPUGraph"), reason="torch < 2.11 has no XPUGraph")
def test_xpu_graph_capture_begin_takes_only_pool() -> None:
    assert capture_begin_params(torch.xpu.XPUGraph) == {"pool"}


@pytest.mark.skipif(
    not hasattr(getattr(torch, "accelerator", None), "Graph"),
    reason="torch < 2.12 has no torch.accelerator.Graph",
)
def test_accelerator_graph_takes_pool_and_mode_somewhere() -> None:
    begin = capture_begin_params(torch.accelerator.Graph)
    init = set(inspect.signature(torch.accelerator.Graph).parameters)
    # 2.12/2.13: both on the constructor; upstream main moves the mode to capture_begin.
    assert "pool" in init | begin and "capture_error_mode" in init | begin


def test_snapshot_signatures() -> None:
    assert {"mempool_id", "include_traces"} <= set(inspect.signature(torch.cuda.memory_snapshot).parameters)
    assert "mempool_id" in inspect.signature(torch.xpu.memory_snapshot).parameters
