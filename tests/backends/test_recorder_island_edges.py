"""Eager islands at the edges a new-user review found (2026-12-05): outputs that share memory
with each other or with a tensor the island holds (silent wrong results before: the caller got
static copies, so writes through one output missed the other), an island with no tensor
outputs (every replay raised an internal TypeError), and an island's own exception at the first
compiled replay (taken for a compile failure: the graph fell back to interpreted for good)."""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph.errors import CaptureError

_GLOBAL = torch.arange(3.0)


def test_outputs_sharing_memory_are_refused_and_the_graph_stays_usable() -> None:
    @accel_graph.eager_island
    def twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x + 1
        return y, y[0]

    g = accel_graph.Graph(device="cpu")
    with pytest.raises(CaptureError, match=r"twice.* returned outputs 0 and 1 sharing memory"):
        with torch.no_grad(), accel_graph.graph(g):
            twice(torch.ones(3))
    assert g.state == "empty"
    with torch.no_grad(), accel_graph.graph(g):
        out = accel_graph.eager_island(lambda x: (x + 1, x + 2))(torch.ones(3))
    g.replay()
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.full((3,), 3.0))


class _Acc(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.add_(x)
        return self.state  # the caller may write through it: it must be the buffer itself


def test_an_island_returning_its_module_buffer_is_refused() -> None:
    acc = accel_graph.eager_island(_Acc())
    g = accel_graph.Graph(device="cpu")
    with pytest.raises(CaptureError, match=r"_Acc.forward.* a tensor the island holds"):
        with torch.no_grad(), accel_graph.graph(g):
            acc(torch.ones(3)).add_(10)
    assert g.state == "empty"


def test_an_island_returning_a_global_or_closure_tensor_is_refused() -> None:
    @accel_graph.eager_island
    def from_global(x: torch.Tensor) -> torch.Tensor:
        return _GLOBAL

    kept = torch.ones(2)

    @accel_graph.eager_island
    def from_closure(x: torch.Tensor) -> torch.Tensor:
        return kept[:1]

    for island in (from_global, from_closure):
        g = accel_graph.Graph(device="cpu")
        with pytest.raises(CaptureError, match=r"a tensor the island holds"):
            with torch.no_grad(), accel_graph.graph(g):
                island(torch.ones(1))


@pytest.mark.parametrize("compile_", [None, "inductor"])
def test_an_island_with_no_tensor_outputs_replays(compile_: str | None) -> None:
    cache = torch.zeros(4)

    @accel_graph.eager_island
    def write_cache(x: torch.Tensor) -> None:
        cache.add_(x)  # in place only; returns None

    g = accel_graph.Graph(device="cpu", compile=compile_,
                          compile_options={"replay": "compiled"} if compile_ else None)
    x = torch.ones(4)
    with torch.no_grad(), accel_graph.graph(g):
        write_cache(x * 2)
        out = cache + 1
    assert torch.equal(cache, torch.full((4,), 2.0))  # capture ran the piece and the island once
    for n in (2, 3):
        x.fill_(n)
        before = cache.clone()
        g.replay()
        assert torch.equal(cache, before + 2 * n) and torch.equal(out, cache + 1)


def test_an_islands_own_error_at_the_first_compiled_replay_propagates_without_fallback() -> None:
    fail = {"on": False}

    @accel_graph.eager_island
    def route(x: torch.Tensor) -> torch.Tensor:
        if fail["on"]:
            raise ValueError("bad token id from the router")
        return x * 2

    x = torch.ones(3)
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with torch.no_grad(), accel_graph.graph(g):
        out = route(x + 1).sin() + 1
    fail["on"] = True
    with pytest.raises(ValueError, match="bad token id"):
        g.replay()
    fail["on"] = False
    x.fill_(2)
    g.replay()
    assert torch.allclose(out, ((x + 1) * 2).sin() + 1)
    assert g.replay_mode().mode == "compiled"
    assert "fallback" not in (g.compile_info() or {})
