"""Ops that real device-graph capture forbids fail at the op with a CaptureError naming it.

They are host syncs (``.item()``, ``bool(t)``, ``torch.equal``) or ops whose output shape depends
on the data (``nonzero``, boolean indexing, ``unique``, ...). Each runs fine eagerly; under
capture it must raise, leave the graph empty, and let the same Graph capture again.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import accel_graph
from accel_graph import CaptureError
from accel_graph.testing import assert_replay_matches, capture, capture_stream

from ._util import check_replay_matches_eager, gen, randn


def _branch(x):
    if x.sum() > 0:  # bool(tensor)
        return x
    return -x


def _uint8_mask(x, mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uint8 masks are deprecated, still accepted
        return x[mask.to(torch.uint8)]


# (id, fn(x, mask, counts), pattern the CaptureError message must contain)
ILLEGAL = [
    ("item", lambda x, m, c: x.sum().item(), r"item|_local_scalar_dense"),
    ("float", lambda x, m, c: float(x.max()), r"item|_local_scalar_dense|float"),
    ("bool", lambda x, m, c: _branch(x), r"bool|_local_scalar_dense"),
    ("equal", lambda x, m, c: torch.equal(x, x * 1), r"equal"),
    (
        "allclose",
        lambda x, m, c: torch.allclose(x, x + 1e-9),
        r"allclose|item|_local_scalar_dense|equal",
    ),
    ("nonzero", lambda x, m, c: torch.nonzero(x > 0), r"nonzero"),
    ("where_1arg", lambda x, m, c: torch.where(x > 0), r"nonzero|where"),
    ("masked_select", lambda x, m, c: torch.masked_select(x, m), r"masked_select"),
    ("unique", lambda x, m, c: torch.unique(c), r"unique"),
    ("bincount", lambda x, m, c: torch.bincount(c), r"bincount"),
    ("repeat_interleave", lambda x, m, c: torch.repeat_interleave(x, c), r"repeat_interleave"),
    ("bool_mask_index", lambda x, m, c: x[m], r"index|mask"),
    ("uint8_mask_index", lambda x, m, c: _uint8_mask(x, m), r"index|mask"),
]


def _inputs(device):
    x = randn(gen(0), 6, device=device)
    mask = x > 0
    counts = torch.tensor([1, 0, 2, 1, 3, 1], device=device)
    return x, mask, counts


@pytest.mark.parametrize("fn,pattern", [c[1:] for c in ILLEGAL], ids=[c[0] for c in ILLEGAL])
def test_illegal_op_raises_capture_error_naming_it(make_graph, backend, device, fn, pattern):
    x, mask, counts = _inputs(device)
    fn(x, mask, counts)  # legal eagerly
    g = make_graph()
    native = backend.capabilities().native_graphs
    # The recorder sees the aten op and names it; native capture fails in the driver, and torch's
    # own error (a RuntimeError) may come through instead.
    with pytest.raises(RuntimeError if native else CaptureError) as info:
        with accel_graph.graph(g):
            y = x * 2  # legal work before the illegal op
            fn(y, mask, counts)
    if not native:
        assert info.match(pattern)
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)

    # The same Graph object captures again and replays right.
    out = capture(g, lambda x: (x * 2).relu(), x)
    fresh = randn(gen(1), 6, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, (fresh * 2).relu())


def test_illegal_op_with_explicit_capture_begin(make_graph, device):
    """Without the context manager the capture is invalidated at the op (as on CUDA) but the
    graph stays ``capturing`` until the caller resets it (or ends it: see below); the graph
    is usable again."""
    x, _, _ = _inputs(device)
    g = make_graph()
    with capture_stream(g):
        g.capture_begin()
        with pytest.raises(CaptureError):
            x.sum().item()
        g.reset()
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    out = capture(g, lambda x: x + 1, x)
    g.replay()
    assert_replay_matches(out, x + 1)


def test_capture_end_after_an_illegal_op_raises_and_the_graph_is_reusable(make_graph, backend, device):
    """An illegal op invalidates the capture, as on CUDA: the thread does not go on recording
    (an eager op gives its value), capture_end() raises CaptureError, the graph is empty."""
    x, _, _ = _inputs(device)
    g = make_graph()
    native = backend.capabilities().native_graphs
    with capture_stream(g):
        g.capture_begin()
        with pytest.raises(RuntimeError if native else CaptureError):
            x.sum().item()
        with pytest.raises(CaptureError):
            g.capture_end()
    assert g.state == "empty"
    assert not accel_graph.is_current_stream_capturing(device)
    assert_replay_matches(x * 2 + 1, x.clone() * 2 + 1, msg="an eager op after capture_end")
    out = capture(g, lambda x: x + 1, x)
    fresh = randn(gen(2), 6, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, fresh + 1)


# Lookalikes that real capture allows: the output shape is known without reading the data, and
# nothing is read on the host. Refusing these would reject code that works on a GPU.
LEGAL = [
    ("repeat_interleave_int", lambda x, c: torch.repeat_interleave(x, 2)),
    ("repeat_interleave_output_size", lambda x, c: torch.repeat_interleave(x, c, output_size=8)),
    ("masked_fill", lambda x, c: x.masked_fill(x > 0, 0.0)),
    ("where_3arg", lambda x, c: torch.where(x > 0, x, -x)),
    ("nonzero_static", lambda x, c: torch.nonzero_static(x > 0, size=6)),
    ("searchsorted", lambda x, c: torch.searchsorted(torch.sort(x).values, x)),
    ("bucketize", lambda x, c: torch.bucketize(x, torch.linspace(-1, 1, 5, device=x.device))),
    ("isin", lambda x, c: torch.isin(c, c[:2])),
    ("histc_with_bounds", lambda x, c: torch.histc(x, bins=4, min=-2, max=2)),
    ("device_side_reductions", lambda x, c: (x.any(), x.max(), (x > 0).all(), x.argmax())),
    ("integer_index", lambda x, c: x[c]),
]


@pytest.mark.parametrize("fn", [c[1] for c in LEGAL], ids=[c[0] for c in LEGAL])
def test_legal_lookalike_is_not_refused(make_graph, device, fn):
    def inputs(g):
        counts = torch.tensor([1, 0, 2, 1, 3, 1])[torch.randperm(6, generator=g)]
        return [randn(g, 6, device=device), counts.to(device)]

    check_replay_matches_eager(make_graph, fn, inputs)
