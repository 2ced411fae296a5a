"""Upstream capture/replay basics (``test/test_cuda.py``): capturing state, simple captures, the
``torch.accelerator.Graph`` context-manager form, reset and recapture, ``keep_graph`` and
``instantiate()``, the empty-graph warning, out-of-memory and illegal ops inside a capture.

Stream handling is the one systematic change: where upstream makes a side stream current
(``with torch.cuda.stream(s):``) these tests use :func:`accel_graph.testing.capture_stream`,
which does the same on CUDA/HIP and nothing on the recorder. See ``__init__.py`` for the list.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import accel_graph
from accel_graph import CaptureError
from accel_graph.testing import capture_stream

from ._common import COMPILED, is_native, total


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")  # captures nothing
def test_graph_is_current_stream_capturing(make_graph, device):
    assert not accel_graph.is_current_stream_capturing(device)
    g = make_graph()
    with capture_stream(g):
        assert not accel_graph.is_current_stream_capturing(device)
        g.capture_begin()
        assert accel_graph.is_current_stream_capturing(device)
        g.capture_end()
    assert not accel_graph.is_current_stream_capturing(device)


def test_graph_capture_simple(make_graph, device):
    g = make_graph()
    with capture_stream(g):
        a = torch.full((1000,), 1, device=device)
        g.capture_begin()
        b = a
        for _ in range(10):
            b = b + 1
        g.capture_end()
    g.replay()
    assert total(b) == 11000.0


@COMPILED
def test_accelerator_graph_simple(make_graph, device):
    """``with s, g:``: the graph is its own context manager and captures on the current
    stream; the factory inside the block is captured too."""
    g = make_graph()
    assert not accel_graph.is_current_stream_capturing(device)
    with capture_stream(g), g:
        a = torch.full((1000,), 1, device=device)
        b = a
        assert accel_graph.is_current_stream_capturing(device)
        for _ in range(10):
            b = b + 1
    assert not accel_graph.is_current_stream_capturing(device)
    g.replay()
    assert total(b) == 11000.0


def test_graph_capture_reset_recapture(make_graph, device):
    g = make_graph()
    with capture_stream(g):
        a = torch.full((1000,), 1, device=device)
        g.capture_begin()
        b = a
        for _ in range(10):
            b = b + 1
        g.capture_end()
    g.replay()
    assert total(b) == 11000.0

    g.reset()
    with capture_stream(g):
        g.capture_begin()
        b.fill_(2.0)  # b is the first capture's output: it outlives that graph's reset
        for _ in range(10):
            b = b + 2
        g.capture_end()
    g.replay()
    assert total(b) == 22000.0
    g.reset()
    del g


def test_graph_debugdump(make_graph, device, tmp_path):
    # Upstream forks part of the work onto a second stream inside the capture; the recorder
    # has one stream per thread, so the dump covers the single-stream part.
    x = torch.randn(10240, device=device)
    y = torch.rand_like(x)
    g = make_graph()
    g.enable_debug_mode()
    with capture_stream(g):
        g.capture_begin()
        z = x + y
        z + y
        g.capture_end()
    path = tmp_path / "out_multi_stream.dot"
    g.debug_dump(str(path))
    assert path.exists() and path.stat().st_size > 0


_DEFAULT_STREAM_SCRIPT = """
import sys, accel_graph
from accel_graph import CaptureError
g = accel_graph.Graph(device={device!r})
try:
    g.capture_begin()
except CaptureError as e:
    sys.exit(0 if "non-default stream" in str(e) else 1)
