"""Helpers shared by the conformance tests (device-agnostic: everything lives on ``device``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from accel_graph.backends.recorder.compiled.precision_casts import cpu_codegen_keeps_casts
from accel_graph.testing import assert_replay_matches, capture

Inputs = Callable[[torch.Generator], Sequence[torch.Tensor]]


def randn(
    gen: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Fresh normal data drawn on the CPU from ``gen`` (the global RNG is not touched)."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def randint(gen: torch.Generator, high: int, *shape: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen).to(device)


def expect_low_precision_fallback(request: pytest.FixtureRequest, device: torch.device) -> None:
    """For a case with fp16/bf16 tensors: on a torch whose Inductor CPU code ignores
    ``emulate_precision_casts`` (2.11), compiled replay refuses with that reason and replays
    interpreted (docs/recorder.md); that fallback is expected there, any other still fails."""
    if device.type == "cpu" and not cpu_codegen_keeps_casts():
        request.applymarker(pytest.mark.accel_graph_expected_fallback("ignores emulate_precision_casts"))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def copy_into(static: Sequence[torch.Tensor], fresh: Sequence[torch.Tensor]) -> None:
    """Copy new values into the static inputs, as a server does before each replay."""
    for s, f in zip(static, fresh, strict=True):
        s.copy_(f)


def assert_same_strides(out: Any, expected: Any, where: str = "result") -> None:
    """Graph outputs have the strides eager gives, as on a native device graph: code that
    calls ``.view()`` on an output must behave the same."""
    if isinstance(expected, torch.Tensor):
        # Strides of dimensions of size 0 or 1 do not affect the layout.
        def layout(t):
            return [st for n, st in zip(t.shape, t.stride(), strict=True) if n > 1]

        assert layout(out) == layout(expected), (
            f"{where}: stride {out.stride()} after capture, {expected.stride()} eagerly "
            f"(shape {tuple(expected.shape)})"
        )
    elif isinstance(expected, dict):
        for k in expected:
            assert_same_strides(out[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        for i, (o, e) in enumerate(zip(out, expected, strict=True)):
            assert_same_strides(o, e, f"{where}[{i}]")


def check_replay_matches_eager(
    make_graph: Callable[..., Any],
    fn: Callable[..., Any],
    make_inputs: Inputs,
    *,
    rounds: int = 3,
    **graph_kwargs: Any,
) -> tuple[Any, Any, Sequence[torch.Tensor]]:
    """Capture ``fn`` on static inputs, then for several fresh input sets: copy them in, replay,
    and assert the static outputs match ``fn`` run eagerly on the same values: bitwise under
    interpreted replay, within the per-dtype tolerances under compiled replay
    (:func:`~accel_graph.testing.assert_replay_matches`).

    Returns ``(graph, static_outputs, static_inputs)`` for further checks.
    """
    static = list(make_inputs(gen(0)))
    g = make_graph(**graph_kwargs)
    out = capture(g, fn, *static)
    for r in range(1, rounds + 1):
        fresh = list(make_inputs(gen(r)))
        copy_into(static, fresh)
        g.replay()
        expected = fn(*fresh)
        assert_replay_matches(out, expected, msg=f"replay {r}")
    assert_same_strides(out, expected)
    return g, out, static
