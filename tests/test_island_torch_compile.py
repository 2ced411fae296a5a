"""``torch.compile`` of a model holding eager islands: outside an accel_graph capture an island
is a plain call, and that must hold under Dynamo too. A marked module's forward once made
Dynamo fail its own guard (``forward.__dict__``) and, past that, recurse without end."""

from __future__ import annotations

import pytest
import torch

import accel_graph


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = (x[:, 0] > 0).nonzero()  # a host read: Dynamo breaks the graph here
        return self.lin(x) + picked.numel()


class _Model(torch.nn.Module):
    def __init__(self, own_forward: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        inner = _Router()
        if own_forward:  # an instance forward set before marking (a patched model)
            plain = inner.forward
            inner.forward = lambda x: plain(x) * 3  # type: ignore[method-assign]
        self.inner = accel_graph.eager_island(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.a(x)) * 2


@accel_graph.eager_island
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * float((x > 0).sum())


@pytest.mark.parametrize("own_forward", [False, True], ids=["class_forward", "instance_forward"])
def test_torch_compile_of_a_model_with_a_marked_module_equals_eager(own_forward: bool) -> None:
    torch.manual_seed(0)
    model = _Model(own_forward).eval()
    compiled = torch.compile(model, backend="eager")  # Dynamo is what is under test
    with torch.no_grad():
        for x in (torch.randn(3, 4), torch.randn(3, 4) + 1, torch.randn(3, 4) - 1):
            assert torch.equal(compiled(x), model(x))


def test_torch_compile_of_a_function_island_equals_eager() -> None:
    fn = torch.compile(lambda x: _scale(x + 1) - 1, backend="eager")
    for x in (torch.randn(5), torch.randn(5) - 2):
        assert torch.equal(fn(x), _scale(x + 1) - 1)
