"""Eager islands on a native backend (FAKE CUDA: plumbing, not the GPU). Native backends do not
run islands between graph pieces yet, so an island called in their capture is refused: captured
inline it would silently not run eagerly at each replay."""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph.errors import CaptureError

from .fakes import FakeCudaModule


def test_island_in_a_native_capture_is_refused_and_the_graph_stays_usable(
        fake_cuda: FakeCudaModule) -> None:
    calls: list[int] = []

    @accel_graph.eager_island
    def route(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x

    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=r"eager island .*route.* cuda capture.*recorder"):
        with accel_graph.graph(g):
            fake_cuda.allocate(8)
            route(torch.ones(2))
    assert calls == [] and g.state == "empty" and fake_cuda.capturing is None
    with accel_graph.graph(g):  # no island: captures as before
        fake_cuda.allocate(8)
    assert g.state == "instantiated"
    assert torch.equal(route(torch.ones(2)), torch.ones(2)) and calls == [1]  # outside: a call
