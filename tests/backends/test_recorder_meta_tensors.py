"""A meta tensor made inside a recorder capture is refused (the pool has no meta memory: the
capture once returned a real CPU tensor where eager returns a meta one, silently)."""

from __future__ import annotations

import pytest
import torch

import accel_graph as ag
from accel_graph.errors import CaptureError


def test_meta_factory_in_capture_is_refused_and_the_graph_stays_usable():
    g = ag.Graph(device="cpu")
    x = torch.ones(3)
    with pytest.raises(CaptureError, match="meta device.*outside the capture"):
        with ag.graph(g):
            torch.ones(2, device="meta")
    with ag.graph(g):
        y = x * 2
    x.fill_(4.0)
    g.replay()
    assert torch.equal(y, torch.full((3,), 8.0))


def test_op_on_a_meta_input_is_refused():
    m = torch.empty(2, device="meta")
    g = ag.Graph(device="cpu")
    with pytest.raises(CaptureError, match="meta device"):
        with ag.graph(g):
            m + 1
