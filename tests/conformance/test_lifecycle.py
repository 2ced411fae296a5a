"""The life of a graph: states, keep_graph, reset and recapture, shared pools, debug dumps."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import accel_graph
from accel_graph.backends.base import PoolHandle
from accel_graph.testing import assert_bitwise_equal, assert_replay_matches, capture, capture_stream

from ._util import gen, randn


def _f1(x):
    return (x * 2).sin() + 1


def _f2(x):
    return (x.flip(0) - 3).exp().sum(dim=0)


def test_states_with_default_keep_graph(make_graph, device):
    x = randn(gen(0), 8, device=device)
    _f1(x)
    g = make_graph()
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    with accel_graph.graph(g):
        assert g.state == "capturing"
        assert accel_graph.is_current_stream_capturing(device)
        assert accel_graph.is_current_stream_capturing()  # routing picks the same backend
        out = _f1(x)
    assert not accel_graph.is_current_stream_capturing(device)
    assert g.state == "instantiated"
    g.replay()
    assert_replay_matches(out, _f1(x))
    g.reset()
    assert g.state == "empty"
    g.reset()  # resetting an empty graph is harmless
    assert g.state == "empty"


def test_keep_graph_instantiates_on_demand(make_graph, device):
    x = randn(gen(0), 8, device=device)
    g = make_graph(keep_graph=True)
    out = capture(g, _f1, x)
    assert g.state == "captured"
    g.instantiate()
    assert g.state == "instantiated"
    g.replay()
    assert_replay_matches(out, _f1(x))

    lazy = make_graph(keep_graph=True)
    out2 = capture(lazy, _f2, x)
    assert lazy.state == "captured"
    fresh = randn(gen(1), 8, device=device)
    x.copy_(fresh)
    lazy.replay()  # instantiates first
    assert lazy.state == "instantiated"
    assert_replay_matches(out2, _f2(fresh))


def test_explicit_capture_begin_end(make_graph, device):
    x = randn(gen(0), 8, device=device)
    _f1(x)
    g = make_graph()
    with capture_stream(g):  # CUDA/HIP refuse to capture on the default stream
        g.capture_begin()
        assert accel_graph.is_current_stream_capturing(device)
        out = _f1(x)
        g.capture_end()
        assert not accel_graph.is_current_stream_capturing(device)
    fresh = randn(gen(1), 8, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, _f1(fresh))


def test_reset_and_recapture_a_different_function(make_graph, device):
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    out1 = capture(g, _f1, x)
    fresh = randn(gen(1), 8, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out1, _f1(fresh))
    last = out1.clone()

    g.reset()
    assert g.state == "empty"
    # Outputs of the first capture stay readable and keep the last replay's values.
    assert_bitwise_equal(out1, last, msg="after reset")

    out2 = capture(g, _f2, x)
    for r in range(2, 4):
        fresh = randn(gen(r), 8, device=device)
        x.copy_(fresh)
        g.replay()
        assert_replay_matches(out2, _f2(fresh), msg=f"second capture, replay {r}")
        assert_bitwise_equal(out1, last, msg="an output of the first capture changed")


def test_deleting_a_graph_keeps_its_outputs_readable(make_graph, device):
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    out = capture(g, _f1, x)
    g.replay()
    assert_replay_matches(out, _f1(x))
    held = out.clone()
    del g
    assert_bitwise_equal(out, held, msg="after del")
    g2 = make_graph()
    x3 = x * 3
    out2 = capture(g2, _f2, x3)  # new captures must not reuse memory `out` still points into
    g2.replay()
    assert_replay_matches(out2, _f2(x3))
    assert_bitwise_equal(out, held, msg="after another graph captured and replayed")


def _shared_pool_pair(make_graph, device, pool_for_g2):
    """g1 computes h = f1(x); g2 reads g1's output and computes f2(h): the chained-graph pattern
    that shares one pool between captures."""
    x = randn(gen(0), 8, device=device)
    h_pool = accel_graph.graph_pool_handle(device)
    g1 = make_graph()
    h = capture(g1, _f1, x, pool=h_pool)
    g2 = make_graph()
    y = capture(g2, _f2, h, pool=pool_for_g2(h_pool, g1))
    return x, g1, g2, h, y


def _check_pair(x, g1, g2, h, y, device):
    for r in range(1, 4):
        fresh = randn(gen(r), 8, device=device)
        x.copy_(fresh)
        g1.replay()
        g2.replay()
        eh = _f1(fresh)
        assert_replay_matches([h, y], [eh, _f2(eh)], msg=f"round {r}")
    g2.replay()  # replay order does not matter for held outputs
    g1.replay()
    assert_replay_matches(h, _f1(x))


def test_shared_pool_handle(make_graph, device):
    _check_pair(*_shared_pool_pair(make_graph, device, lambda handle, g1: handle), device)


def test_pool_of_a_graph_is_a_usable_handle(make_graph, device):
    x, g1, g2, h, y = _shared_pool_pair(make_graph, device, lambda handle, g1: g1.pool())
    assert isinstance(g1.pool(), PoolHandle)
    _check_pair(x, g1, g2, h, y, device)


def test_pool_in_constructor_and_capture_begin(make_graph, device):
    handle = accel_graph.graph_pool_handle(device)
    x = randn(gen(0), 8, device=device)
    _f1(x)
    _f2(x)
    g1 = make_graph(pool=handle)
    with accel_graph.graph(g1):
        o1 = _f1(x)
    g2 = make_graph()
    with capture_stream(g2):
        g2.capture_begin(pool=handle)
        o2 = _f2(x)
        g2.capture_end()
    fresh = randn(gen(1), 8, device=device)
    x.copy_(fresh)
    g1.replay()
    g2.replay()
    assert_replay_matches([o1, o2], [_f1(fresh), _f2(fresh)])


def test_graph_pool_handle_is_opaque_and_fresh(device):
    a, b = accel_graph.graph_pool_handle(device), accel_graph.graph_pool_handle(device)
    assert isinstance(a, PoolHandle) and isinstance(b, PoolHandle)
    assert a != b


def test_debug_dump(make_graph, backend, device, tmp_path):
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    g.enable_debug_mode()
    out = capture(g, _f1, x)
    path = tmp_path / "graph.dot"
    g.debug_dump(str(path))
    assert path.exists() and path.stat().st_size > 0
    if not backend.capabilities().native_graphs:
        with open(f"{path}.json") as fh:
            assert isinstance(json.load(fh), dict)
    g.replay()  # dumping changes nothing
    assert_replay_matches(out, _f1(x))


def test_debug_dump_without_debug_mode(make_graph, backend, device, tmp_path):
    if backend.capabilities().native_graphs:
        pytest.skip("native graphs need enable_debug_mode() before capture, as in torch")
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    capture(g, _f1, x)
    path = os.path.join(tmp_path, "plain.dot")
    g.debug_dump(path)
    assert os.path.getsize(path) > 0 and os.path.getsize(path + ".json") > 0


def test_nothing_captured(make_graph, device):
    """An empty capture is legal but warns with torch's words (``UserWarning``), pointing at
    the caller's line; replaying it does nothing."""
    g = make_graph()
    with pytest.warns(accel_graph.EmptyGraphWarning, match="The CUDA Graph is empty") as rec:
        with accel_graph.graph(g):
            pass
    assert issubclass(accel_graph.EmptyGraphWarning, UserWarning)
    assert any(w.filename == __file__ for w in rec), [w.filename for w in rec]
    g.replay()
    g.replay()
    # Only views: nothing for replay to run either.
    x = randn(gen(0), 8, device=device)
    g2 = make_graph()
    with pytest.warns(accel_graph.EmptyGraphWarning):
        with accel_graph.graph(g2):
            x.view(2, 4).t()
    # Real work: no warning.
    g3 = make_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("error", accel_graph.EmptyGraphWarning)
        with accel_graph.graph(g3):
            x * 2


def test_capture_under_inference_mode_and_no_grad(make_graph, device):
    """Servers capture under ``torch.inference_mode()``; replay may run outside it."""
    w = randn(gen(1), 8, device=device).requires_grad_(True)
    for ctx in (torch.inference_mode, torch.no_grad):
        x = randn(gen(0), 8, device=device)
        g = make_graph()
        with ctx():
            out = capture(g, lambda x: (x * w).tanh(), x)
        fresh = randn(gen(2), 8, device=device)
        x.copy_(fresh)
        g.replay()
        assert not out.requires_grad
        with torch.no_grad():
            assert_replay_matches(out, (fresh * w).tanh(), msg=ctx.__name__)


def test_memory_bytes_after_capture(make_graph, device):
    x = randn(gen(0), 64, device=device)
    g = make_graph()
    out = capture(g, _f1, x)
    held = g.memory_bytes()
    assert held is None or (isinstance(held, int) and held >= out.numel() * out.element_size())
    alone = g.standalone_bytes()
    assert alone is None or (isinstance(alone, int) and alone >= 0)
