"""Upstream pool and memory tests (``test/test_cuda.py``): successive captures sharing (or not)
a pool, replay order within a shared pool, and the pool's figures before and after the graph
is deleted.

Adaptations: the process-wide ``torch.cuda.memory_stats()`` deltas become the graph pool's own
figures (``backend.pool_stats(handle)``), which the recorder keeps with the native caching
allocator's policy; CUDA's two one-element RNG seed/offset holders (two extra small blocks)
do not exist here; concurrent replays on two streams become replays one after the other.
"""

from __future__ import annotations

import gc

import pytest
import torch

import accel_graph
from accel_graph.testing import capture_stream

from ._common import COMPILED, total

SHARING = ("Don't share", "via pool()", "via graph_pool_handle()")

K_SMALL_SIZE = 1048576
K_SMALL_BUFFER = 2097152
K_LARGE_BUFFER = 20971520
K_MIN_LARGE_ALLOC = 10485760
K_ROUND_LARGE = 2097152


def _func_with_temps(t: torch.Tensor, val: float) -> torch.Tensor:
    x = t.clone() + val
    y = t.clone() + val
    return x + y


def _reserved(g: accel_graph.Graph, handles: list) -> int | None:
    """Reserved bytes of the distinct pools in ``handles`` (None where the backend cannot say)."""
    seen, out = set(), 0
    for h in handles:
        if h.id in seen:
            continue
        seen.add(h.id)
        st = g.backend.pool_stats(h)
        if st is None:
            return None
        out += st.reserved_bytes
    return out


@pytest.mark.parametrize("share_mem", SHARING)
def test_graph_two_successive(make_graph, device, share_mem):
    size = 1000
    g0, g1 = make_graph(), make_graph()
    a = torch.ones((size,), device=device)
    with capture_stream(g0):
        g0_pool = accel_graph.graph_pool_handle(device) if share_mem == "via graph_pool_handle()" else None
        g0.capture_begin(pool=g0_pool)
        b = a.clone()
        for _ in range(5):
            b = _func_with_temps(b, 1)
        g0.capture_end()

        g1_pool = g0.pool() if share_mem == "via pool()" else g0_pool
        g1.capture_begin(pool=g1_pool)
        for _ in range(5):
            b = _func_with_temps(b, 1)
        g1.capture_end()

    # mixes unrelated eager ops with replays
    c = a.clone()
    for _ in range(2):
        c = _func_with_temps(c, 3)
    g0.replay()
    for _ in range(2):
        c = _func_with_temps(c, 3)
    g1.replay()
    for _ in range(2):
        c = _func_with_temps(c, 3)

    assert total(b) == size * 3070
    assert total(c) == size * 442

    # Upstream compares the process's reserved bytes between the sharing modes: sharing saves
    # exactly one small segment. Here: the reserved bytes of the pools the two graphs use.
    reserved = _reserved(g0, [g0.pool(), g1.pool()])
    if reserved is None:
        pytest.skip(f"{g0.backend.name} reports no pool figures")
    expected = 2 * K_SMALL_BUFFER if share_mem == "Don't share" else K_SMALL_BUFFER
    assert reserved == expected, (share_mem, reserved)


@pytest.mark.parametrize("share_mem", SHARING)
def test_graph_concurrent_replay(make_graph, device, share_mem):
    """Adapted: the two replays run one after the other, so no mode may corrupt the other's
    results (upstream runs them concurrently on two streams and expects corruption when the
    pool is shared; concurrency is not something the recorder has)."""
    size = 100000
    g0, g1 = make_graph(), make_graph()
    a = torch.ones((size,), device=device)
    with capture_stream(g0):
        g0_pool = accel_graph.graph_pool_handle(device) if share_mem == "via graph_pool_handle()" else None
        g0.capture_begin(pool=g0_pool)
        b = a.clone()
        for _ in range(5):
            b = _func_with_temps(b, 1)
        g0.capture_end()

        g1_pool = g0.pool() if share_mem == "via pool()" else g0_pool
        g1.capture_begin(pool=g1_pool)
        c = a.clone()
        for _ in range(5):
            c = _func_with_temps(c, 2)
        g1.capture_end()

    g0.replay()
    g1.replay()
    assert total(b) == size * 94
    assert total(c) == size * 156


