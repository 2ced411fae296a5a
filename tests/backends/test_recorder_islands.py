"""Eager islands on the recorder, interpreted replay (issue 26 items 1, 2, 5 and "Bad input").

``accel_graph.eager_island`` marks code that runs eagerly between captured pieces: the piece
before it runs once at capture so it sees real values, its outputs become static pool buffers,
and every replay runs piece, island, piece. Every result here is compared bitwise with eager.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from torch import nn

import accel_graph as ag
from accel_graph import eager_island
from accel_graph.backends.capture_common import hostreads, islands
from accel_graph.errors import CaptureError, ReplayError


# -- an MoE block whose router reads values on the host -------------------------------------
class SparseMoE(nn.Module):
    """Top-1 routing with the eager-experts pattern of transformers' Mixtral block: the
    router's choice is read on the host (``nonzero``, ``.item()``, a Python ``if``)."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = self.gate(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(top == e).flatten()
            if rows.numel() == 0:  # a Python if on a value
                continue
            out.index_add_(0, rows, expert(h[rows]) * probs[rows, e : e + 1])
        if out.abs().max().item() > 1e6:
            raise RuntimeError("diverged")
        return out


class Decoderish(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = SparseMoE(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.moe(h))


def _capture(fn, *args, compile=None):
    g = ag.Graph(device="cpu", compile=compile)
    with ag.graph(g):
        out = fn(*args)
    return g, out


def _dump(g: ag.Graph, tmp_path) -> dict:
    path = str(tmp_path / "g.dot")
    g.debug_dump(path)
    with open(path + ".json") as f:
        return json.load(f)


# -- capture alone refuses the router; as an island it replays bitwise ---------------------
def test_router_alone_is_refused_by_capture() -> None:
    torch.manual_seed(0)
    model = Decoderish()
    x = torch.randn(6, 8)
    g = ag.Graph(device="cpu")
    with torch.no_grad(), pytest.raises(CaptureError):
        with ag.graph(g):
            model(x)


def test_module_island_bitwise_across_replays(tmp_path) -> None:
    torch.manual_seed(0)
    model = Decoderish()
    assert eager_island(model.moe) is model.moe
    assert islands.capture_runner() is None
    x = torch.randn(6, 8)
    with torch.no_grad():
        expect = model(x)
        g, out = _capture(model, x)
        g.replay()
        assert torch.equal(out, expect)
        for seed in range(1, 5):  # other routings: other experts, other row counts
            torch.manual_seed(seed)
            x.copy_(torch.randn(6, 8) * seed)
            expect = model(x)
            g.replay()
            assert torch.equal(out, expect), seed
    desc = _dump(g, tmp_path)
    hosts = [op for op in desc["ops"] if op["kind"] == "host"]
    assert len(hosts) == 1 and "eager_island SparseMoE.forward" in hosts[0]["op"]
    assert "test_recorder_islands.py:" in hosts[0]["op"]
    assert not hostreads.installed()


def test_function_island_decorator_and_inference_mode() -> None:
    w = torch.randn(8, 8)

    @eager_island
    def route(h: torch.Tensor) -> torch.Tensor:
        k = int((h > 0).sum().item())
        idx = torch.nonzero(h.flatten() > 0).flatten()
        y = h.clone()
        if k > 16:
            y = y * 2
        y.view(-1)[idx] += float(len(h.tolist()))  # a host read the capture would refuse
        return y

    assert route.__name__ == "route" and route.__wrapped__ is not None

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(route(x @ w)) + 1

    x = torch.randn(4, 8)
    with torch.inference_mode():
        expect = step(x)
        g, out = _capture(step, x)
        g.replay()
        assert torch.equal(out, expect)
        for _ in range(4):
            x.copy_(torch.randn(4, 8))
            g.replay()
            assert torch.equal(out, step(x))


def test_two_islands_and_nested_island(tmp_path) -> None:
    @eager_island
    def inner(t: torch.Tensor) -> torch.Tensor:
        return t[t > 0].sum().reshape(1) + t

    @eager_island
    def outer(t: torch.Tensor) -> tuple[torch.Tensor, None]:
        return inner(t) * 3, None  # nested: a plain call inside the outer island

    @eager_island
    def second(t: torch.Tensor) -> dict[str, torch.Tensor]:
        n = int((t > 1).sum())
        return {"a": t + n, "b": t.max().reshape(1)}

    def f(x: torch.Tensor) -> torch.Tensor:
        a, none = outer(x * 2)
        assert none is None
        d = second(a - 1)
        return d["a"] * d["b"]

    x = torch.randn(5)
    expect = f(x)
    g, out = _capture(f, x)
    g.replay()
    assert torch.equal(out, expect)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(5))
        g.replay()
        assert torch.equal(out, f(x))
    desc = _dump(g, tmp_path)
    assert len(desc["outputs"]) == 1  # the island buffers the caller dropped are no outputs
    hosts = [op["op"] for op in desc["ops"] if op["kind"] == "host"]
    assert len(hosts) == 2  # the nested island is no step of its own
    assert "outer" in hosts[0] and "second" in hosts[1]
    assert "eager_island" in (tmp_path / "g.dot").read_text()


