"""Leaks (issue 14 item 4): pool handles are held weakly, and identical programs share one
compiled module. Entries are counted, not RSS (``tools/soak.py`` measures RSS)."""

from __future__ import annotations

import copy
import gc
import linecache

import pytest
import torch

import accel_graph as ag
from accel_graph.backends import get_backend
from accel_graph.backends.recorder.compiled import inductor as compiled
from accel_graph.foundation.tolerances import assert_bitwise_equal, assert_close_for_dtype

HANDLES = 10_000


def _recorder():  # noqa: ANN202 - the concrete backend class is not public
    return get_backend("recorder")


def test_dropped_pool_handles_are_not_kept() -> None:
    backend = _recorder()
    before = len(backend._handles)
    for _ in range(HANDLES):
        ag.graph_pool_handle("cpu")
    # Dropped handles go by reference counting alone: no collection needed.
    assert len(backend._handles) <= before + 1, f"{len(backend._handles) - before} handles kept"
    assert backend.tracked_handles() == len(backend._handles)


def test_a_held_handle_stays_valid_among_dropped_ones() -> None:
    h = ag.graph_pool_handle("cpu")
    for _ in range(1000):
        ag.graph_pool_handle("cpu")
    gc.collect()
    x = torch.randn(8)
    g1, g2 = ag.Graph(device="cpu", pool=h), ag.Graph(device="cpu", pool=h)
    with ag.graph(g1):
        y1 = x * 2
    with ag.graph(g2):
        y2 = x + 1
    g1.replay()
    g2.replay()
    assert_bitwise_equal(y1, x * 2)
    assert_bitwise_equal(y2, x + 1)
    stats = _recorder().pool_stats(h)
    assert stats is not None and stats.graphs == 2


def test_a_pool_with_graphs_outlives_its_dropped_handle() -> None:
    x = torch.randn(8)
    g1 = ag.Graph(device="cpu", pool=ag.graph_pool_handle("cpu"))
    with ag.graph(g1):
        y1 = x * 3
    gc.collect()
    g2 = ag.Graph(device="cpu", pool=g1.pool())  # the graph still names its pool
    with ag.graph(g2):
        y2 = y1 - 1
    g1.replay()
    g2.replay()
    assert_bitwise_equal(y2, x * 3 - 1)
    stats = _recorder().pool_stats(g1.pool())
    assert stats is not None and stats.graphs == 2


def test_a_copied_handle_is_the_handle() -> None:
    h = ag.graph_pool_handle("cpu")
    assert copy.copy(h) is h and copy.deepcopy({"pool": h})["pool"] is h
    kept = copy.deepcopy([h])
    del h
    gc.collect()
    g = ag.Graph(device="cpu", pool=kept[0])  # still known: the copy is the original
    with ag.graph(g):
        torch.ones(2) * 2


def test_a_forged_handle_is_still_refused() -> None:
    h = ag.graph_pool_handle("cpu")
    forged = type(h)("recorder", h.device, (0, h.id[1] + 10**9))
    with pytest.raises(ag.PoolError, match="belongs to no pool"):
        ag.Graph(device="cpu", pool=forged)


