"""Recorder capture decides each (op, argument metadata) once and reuses the decision (a plan).

What the plan cache must not change: errors still name the calling line, argument-dependent
legality still applies, values of Python numbers are read per call (0.0 and -0.0 share a key),
the default dtype is part of the key, and the per-capture cache of pool-tensor locations follows
in-place view ops and ``.data =``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import accel_graph as ag
from accel_graph import CaptureError


def _capture(fn, *args):
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        out = fn(*args)
    return g, out


def _line_of(marker: str, fn) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if marker in line)


def _illegal_after_legal(x):
    y = (x * 2).sum()  # the same ops, legal, planned and cached first
    return y.item()  # MARK-ITEM


def test_capture_error_names_the_calling_line_every_time():
    x = torch.randn(4)
    line = _line_of("MARK-ITEM", _illegal_after_legal)
    for _ in range(2):  # the second capture runs on cached plans up to the illegal op
        g = ag.Graph(device="cpu")
        with pytest.raises(CaptureError) as info:
            with ag.graph(g):
                _illegal_after_legal(x)
        assert f"{__file__}:{line} in _illegal_after_legal" in str(info.value)
        assert g.state == "empty"


def _index(x, idx):
    return x[idx]  # MARK-INDEX


def test_argument_dependent_legality_is_not_hidden_by_a_cached_plan():
    x = torch.randn(6)
    ints = torch.tensor([0, 2, 4])
    g, out = _capture(_index, x, ints)
    g.replay()
    assert torch.equal(out, x[ints])
    mask = torch.tensor([True, False, True, False, True, False])
    g2 = ag.Graph(device="cpu")
    with pytest.raises(CaptureError, match="mask") as info:
        with ag.graph(g2):
            _index(x, mask)
    assert f":{_line_of('MARK-INDEX', _index)} in _index" in str(info.value)


@pytest.mark.parametrize("value", [0.0, -0.0])
def test_number_values_are_read_per_call(value):
    # 0.0 == -0.0 and they hash alike, so they share a plan; the sign must still reach replay.
    x = torch.ones(3)
    for v in (0.0, -0.0, value):
        g, (full, prod) = _capture(lambda t, v=v: (torch.full((3,), v), t * v), x)
        g.replay()
        assert torch.equal(torch.signbit(full), torch.signbit(torch.full((3,), v)))
        assert torch.equal(torch.signbit(prod), torch.signbit(x * v))


def test_default_dtype_is_part_of_the_plan():
    prev = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            g, (z, h) = _capture(lambda t: (torch.zeros(2), t * 0.5), torch.arange(3))
            g.replay()
            assert z.dtype == dtype and h.dtype == dtype
            assert torch.equal(h, torch.arange(3) * 0.5)
    finally:
        torch.set_default_dtype(prev)


def _inplace_views(x):
    y = x * 2  # a pool tensor
    z = y + 1  # its location is now cached
    y.t_()  # in place: same object, new strides
    y.unsqueeze_(0)
    w = y * 3  # must read y with its new metadata
    return z, w


def test_location_cache_follows_inplace_view_ops():
    x = torch.randn(3, 4)
    for _ in range(2):
        g, (z, w) = _capture(_inplace_views, x)
        x.copy_(torch.randn(3, 4))
        g.replay()
        ez, ew = _inplace_views(x)
        assert torch.equal(z, ez) and torch.equal(w, ew)


def _set_data(x):
    a = x * 2  # pool tensors of the same shape
    b = x + 1
    c = a * 1  # a's location is now cached
    a.data = b  # a now points at b's memory, through no aten op but the probe
    return c, a * 5


def test_location_cache_follows_set_data():
    x = torch.randn(4)
    g, (c, d) = _capture(_set_data, x)
    x.copy_(torch.randn(4))
    g.replay()
    assert torch.equal(c, x * 2)
    assert torch.equal(d, (x + 1) * 5)
