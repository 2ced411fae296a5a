"""An input resized or re-pointed between replays fails loudly instead of reading stale memory.

A device graph bakes in the addresses of its inputs. Servers that reallocate a static input
(``resize_``, ``set_``, ``.data =``) get silently wrong results from native graphs, which cannot
see their inputs; the recorder checks each input's storage, shape and stride at replay.
"""

from __future__ import annotations

import re

import pytest
import torch

from accel_graph import ReplayError
from accel_graph.testing import assert_replay_matches, capture

from ._util import gen, randn

# The message must say what to do: keep the input's memory and copy_ into it, or capture again.
FIX = re.compile(r"copy_|re-?capture|capture again|reset\(\)", re.IGNORECASE)


@pytest.fixture
def checked(backend):
    if backend.capabilities().native_graphs:
        pytest.skip("native device graphs cannot see their inputs, so stale inputs go undetected")


def _fn(x, w):
    return x @ w + 1


def _captured(make_graph, device):
    x, w = randn(gen(0), 4, 8, device=device), randn(gen(1), 8, 3, device=device)
    g = make_graph()
    return g, capture(g, _fn, x, w), x, w


def _assert_refused(g, what):
    with pytest.raises(ReplayError) as info:
        g.replay()
    assert FIX.search(str(info.value)), (
        f"the ReplayError after {what} does not say what to do: {info.value}"
    )
    assert g.state == "instantiated", "a refused replay must not drop the graph"


@pytest.mark.usefixtures("checked")
def test_resized_input(make_graph, device):
    g, out, x, w = _captured(make_graph, device)
    g.replay()
    x.resize_(16, 8)
    _assert_refused(g, "resize_")


@pytest.mark.usefixtures("checked")
def test_resized_parameter(make_graph, device):
    g, out, x, w = _captured(make_graph, device)
    w.resize_(8, 2)
    _assert_refused(g, "resize_ of a captured-by-reference tensor")


@pytest.mark.usefixtures("checked")
def test_resized_back_after_its_memory_moved(make_graph, device):
    """Growing reallocates the storage: a native graph would read freed memory even once the
    shape is back, so the recorder refuses too."""
    g, out, x, w = _captured(make_graph, device)
    ptr = x.data_ptr()
    x.resize_(1024, 8)
    x.resize_(4, 8)
    if x.data_ptr() == ptr:
        pytest.skip("the allocator grew the storage in place")
    _assert_refused(g, "resize_ and back")


@pytest.mark.usefixtures("checked")
def test_restrided_input(make_graph, device):
    g, out, x, w = _captured(make_graph, device)
    x.as_strided_((4, 8), (1, 4))
    _assert_refused(g, "as_strided_")


@pytest.mark.usefixtures("checked")
def test_repointed_input_and_recovery(make_graph, device):
    g, out, x, w = _captured(make_graph, device)
    storage, offset, size, stride = x.untyped_storage(), x.storage_offset(), x.shape, x.stride()
    x.set_(torch.empty_like(x))
    _assert_refused(g, "set_")
    # Pointing the input back at its captured memory makes the graph usable again.
    x.set_(storage, offset, size, stride)
    fresh = randn(gen(5), 4, 8, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, _fn(fresh, w))


@pytest.mark.usefixtures("checked")
def test_input_replaced_through_data(make_graph, device):
    g, out, x, w = _captured(make_graph, device)
    x.data = randn(gen(6), 4, 8, device=device)
    _assert_refused(g, "assigning .data")


@pytest.mark.usefixtures("checked")
def test_copy_into_input_is_not_stale(make_graph, device):
    """The supported way to feed new data: copy_ into the static input."""
    g, out, x, w = _captured(make_graph, device)
    for r in range(2, 5):
        fresh = randn(gen(r), 4, 8, device=device)
        x.copy_(fresh)
        g.replay()
        assert_replay_matches(out, _fn(fresh, w))
