"""An eager island returning a tensor subclass with no storage of its own (a wrapper subclass)
is refused at capture with a clear ``CaptureError``, not torch's "invalid python storage"."""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph.errors import CaptureError

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")


@accel_graph.eager_island
def _wrapped(x: torch.Tensor) -> torch.Tensor:
    return two_tensor.TwoTensor(x * 2, x * 3)


def test_wrapper_subclass_output_is_refused_by_name() -> None:
    x = torch.randn(4)
    g = accel_graph.Graph(device="cpu")
    with pytest.raises(CaptureError, match=r"returned output 0, a TwoTensor .* no storage of its own"):
        with torch.inference_mode(), accel_graph.graph(g):
            _wrapped(x + 1)
    # the capture is over and nothing leaked: a new capture works
    g2 = accel_graph.Graph(device="cpu")
    with torch.inference_mode(), accel_graph.graph(g2):
        y = x * 5
    g2.replay()
    assert torch.equal(y, x * 5)
