"""Upstream miscellany (``test/test_cuda.py``): capture error modes with another thread
allocating during a capture, and a recurrent network with dropout captured between eager runs.
"""

from __future__ import annotations

import threading

import pytest
import torch

import accel_graph
from accel_graph.testing import assert_replay_matches, capture_stream

from ._common import COMPILED, NEEDS_LSTM, seed


def _fn(device: torch.device) -> torch.Tensor:
    x = torch.zeros([2000], device=device)
    return x + x + x


@pytest.mark.parametrize("mode", [pytest.param("thread_local", marks=COMPILED), "relaxed"])
def test_cuda_graph_error_options(make_graph, device, mode):
    """Another thread allocating and freeing memory during a ``thread_local`` or ``relaxed``
    capture breaks nothing. Upstream allocates raw memory with
    ``torch.cuda.caching_allocator_alloc`` on a side stream; here the thread makes and drops
    a tensor and checks its value, which must be real (other threads run eagerly).
    ``global`` is left untested, as upstream (the error would corrupt the process on CUDA)."""
    seen: list[float] = []

    def raw_malloc() -> None:
        t = torch.ones(256, device=device) * 2
        seen.append(float(t.sum()))
        del t

    g = make_graph()
    backend = g.backend
    backend.synchronize(g.device_spec)
    with capture_stream(g):
        _fn(device)  # warm-up on the capture stream
    backend.synchronize(g.device_spec)
    with accel_graph.graph(g, capture_error_mode=mode):
        out = _fn(device)
        thread = threading.Thread(target=raw_malloc)
        thread.start()
        thread.join()
    assert seen == [512.0], "the other thread's work must run eagerly, with real values"
    g.replay()
    assert torch.equal(out, torch.zeros(2000, device=device))


@NEEDS_LSTM
def test_graph_cudnn_dropout(make_graph, device):
    """A recurrent network with dropout, run eagerly, captured, replayed and run eagerly again.
    Upstream (``torch.nn.LSTM(512, 512, 2, dropout=0.5)`` on cuDNN) checks only that the mix
    works; the replay must also draw what eager draws after the same seed."""
    model = torch.nn.LSTM(32, 32, 2, dropout=0.5).to(device)
    x = torch.ones(10, 8, 32, device=device)
    model(x)

    g = make_graph()
    with capture_stream(g):
        g.capture_begin()
        out, _ = model(x)
        g.capture_end()

    seed(7)
    g.replay()
    seed(7)
    expected, _ = model(x)
    assert_replay_matches(out, expected, msg="LSTM with dropout")
    model(x)
