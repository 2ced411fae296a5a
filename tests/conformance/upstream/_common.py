"""Shared pieces of the upstream port: the xfail markers for features other work items are
building, and small device-agnostic stand-ins for the CUDA calls the upstream tests make."""

from __future__ import annotations

import pytest
import torch

import accel_graph


def needs(item: int, branch: str, what: str, *, landed: bool = False) -> pytest.MarkDecorator:
    """``xfail`` (not strict) for a test written against a feature of issue 13 that another
    branch is building; once that branch has landed (``landed=True``) the mark only records
    which item the test exercises, and the test must pass."""
    if landed:
        return pytest.mark.issue13_item(item, what)
    return pytest.mark.xfail(
        reason=f"needs issue 13 item {item} ({branch}): {what}", strict=False
    )


#: ``accel_graph.make_graphed_callables`` (item 3).
NEEDS_MGC = needs(3, "wt-mgc", "accel_graph.make_graphed_callables", landed=True)
#: ``Optimizer.step`` / ``GradScaler`` capture (item 4).
NEEDS_OPTIM = needs(4, "wt-ops", "optimizer.step and GradScaler capture", landed=True)
#: ops that mutate an input and return a fresh tensor, such as ``rrelu_with_noise`` (item 5).
NEEDS_RRELU = needs(5, "wt-ops", "rrelu_with_noise replay", landed=True)
#: ``nn.LSTM`` on the CPU (``mkldnn_rnn_layer``'s meta/CPU mismatch, item 6).
NEEDS_LSTM = needs(6, "wt-ops", "LSTM replay on the CPU", landed=True)
#: RNG state inside a capture: get/set state, graphsafe state, register_generator_state (item 7).
NEEDS_RNG_STATE = needs(7, "wt-rng", "RNG state get/set inside a capture", landed=True)


#: Also run under ``compile="inductor"`` (see ``conftest.py``: the compiled case runs a subset).
COMPILED = pytest.mark.upstream_compiled


def is_native(g: accel_graph.Graph) -> bool:
    """Whether ``g`` replays a real device graph (cuda, hip, xpu) rather than the recorder."""
    return bool(g.backend.capabilities().native_graphs)


def seed(s: int) -> None:
    """``torch.cuda.manual_seed(s)`` upstream; ``torch.manual_seed`` seeds every device."""
    torch.manual_seed(s)


def total(t: torch.Tensor) -> float:
    """``t.sum().item()`` in float64, outside any capture."""
    return float(t.double().sum())
