"""Misuse gets the same error type and words on every backend, and loses nothing captured.

Every refused call on a captured graph is followed by a replay that must still be right.
"""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph import AccelGraphError, CaptureError, ConfigError, GraphStateError, PoolError
from accel_graph.backends.base import CAPTURE_ERROR_MODES, PoolHandle
from accel_graph.testing import assert_replay_matches, capture, capture_stream

from ._util import gen, randn


def _fn(x):
    return (x * 2 + 1).relu()


class Captured:
    """A graph holding ``_fn`` on a static input, and a check that it still replays right."""

    def __init__(self, make_graph, device, **kwargs):
        self.x = randn(gen(0), 8, device=device)
        self.g = make_graph(**kwargs)
        self.out = capture(self.g, _fn, self.x)
        self.round = 0

    def check(self, what: str = "") -> None:
        self.round += 1
        fresh = randn(gen(self.round), 8, device=self.x.device)
        self.x.copy_(fresh)
        self.g.replay()
        assert_replay_matches(
            self.out, _fn(fresh), msg=f"replay after {what}" if what else "replay"
        )


# (name, call, words the message must contain to say what to do)
BEFORE_CAPTURE = [
    ("replay", lambda g, p: g.replay(), r"capture"),
    ("capture_end", lambda g, p: g.capture_end(), r"capture_begin\(\)"),
    ("instantiate", lambda g, p: g.instantiate(), r"capture"),
    ("pool", lambda g, p: g.pool(), r"capture_begin\(\)"),
    ("debug_dump", lambda g, p: g.debug_dump(str(p / "g.dot")), r"capture"),
    ("memory_bytes", lambda g, p: g.memory_bytes(), r"capture"),
]


@pytest.mark.parametrize("name,call,fix", BEFORE_CAPTURE, ids=[c[0] for c in BEFORE_CAPTURE])
def test_calls_before_capture_are_refused(make_graph, device, tmp_path, name, call, fix):
    g = make_graph()
    with pytest.raises(GraphStateError, match=fix) as info:
        call(g, tmp_path)
    msg = str(info.value)
    assert name in msg and "empty" in msg, f"the message should name the call and the state: {msg}"
    assert g.state == "empty"
    x = randn(gen(1), 8, device=device)
    out = capture(g, _fn, x)
    g.replay()
    assert_replay_matches(out, _fn(x))


def test_replay_after_reset_is_refused(make_graph, device):
    c = Captured(make_graph, device)
    c.check()
    c.g.reset()
    assert c.g.state == "empty"
    with pytest.raises(GraphStateError, match="capture"):
        c.g.replay()


def test_misuse_of_a_captured_graph_loses_nothing(make_graph, device):
    c = Captured(make_graph, device)
    c.check()
    with pytest.raises(GraphStateError, match=r"reset\(\)"):
        c.g.capture_begin()
    c.check("capture_begin on a captured graph")
    with pytest.raises(GraphStateError, match=r"capture_begin\(\)"):
        c.g.capture_end()
    c.check("capture_end on a captured graph")
    ran = []
    with pytest.raises(GraphStateError, match=r"reset\(\)"):
        with accel_graph.graph(c.g):
            ran.append(True)
    assert not ran, "the body of `with graph(g)` ran although capture_begin was refused"
    c.check("`with graph(g)` on a captured graph")
    with pytest.raises(AccelGraphError):
        c.g.capture_begin(capture_error_mode="no-such-mode")
    c.check("capture_begin with a bad mode on a captured graph")
    with pytest.raises(AccelGraphError):
        c.g.capture_begin(pool=object())
    c.check("capture_begin with a bad pool on a captured graph")
    # keep_graph=False: capture_end() instantiated it; torch refuses a second instantiate() with
    # these words (CUDAGraph::instantiate), and so do we, losing nothing.
    with pytest.raises(GraphStateError, match=r"only when keep_graph=true") as info:
        c.g.instantiate()
    assert "replay()" in str(info.value) and "keep_graph=True" in str(info.value)
    c.check("instantiate on an instantiated keep_graph=False graph")
    assert c.g.state == "instantiated"


def test_instantiate_again_with_keep_graph_is_harmless(make_graph, device):
    c = Captured(make_graph, device, keep_graph=True)
    assert c.g.state == "captured"
    c.g.instantiate()
    c.g.instantiate()  # torch re-instantiates; here it is a no-op: the same program replays
    c.check("instantiate twice with keep_graph=True")
    assert c.g.state == "instantiated"


def test_misuse_while_capturing_loses_nothing(make_graph, device, tmp_path):
    x = randn(gen(0), 8, device=device)
    _fn(x)
    g = make_graph()
    with capture_stream(g):
        g.capture_begin()
        try:
            y = x * 2
            with pytest.raises(GraphStateError, match=r"capture_end\(\)"):
                g.capture_begin()
            with pytest.raises(GraphStateError, match="capture"):
                g.replay()
            with pytest.raises(GraphStateError, match="capture"):
                g.instantiate()
            with pytest.raises(GraphStateError, match="capture"):
                g.debug_dump(str(tmp_path / "g.dot"))
            assert g.state == "capturing"
            assert isinstance(g.pool(), PoolHandle)
            out = (y + 1).relu()
        finally:
            g.capture_end()
    assert g.state == "instantiated"
    for r in range(1, 3):
        fresh = randn(gen(r), 8, device=device)
        x.copy_(fresh)
        g.replay()
        assert_replay_matches(out, _fn(fresh), msg=f"replay {r}")