def test_island_writes_a_captured_kv_cache_in_place() -> None:
    """The island writes a tensor captured by reference at a position it reads on the host;
    the writes happen in place at every replay, as in eager."""

    @eager_island
    def attend(k: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        p = int(pos.item())
        cache[p] = k[0]
        return cache[: p + 1].sum(0, keepdim=True)  # a data-dependent slice, fixed-shape result

    def step(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return attend(x * 2, pos, cache) + 1

    x, pos = torch.randn(1, 4), torch.tensor([0])
    cache, ref_cache = torch.zeros(8, 4), torch.zeros(8, 4)
    expect = step(x, pos, ref_cache)  # the warm-up capture makes at position 0
    g, out = _capture(step, x, pos, cache)
    assert torch.equal(cache, ref_cache)  # the island ran once at capture, as a warm-up
    for p in range(1, 6):
        x.copy_(torch.randn(1, 4))
        pos.fill_(p)
        expect = step(x, pos, ref_cache)
        g.replay()
        assert torch.equal(out, expect)
        assert torch.equal(cache, ref_cache)


def test_island_draws_random_numbers_at_replay_as_eager() -> None:
    @eager_island
    def noise(t: torch.Tensor) -> torch.Tensor:
        return t + torch.rand(t.shape)

    x = torch.ones(3)
    g, out = _capture(lambda t: noise(t * 2), x)
    torch.manual_seed(7)
    g.replay()
    torch.manual_seed(7)
    assert torch.equal(out, noise(x * 2))
    first = out.clone()
    g.replay()
    assert not torch.equal(out, first)


# -- outside a capture: a plain call ---------------------------------------------------------
def test_outside_capture_plain_call_and_marking() -> None:
    calls = []

    def fn(a, *, b=1):
        calls.append((a, b))
        if a == "boom":
            raise KeyError(a)
        return [a, b]

    island = eager_island(fn)
    assert island("x", b=2) == ["x", 2] and calls == [("x", 2)]
    with pytest.raises(KeyError):
        island("boom")
    assert eager_island(island) is island  # marking twice is harmless
    with pytest.raises(TypeError, match="nn.Module instance"):
        eager_island(nn.Linear)
    with pytest.raises(TypeError):
        eager_island(3)

    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    expect = lin(x)
    assert eager_island(lin) is lin and eager_island(lin) is lin
    assert torch.equal(lin(x), expect)
    twin = copy.deepcopy(lin)  # the copy's forward is the copy's, not the original's
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert torch.equal(twin(x), torch.zeros(2, 3)) and torch.equal(lin(x), expect)
    back = pickle.loads(pickle.dumps(lin))
    assert torch.equal(back(x), expect)


# -- bad input -----------------------------------------------------------------------------------
def test_replay_output_shape_or_dtype_change_is_a_replay_error() -> None:
    state = {"dtype": torch.float32}

    @eager_island
    def keep_positive(t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return t[: int(n.item())].to(state["dtype"], copy=True)

    after = torch.zeros(3)

    def step(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        y = keep_positive(x + 1, n)
        after.copy_(y * 2)  # a write after the island, into a captured tensor
        return y

    x, n = torch.randn(5), torch.tensor(3)
    g, out = _capture(step, x, n)
    g.replay()
    good = after.clone()
    assert torch.equal(good, (x + 1)[:3] * 2)
    n.fill_(4)
    x.copy_(torch.randn(5))
    with pytest.raises(ReplayError) as info:
        g.replay()
    msg = str(info.value)
    assert "keep_positive" in msg and "test_recorder_islands.py:" in msg
    assert "shape (4,)" in msg and "shape (3,)" in msg
    assert torch.equal(after, good)  # nothing after the island ran
    n.fill_(3)
    g.replay()  # the next valid replay works
    assert torch.equal(after, (x + 1)[:3] * 2) and torch.equal(out, (x + 1)[:3])
    state["dtype"] = torch.float64
    with pytest.raises(ReplayError, match="torch.float64"):
        g.replay()
    state["dtype"] = torch.float32
    g.replay()
    assert torch.equal(out, (x + 1)[:3])


def test_replay_structure_change_is_a_replay_error() -> None:
    state = {"second": False}

    @eager_island
    def pair(t: torch.Tensor):
        return t * 2, (t + 1 if state["second"] else None)

    g, (a, b) = _capture(pair, torch.ones(2))
    assert b is None
    state["second"] = True
    with pytest.raises(ReplayError, match="returned None at capture"):
        g.replay()
    state["second"] = False
    g.replay()
    assert torch.equal(a, torch.full((2,), 2.0))


@pytest.mark.parametrize("value", [7, 2.5, "text"])
def test_non_tensor_output_is_a_capture_error(value) -> None:
    @eager_island
    def bad(t: torch.Tensor):
        return t + 1, value

    g = ag.Graph(device="cpu")
    with pytest.raises(CaptureError) as info:
        with ag.graph(g):
            bad(torch.ones(2) * 3)
    assert repr(value) in str(info.value) and "bad" in str(info.value)
    with ag.graph(g):  # the capture was dropped: the graph captures again
        y = torch.ones(2) * 3
    g.replay()
    assert torch.equal(y, torch.full((2,), 3.0))


def test_island_with_another_device_is_a_capture_error() -> None:
    @eager_island
    def ident(t: torch.Tensor) -> torch.Tensor:
        return t.sum().reshape(1)

    g = ag.Graph(device="cpu")
    on_meta = torch.ones(2, device="meta")
    with pytest.raises(CaptureError, match="tensor on meta"):
        with ag.graph(g):
            ident(on_meta)

    @eager_island
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(2, device="meta")

    with pytest.raises(CaptureError, match="output 0 on meta"):
        with ag.graph(g):
            to_meta(torch.ones(2) + 1)


def test_output_sharing_an_argument_is_a_capture_error() -> None:
    @eager_island
    def same(t: torch.Tensor) -> torch.Tensor:
        return t[:1]

    with pytest.raises(CaptureError, match="sharing memory"):
        _capture(lambda x: same(x * 2), torch.ones(3))
    cache = torch.zeros(3)
    with pytest.raises(CaptureError, match="sharing memory"):
        _capture(lambda x: same(cache) + x, torch.ones(3))


def test_output_needing_grad_is_a_capture_error() -> None:
    lin = eager_island(nn.Linear(2, 2))
    with pytest.raises(CaptureError, match="requires grad"):
        _capture(lambda x: lin(x * 2), torch.ones(1, 2))
    with torch.no_grad():
        g, out = _capture(lambda x: lin(x * 2), torch.ones(1, 2))
        g.replay()
        assert torch.equal(out, lin(torch.ones(1, 2) * 2))


def test_island_inside_cond_or_while_loop_is_refused() -> None:
    @eager_island
    def isl(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    x = torch.ones(2)
    with pytest.raises(CaptureError, match="torch.cond branch"):
        _capture(lambda t: torch.cond(t.sum() > 0, lambda a: isl(a), lambda a: a * 2, (t,)), x)
    with pytest.raises(CaptureError, match="while_loop body"):
        _capture(lambda t: torch.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, isl(a)),
                                            (torch.tensor(0), t)), x)


def test_island_in_make_graphed_callables_is_refused() -> None:
    lin = nn.Linear(2, 2)
    isl = eager_island(nn.Linear(2, 2))
    model = nn.Sequential(lin, isl)
    with pytest.raises(CaptureError, match="make_graphed_callables"):
        ag.make_graphed_callables(model, (torch.randn(3, 2, requires_grad=True),))


# -- memory -----------------------------------------------------------------------------------
def test_pool_memory_counts_buffers_not_island_temporaries() -> None:
    @eager_island
    def big_temp(t: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(1 << 22)  # 16 MiB of the island's own, outside the pool
        return t + scratch[: t.numel()].reshape(t.shape)

    x = torch.randn(16, 16)
    g, out = _capture(lambda t: big_temp(t * 2) * 3, x)
    plain, _ = _capture(lambda t: (t * 2 + 1) * 3, x)  # the same allocations, no island
    mem = g.memory_bytes()
    assert out.nbytes <= mem == plain.memory_bytes() < (1 << 24)
    assert g.standalone_bytes() == plain.standalone_bytes()
    for _ in range(3):
        g.replay()
    assert g.memory_bytes() == mem
    assert torch.equal(out, big_temp(x * 2) * 3)


# -- compiled replay: each piece an Inductor stretch, the island a host step between --------
def test_compiled_pieces_equal_interpreted_with_a_kv_cache() -> None:
    from accel_graph.foundation.tolerances import assert_close_for_dtype

    torch.manual_seed(0)
    model = Decoderish()
    eager_island(model.moe)

    @eager_island
    def attend(k: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        p = int(pos.item())
        cache[p] = k[0]
        return cache[: p + 1].mean(0, keepdim=True)

    def step(x, pos, cache):
        h = model(x)
        return torch.sigmoid(attend(h, pos, cache) + h)

    x, pos = torch.randn(6, 8), torch.tensor([0])
    caches = {mode: torch.zeros(8, 8) for mode in ("interpreted", "compiled")}
    with torch.no_grad():
        gi, out_i = _capture(step, x, pos, caches["interpreted"])
        gc, out_c = _capture(step, x, pos, caches["compiled"], compile="inductor")
        for p in range(1, 5):
            torch.manual_seed(p)
            x.copy_(torch.randn(6, 8) * p)
            pos.fill_(p)
            ref_cache = caches["interpreted"].clone()
            expect = step(x, pos, ref_cache)
            gi.replay()
            gc.replay()
            assert torch.equal(out_i, expect) and torch.equal(caches["interpreted"], ref_cache)
            assert_close_for_dtype(out_c, out_i)
            assert_close_for_dtype(caches["compiled"], caches["interpreted"])
    info = gc.compile_info()
    assert "fallback" not in info, info
    # Three pieces around two islands, each a compiled stretch: island buffers are not reused
    # within the capture, so no stretch writes where it reads an island's output.
    assert info["host_steps"] == 2 and info["stretches"] == 3, info
    assert info["interpreted_stretches"] == []


def test_compiled_island_replay_error_is_no_compile_failure() -> None:
    @eager_island
    def head(t: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return t[: int(n.item())] * 2

    after = torch.zeros(2)

    def step(x, n):
        y = head(torch.cos(x), n)
        after.copy_(torch.sin(y))
        return y

    x, n = torch.randn(4), torch.tensor(2)
    g, out = _capture(step, x, n, compile="inductor")
    n.fill_(3)
    with pytest.raises(ReplayError, match="head"):
        g.replay()  # the compiled program's first run: the island's error is the caller's
    assert torch.equal(after, torch.zeros(2))
    n.fill_(2)
    g.replay()
    assert "fallback" not in g.compile_info()
    torch.testing.assert_close(after, torch.sin(torch.cos(x)[:2] * 2))


# -- the edges: capturing state seen inside an island, other threads, a capture that is over --
def test_island_sees_no_capture_and_other_threads_run_plainly() -> None:
    import threading

    seen = []

    @eager_island
    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(ag.is_current_stream_capturing())
        return t * 2

    x = torch.ones(2)
    results = []
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        assert ag.is_current_stream_capturing()
        y = probe(x + 1)
        worker = threading.Thread(target=lambda: results.append(probe(x)))
        worker.start()
        worker.join()
        assert ag.is_current_stream_capturing()
    assert seen == [False, False]  # in the island at capture, and on the other thread
    assert torch.equal(results[0], x * 2)  # the other thread called it plainly
    g.replay()
    assert seen == [False, False, False] and torch.equal(y, (x + 1) * 2)


def test_island_after_an_invalidated_capture_is_a_plain_call() -> None:
    calls = []

    @eager_island
    def count(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t + 1

    g = ag.Graph(device="cpu")
    g.capture_begin()
    x = torch.ones(3)
    with pytest.raises(CaptureError):
        (x * 2).sum().item()
    out = count(x)  # the capture is over: real values, nothing recorded
    assert torch.equal(out, x + 1) and calls == [1]
    with pytest.raises(CaptureError, match="invalidated"):
        g.capture_end()
    assert islands.capture_runner() is None


def test_check_capturable_lets_islands_through() -> None:
    """check_capturable runs an island as a capture would (eagerly): its host reads and
    data-dependent ops are no findings, and nothing inside it counts as baked."""
    torch.manual_seed(0)
    model = Decoderish()
    x = torch.randn(6, 8)
    assert not ag.check_capturable(model, x)  # the router alone: refused ops
    eager_island(model.moe)
    report = ag.check_capturable(model, x)
    assert report.ok, report.format()
    assert islands.capture_runner() is None  # nothing left installed

    def outside(t: torch.Tensor) -> torch.Tensor:
        return model(t)[t > 0]  # still flagged outside the island

    assert not ag.check_capturable(outside, x)