sys.exit(2)
"""


def test_graph_error(make_graph, device):
    """Capture on the default stream is refused on CUDA (in a subprocess, as upstream: the
    refused capture can leave the context unusable)."""
    g = make_graph()
    if not is_native(g) or g.backend.name != "cuda":
        pytest.skip(f"{g.backend.name}: only CUDA refuses capture on the default stream "
                    f"(the recorder has no streams; capture belongs to the calling thread)")
    script = textwrap.dedent(_DEFAULT_STREAM_SCRIPT.format(device=str(device)))
    rc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert rc.returncode != 1, f"wrong error for capture on the default stream: {rc.stderr}"
    assert rc.returncode != 2, "capture on the default stream was not refused"
    assert rc.returncode == 0, rc.stderr


def test_graph_warn_if_has_zero_nodes(make_graph, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = make_graph()
        with capture_stream(g):
            g.capture_begin()
            g.capture_end()
    assert any("The CUDA Graph is empty" in str(w.message) for w in caught), [
        str(w.message) for w in caught
    ]
    assert any(issubclass(w.category, UserWarning) for w in caught)


def test_graph_capture_oom(make_graph, device):
    with pytest.raises(RuntimeError, match="out of memory"):
        with accel_graph.graph(make_graph()):
            torch.zeros(2**40, device=device)


def test_cuda_graph_raw_graph_keep_graph_false(make_graph, device):
    """The ``instantiate()`` half; the raw ``cudaGraph_t`` half is left out (no such object)."""
    g = make_graph(keep_graph=False)
    x = torch.zeros([2000], device=device)
    y = torch.ones([2000], device=device)
    with accel_graph.graph(g, capture_error_mode="relaxed"):
        z = x + y
    with pytest.raises(
        RuntimeError,
        match=r"instantiate\(\) is intended to be called by the user only when keep_graph=true",
    ):
        g.instantiate()
    g.replay()  # the refusal lost nothing
    assert torch.equal(z, x + y)


def test_cuda_graph_raw_graph_reset_and_recapture(make_graph, device):
    g = make_graph(keep_graph=True)
    x = torch.zeros([2000], device=device)
    with accel_graph.graph(g, capture_error_mode="relaxed"):
        x += 1.0
    g.instantiate()
    g.replay()
    assert bool(torch.all(x == 1.0))
    g.instantiate()  # instantiating twice is allowed with keep_graph=True
    g.replay()
    assert bool(torch.all(x == 2.0))
    g.replay()
    assert bool(torch.all(x == 3.0))

    g.reset()
    # A new tensor, not x[:] = 0: the new capture must run on a new address.
    x = torch.zeros([2000], device=device)
    with accel_graph.graph(g, capture_error_mode="relaxed"):
        x += 2.0
    g.instantiate()
    g.replay()
    assert bool(torch.all(x == 2.0))
    g.instantiate()
    g.replay()
    assert bool(torch.all(x == 4.0))
    g.replay()
    assert bool(torch.all(x == 6.0))


def _item_inside(a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    idx = perm[0]
    a[0] *= b[idx]  # indexing with a 0-dim tensor reads its value on the host: illegal
    return a


_ITEM_SCRIPT = """
import torch, accel_graph
def f(a, b, perm):
    idx = perm[0]
    a[0] *= b[idx]
    return a
a = torch.rand(500, 500, device={device!r})
b = torch.rand(500, 500, device={device!r})
perm = torch.randint(0, 500, (500,), device={device!r})
g = accel_graph.Graph(device={device!r})
with accel_graph.graph(g):
    f(a, b, perm)
"""


def test_cuda_graph_tensor_item_not_allowed(make_graph, device):
    g = make_graph()
    if is_native(g):
        # As upstream: in a subprocess, since the failed capture can poison the context.
        script = textwrap.dedent(_ITEM_SCRIPT.format(device=str(device)))
        rc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert rc.returncode != 0
        assert "synchronize" in rc.stderr or "capture" in rc.stderr, rc.stderr
        return
    a = torch.rand(500, 500, device=device)
    b = torch.rand(500, 500, device=device)
    perm = torch.randint(0, 500, (500,), device=device)
    before = a.clone()
    with pytest.raises(CaptureError, match=r"item|_local_scalar_dense"):
        with accel_graph.graph(g):
            _item_inside(a, b, perm)
    assert g.state == "empty"
    assert torch.equal(a, before), "a refused capture must not have run the body's writes"