def test_native_handles_register_nothing_until_captured(fake_cuda) -> None:  # noqa: ANN001
    """The native table has no such leak: a handle is registered only while a graph holds it."""
    backend = get_backend("cuda")
    for _ in range(HANDLES // 10):
        ag.graph_pool_handle("cuda:0")
    assert backend.pools.held() == {}


# -- compiled replay: one module per program ---------------------------------------------------

def _capture(fn, *args: torch.Tensor):  # noqa: ANN001, ANN202
    g = ag.Graph(device="cpu", compile="inductor")
    with ag.graph(g):
        out = fn(*args)
    g.replay()
    return g, out


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close_for_dtype(out, expected)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Inductor runs, counted at ``compile_fx`` itself; an empty module cache before and after."""
    import torch._inductor.compile_fx as cfx

    real = cfx.compile_fx
    calls: list[int] = []

    def counting(gm, example, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        return real(gm, example, *args, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", counting)
    compiled.clear_compile_cache()
    yield calls
    compiled.clear_compile_cache()


@pytest.mark.slow
def test_identical_programs_compile_once(compiles: list[int]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2 + 1

    x1, x2 = torch.randn(16, 16), torch.randn(16, 16)
    g1, y1 = _capture(f, x1)
    g1_info = g1._impl._compiled
    if g1_info.get("fallback"):
        pytest.skip(f"Inductor cannot compile here: {g1_info['fallback']}")
    _check(y1, f(x1))
    g1.reset()
    g2, y2 = _capture(f, x2)  # same ops, shapes, strides, dtypes, constants: reused
    _check(y2, f(x2))
    x2.copy_(torch.randn(16, 16))
    g2.replay()
    _check(y2, f(x2))
    assert len(compiles) == 1, f"{len(compiles)} compilations of one program"
    info = compiled.compile_cache_info()
    assert info["compiles"] == 1 and info["hits"] == 1, info
    assert g2._impl._compiled["cache"] == "hit"

    # A reused module costs the capture nothing that stays: no generated source is kept
    # (torch.fx keeps every GraphModule's source in linecache, ~0.8 KB each).
    lines = len(linecache.cache)
    for _ in range(5):
        _capture(f, x1)[0].reset()
    assert len(linecache.cache) == lines, "sources kept per capture of a cached program"
    assert len(compiles) == 1

    # A different constant, a different shape: different programs, compiled again.
    g3, y3 = _capture(lambda x: torch.tanh(x) * 2 + 2, x1)
    _check(y3, torch.tanh(x1) * 2 + 2)
    g4, _ = _capture(f, torch.randn(4, 16))
    assert len(compiles) == 3
    # g1 (reset) and g2 share nothing at run time: g2's module writes only g2's tensors.
    g2.replay()
    _check(y2, f(x2))


@pytest.mark.slow
def test_aliasing_inputs_are_a_different_program(compiles: list[int]) -> None:
    """The same graph text with inputs that share a storage is a different program: AOT
    autograd writes mutations back according to how the inputs alias."""

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * b

    a, b = torch.randn(4), torch.randn(4)
    g1, y1 = _capture(f, a, b)
    if g1._impl._compiled.get("fallback"):
        pytest.skip("Inductor cannot compile here")
    base = torch.randn(8)
    a2, b2 = base[:4], base[4:]
    a2_before = a2.clone()  # capture runs nothing; the one replay adds 1
    g2, y2 = _capture(f, a2, b2)
    assert len(compiles) == 2
    _check(a2, a2_before + 1)
    _check(y2, (a2_before + 1) * b2)
    _check(y1, a * b)


def test_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LRU drops the oldest module beyond COMPILE_CACHE_SIZE (no Inductor: a stub compiler)."""
    import torch._inductor.compile_fx as cfx

    calls: list[int] = []

    def fake_compile_fx(gm, example):  # noqa: ANN001, ANN202
        calls.append(1)
        return lambda *args: None

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    monkeypatch.setattr(compiled, "COMPILE_CACHE_SIZE", 3)
    compiled.clear_compile_cache()
    x = torch.randn(4)
    graphs = []
    for c in range(5):
        g = ag.Graph(device="cpu", compile="inductor")
        with ag.graph(g):
            x * float(c)
        graphs.append(g)
    assert len(calls) == 5 and compiled.compile_cache_info()["size"] == 3
    g = ag.Graph(device="cpu", compile="inductor")
    with ag.graph(g):
        x * 4.0  # the most recent: still cached
    assert len(calls) == 5
    g = ag.Graph(device="cpu", compile="inductor")
    with ag.graph(g):
        x * 0.0  # evicted: compiled again
    assert len(calls) == 6
    compiled.clear_compile_cache()
