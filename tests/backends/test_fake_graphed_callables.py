"""``make_graphed_callables`` routing against FAKE vendor modules: plumbing only.

On native backends the call goes to the vendor module's own ``make_graphed_callables`` with the
caller's arguments and a torch pool id for ``pool=``. Nothing here runs on a GPU; whether
torch's function behaves on hardware is for tools/device_check.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accel_graph
from accel_graph import ConfigError

from .fakes import FakeCudaModule, FakeXpuModule


class Spy:
    """Stands in for torch.<vendor>.make_graphed_callables and records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        return "torch's graphed callables"


def _fn() -> torch.Tensor:
    return torch.ones(1)


@pytest.fixture(params=["cuda", "hip", "xpu"])
def vendor(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
           native_registry: None) -> tuple[str, Spy]:
    """A fake vendor build whose module has a spied make_graphed_callables."""
    if request.param == "xpu":
        FakeXpuModule().install_into_torch(monkeypatch)
        module = torch.xpu
    else:
        FakeCudaModule().install_into_torch(
            monkeypatch, hip="7.0.51831-7c9236b16" if request.param == "hip" else None
        )
        module = torch.cuda
    spy = Spy()
    monkeypatch.setattr(module, "make_graphed_callables", spy, raising=False)
    return request.param, spy


def test_native_backends_route_to_torch(vendor: tuple[str, Spy]) -> None:
    name, spy = vendor
    assert accel_graph.current_backend().name == name
    out = accel_graph.make_graphed_callables(_fn, (), num_warmup_iters=11, allow_unused_input=True)
    assert out == "torch's graphed callables"
    assert spy.calls == [((_fn, (), 11, True), {"pool": None})]


def test_our_pool_handle_becomes_a_torch_pool_id(vendor: tuple[str, Spy]) -> None:
    _, spy = vendor
    handle = accel_graph.graph_pool_handle()
    accel_graph.make_graphed_callables((_fn, _fn), ((), ()), pool=handle)
    accel_graph.make_graphed_callables(_fn, (), pool=handle)
    pools = [kwargs["pool"] for _, kwargs in spy.calls]
    assert all(isinstance(p, tuple) and len(p) == 2 and p[0] == 0 and p[1] > 0 for p in pools), pools
    assert pools[0] == pools[1], "one handle names one torch pool across calls"
    torch_id = (0, 4242)
    accel_graph.make_graphed_callables(_fn, (), pool=torch_id)
    assert spy.calls[-1][1]["pool"] == torch_id, "torch's own ids pass through"


def test_validation_runs_before_routing(vendor: tuple[str, Spy]) -> None:
    _, spy = vendor
    with pytest.raises(ConfigError, match="sample_args has 1"):
        accel_graph.make_graphed_callables((_fn, _fn), ((),))
    assert spy.calls == []


def test_an_island_inside_torchs_make_graphed_callables_is_refused(vendor: tuple[str, Spy]) -> None:
    """torch's own function captures without an island runner (an island would be captured
    inline, not run eagerly at replay): the call runs with a refusing runner installed."""
    name, spy = vendor
    hits: list[int] = []

    @accel_graph.eager_island
    def island(x: torch.Tensor) -> torch.Tensor:
        hits.append(1)
        return x + 1

    def torch_like(fn: Any, args: tuple, *rest: Any, **kw: Any) -> Any:
        spy.calls.append(((fn, args), kw))
        return fn(*args)  # torch runs the callable (warm-up, capture) inside its call

    mod = getattr(torch, "xpu" if name == "xpu" else "cuda")
    mod.make_graphed_callables = torch_like  # the fixture's monkeypatch restores torch's
    with pytest.raises(accel_graph.CaptureError, match=r"eager island .*island.* inside make_graphed_callables"):
        accel_graph.make_graphed_callables(lambda: island(torch.ones(1)) * 2, ())
    assert hits == [] and len(spy.calls) == 1
    assert torch.equal(island(torch.ones(1)), torch.tensor([2.0]))  # a plain call again
