"""``with accel_graph.Graph() as g:``: the graph is its own context manager, as
``torch.accelerator.Graph`` is. It captures on the current stream with the constructor's
``pool`` and ``capture_error_mode``, drops the capture if the body raises, and refuses to begin
on a graph that already holds a capture (losing nothing)."""

from __future__ import annotations

import pytest

import accel_graph
from accel_graph import CaptureError, GraphStateError
from accel_graph.testing import assert_replay_matches, capture_stream

from ._util import gen, randn


def _fn(x):
    return (x * 3).cos() - 1


def test_with_graph_as_g_captures_and_returns_the_graph(make_graph, device):
    x = randn(gen(0), 16, device=device)
    _fn(x)
    g = make_graph()
    with capture_stream(g), g as entered:
        assert entered is g
        assert g.state == "capturing"
        assert accel_graph.is_current_stream_capturing(device)
        out = _fn(x)
    assert g.state == "instantiated"
    assert not accel_graph.is_current_stream_capturing(device)
    fresh = randn(gen(1), 16, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, _fn(fresh))


def test_keep_graph_with_the_context_manager(make_graph, device):
    x = randn(gen(0), 16, device=device)
    g = make_graph(keep_graph=True)
    with capture_stream(g), g:
        out = _fn(x)
    assert g.state == "captured"
    g.replay()
    assert_replay_matches(out, _fn(x))


def test_constructor_pool_is_used(make_graph, device):
    x = randn(gen(0), 16, device=device)
    handle = accel_graph.graph_pool_handle(device)
    g1 = make_graph(pool=handle)
    with capture_stream(g1), g1:
        y1 = _fn(x)
    g2 = make_graph(pool=g1.pool())
    with capture_stream(g2), g2:
        y2 = y1 * 2
    assert g1.pool() == handle and g2.pool() == handle
    g1.replay()
    g2.replay()
    assert_replay_matches(y2, _fn(x) * 2)


def test_body_that_raises_drops_the_capture(make_graph, device):
    x = randn(gen(0), 16, device=device)
    g = make_graph()
    with pytest.raises(ValueError, match="boom"):
        with capture_stream(g), g:
            _fn(x)
            raise ValueError("boom")
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    with capture_stream(g), g:  # reusable
        out = _fn(x)
    g.replay()
    assert_replay_matches(out, _fn(x))


def test_illegal_op_in_the_body_propagates(make_graph, device):
    x = randn(gen(0), 16, device=device)
    g = make_graph()
    if g.backend.capabilities().native_graphs:
        pytest.skip("a refused op inside a native capture can leave the device unusable")
    with pytest.raises(CaptureError, match="item"):
        with g:
            (x * 2).sum().item()
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)


def test_entering_a_captured_graph_is_refused_and_loses_nothing(make_graph, device):
    x = randn(gen(0), 16, device=device)
    g = make_graph()
    with capture_stream(g), g:
        out = _fn(x)
    ran = []
    with pytest.raises(GraphStateError, match=r"reset\(\)"):
        with g:
            ran.append(True)
    assert not ran, "the body ran although the capture was refused"
    fresh = randn(gen(2), 16, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, _fn(fresh))


def test_a_second_capture_on_the_same_stream_is_refused(make_graph, device):
    x = randn(gen(0), 16, device=device)
    outer, inner = make_graph(), make_graph()
    with capture_stream(outer), outer:
        y = _fn(x)
        with pytest.raises(CaptureError, match="already underway"):
            with inner:
                pass
        assert inner.state == "empty"
        assert outer.state == "capturing"
    outer.replay()
    assert_replay_matches(y, _fn(x))


def test_capture_error_mode_from_the_constructor(make_graph, device):
    x = randn(gen(0), 16, device=device)
    g = make_graph(capture_error_mode="relaxed")
    with capture_stream(g), g:
        out = _fn(x)
    assert g.capture_error_mode == "relaxed"
    g.replay()
    assert_replay_matches(out, _fn(x))


def test_settings_are_attributes_for_the_next_capture(make_graph, device):
    """As on ``torch.accelerator.Graph``: set ``graph_pool`` / ``capture_error_mode`` after
    ``reset()`` to change the next capture."""
    x = randn(gen(0), 16, device=device)
    g = make_graph()
    with capture_stream(g), g:
        _fn(x)
    g.reset()
    handle = accel_graph.graph_pool_handle(device)
    g.graph_pool = handle
    g.capture_error_mode = "thread_local"
    with capture_stream(g), g:
        out = _fn(x)
    assert g.pool() == handle
    g.replay()
    assert_replay_matches(out, _fn(x))
    g.reset()
    g.capture_error_mode = "no-such-mode"
    with pytest.raises(accel_graph.ConfigError, match="capture_error_mode"):
        with capture_stream(g), g:
            pass
    assert g.state == "empty"