def test_nested_with_on_the_same_graph_leaves_it_empty(make_graph, device):
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    with pytest.raises(GraphStateError, match=r"capture_end\(\)"):
        with accel_graph.graph(g):
            x * 2
            with accel_graph.graph(g):
                pass
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    out = capture(g, _fn, x)
    g.replay()
    assert_replay_matches(out, _fn(x))


def test_capture_inside_another_capture_is_refused(make_graph, device):
    x = randn(gen(0), 8, device=device)
    outer, inner = make_graph(), make_graph()
    with pytest.raises(CaptureError):
        with accel_graph.graph(outer):
            x * 2
            with accel_graph.graph(inner):
                x * 3
    assert outer.state == "empty" and inner.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    for g in (outer, inner):
        out = capture(g, _fn, x)
        g.replay()
        assert_replay_matches(out, _fn(x))


def test_body_raising_leaves_graph_empty_and_reusable(make_graph, device):
    x = randn(gen(0), 8, device=device)
    g = make_graph()
    with pytest.raises(KeyError):
        with accel_graph.graph(g):
            x * 2
            raise KeyError("user code failed mid-capture")
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    with pytest.raises(GraphStateError):
        g.replay()
    out = capture(g, _fn, x)
    g.replay()
    assert_replay_matches(out, _fn(x))


# -- capture_error_mode ------------------------------------------------------------------------


def test_unknown_capture_error_mode_in_constructor(make_graph):
    with pytest.raises(ConfigError, match="default") as info:
        make_graph(capture_error_mode="strict")
    assert isinstance(info.value, ValueError)
    assert "strict" in str(info.value)


def test_unknown_capture_error_mode_in_capture_begin(make_graph, device):
    g = make_graph()
    with pytest.raises(ConfigError, match="default"):
        g.capture_begin(capture_error_mode="GLOBAL ")
    assert g.state == "empty"
    with pytest.raises(ConfigError):
        with accel_graph.graph(g, capture_error_mode="threadlocal"):
            pass
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    x = randn(gen(0), 8, device=device)
    out = capture(g, _fn, x)
    g.replay()
    assert_replay_matches(out, _fn(x))


@pytest.mark.parametrize("mode", CAPTURE_ERROR_MODES)
@pytest.mark.parametrize("where", ["constructor", "capture_begin", "graph"])
def test_every_capture_error_mode_is_accepted(make_graph, device, mode, where):
    x = randn(gen(0), 8, device=device)
    _fn(x)
    g = make_graph(capture_error_mode=mode) if where == "constructor" else make_graph()
    if where == "graph":
        with accel_graph.graph(g, capture_error_mode=mode):
            out = _fn(x)
    else:
        with capture_stream(g):
            g.capture_begin(**({"capture_error_mode": mode} if where == "capture_begin" else {}))
            out = _fn(x)
            g.capture_end()
    fresh = randn(gen(1), 8, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, _fn(fresh))


# -- pool handles ------------------------------------------------------------------------------


def _bad_pools(backend, device):
    """Pool arguments that name no pool of this backend and device."""
    bad = {"object": object(), "string": "pool0", "int": 3}
    if not backend.capabilities().foreign_pool_handles:
        # Native backends take torch's own (int, int) ids; elsewhere these name no pool.
        spec = backend.device_spec(device)
        bad["tuple"] = (0, 123456)
        bad["forged_handle"] = PoolHandle(type(backend).name, spec, (0, 10**9))
    return bad


def test_pool_that_belongs_to_no_pool(make_graph, backend, device):
    x = randn(gen(0), 8, device=device)
    for name, bad in _bad_pools(backend, device).items():
        with pytest.raises(PoolError) as info:
            make_graph(pool=bad)
        assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
        g = make_graph()
        with pytest.raises(PoolError):
            g.capture_begin(pool=bad)
        assert g.state == "empty", name
        with pytest.raises(PoolError):
            with accel_graph.graph(g, pool=bad):
                pass
        assert g.state == "empty", name
        assert not accel_graph.is_current_stream_capturing(device)
        out = capture(g, _fn, x)
        g.replay()
        assert_replay_matches(out, _fn(x), msg=f"after refusing pool {name}")


def _other_device(device: torch.device) -> torch.device | None:
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 1
    if count < 2:
        return None
    index = device.index if device.index is not None else 0
    return torch.device(device.type, (index + 1) % count)


def test_pool_of_another_device_is_refused(make_graph, device):
    other = _other_device(device)
    if other is None:
        pytest.skip(f"needs a second {device.type} device")
    handle = accel_graph.graph_pool_handle(other)
    with pytest.raises(PoolError):
        make_graph(pool=handle)
    g = make_graph()
    with pytest.raises(PoolError):
        g.capture_begin(pool=handle)
    assert g.state == "empty"