@pytest.mark.parametrize("share_mem", [
    pytest.param(m, marks=COMPILED) if m == "via pool()" else m for m in SHARING])
def test_graph_three_successive(make_graph, device, share_mem):
    size = 1000
    a = torch.ones((size,), device=device)
    g0, g1, g2 = make_graph(), make_graph(), make_graph()
    with capture_stream(g0):
        g0_pool = accel_graph.graph_pool_handle(device) if share_mem == "via graph_pool_handle()" else None
        g0.capture_begin(pool=g0_pool)
        b = a.clone()
        c = b + 1
        d = b + 2
        g0.capture_end()

        pool = g0.pool() if share_mem == "via pool()" else g0_pool
        g1.capture_begin(pool=pool)
        e = c + 3
        del c
        g1.capture_end()

        g2.capture_begin(pool=pool)
        f = d + 4
        g2.capture_end()

    # Replaying in capture order is valid.
    g0.replay()
    g1.replay()
    g2.replay()
    assert total(e) == size * 5
    assert total(f) == size * 7

    # g0, g2, g1 is valid only without a shared pool: g2's capture reused c's memory (c died
    # during g1's capture) for f, so g1's "e = c + 3" reads f's values.
    g0.replay()
    g2.replay()
    g1.replay()
    expect_corruption = share_mem != "Don't share"
    assert total(e) == (size * (7 + 3) if expect_corruption else size * 5)
    assert total(f) == size * 7


_CASES = (
    # numel, segments, reserved bytes after capture, reserved bytes once the graph is gone
    (512 // 4, 1, K_SMALL_BUFFER, K_SMALL_BUFFER),
    (K_SMALL_SIZE // 4, 2, 2 * K_SMALL_BUFFER, K_SMALL_BUFFER),
    ((K_SMALL_SIZE + 512) // 4, 1, K_LARGE_BUFFER, K_LARGE_BUFFER),
    ((K_MIN_LARGE_ALLOC - 512) // 4, 2, 2 * K_LARGE_BUFFER, K_LARGE_BUFFER),
    (
        (K_MIN_LARGE_ALLOC + 512) // 4,
        3,
        3 * (K_ROUND_LARGE * ((K_MIN_LARGE_ALLOC + 512 + K_ROUND_LARGE - 1) // K_ROUND_LARGE)),
        K_ROUND_LARGE * ((K_MIN_LARGE_ALLOC + 512 + K_ROUND_LARGE - 1) // K_ROUND_LARGE),
    ),
)


@pytest.mark.parametrize("numel,segments,reserved,reserved_post_del", _CASES,
                         ids=[str(c[0]) for c in _CASES])
def test_graph_memory_stats_and_use_result_after_destroy_graph(
    make_graph, device, numel, segments, reserved, reserved_post_del
):
    """The graph's pool holds what the native caching allocator would for each size class,
    and the graph's output stays valid (and alone in the pool) after the graph is deleted."""
    elem = 4
    a = torch.ones((numel,), device=device)
    g = make_graph()
    with capture_stream(g):
        g.capture_begin()
        b = a.clone()
        for _ in range(5):
            b = b.clone() + 1
        g.capture_end()
    gc.collect()
    handle = g.pool()
    stats = g.backend.pool_stats(handle)
    if stats is None:
        pytest.skip(f"{g.backend.name} reports no pool figures")
    backend = g.backend
    for i in range(2):  # checks replay and the figures before and after an empty_cache
        stats = backend.pool_stats(handle)
        assert (stats.segments, stats.reserved_bytes) == (segments, reserved), f"round {i}"
        assert stats.allocated_bytes == numel * elem, f"only b is live after capture (round {i})"
        g.replay()
        assert total(b) == 6 * numel
        if i == 0:
            backend.synchronize(g.device_spec)
            if hasattr(torch, device.type) and hasattr(getattr(torch, device.type), "empty_cache"):
                getattr(torch, device.type).empty_cache()

    del g
    gc.collect()
    # Uses the graph's result after the graph has been deleted.
    assert total(b) == 6 * numel
    post = backend.pool_stats(handle)
    if post is None:
        pytest.skip(f"{backend.name} forgets a pool's figures once no graph uses it")
    # b is the only live block left in the graph's pool.
    assert (post.segments, post.reserved_bytes, post.allocated_bytes) == (
        1, reserved_post_del, numel * elem)
    del a, b
