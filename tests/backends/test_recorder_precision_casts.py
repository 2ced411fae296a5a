"""Compiled replay refuses CPU programs with fp16/bf16 tensors on a torch whose Inductor C++ code
ignores ``emulate_precision_casts`` (torch 2.11; pytorch#185337), so the result stays eager's.

The detection reads Inductor's source; one test checks it against what a real compile does on
the installed torch, so a torch that fixes (or breaks) the rounding without the source saying
so fails here instead of silently."""

from __future__ import annotations

import logging

import pytest
import torch

import accel_graph
from accel_graph.backends.recorder.capture import Step
from accel_graph.backends.recorder.compiled import precision_casts
from accel_graph.backends.recorder.pool_protocol import PoolRef

aten = torch.ops.aten


def _half_step() -> Step:
    x = torch.ones(4)
    return Step(aten._to_copy.default, "functional", (x,), {"dtype": torch.float16},
                (PoolRef(0, 0, (4,), (1,), torch.float16),))


def _float_step() -> Step:
    return Step(aten.add.Tensor, "functional", (torch.ones(4), torch.ones(4)), {},
                (PoolRef(0, 0, (4,), (1,), torch.float32),))


def test_refusal_names_the_op_and_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_casts, "cpu_codegen_keeps_casts", lambda: False)
    why = precision_casts.refusal([_float_step(), _half_step()], "cpu")
    assert why is not None and "aten._to_copy.default" in why
    assert "emulate_precision_casts" in why and torch.__version__ in why
    assert precision_casts.refusal([_float_step()], "cpu") is None  # no fp16/bf16: compiled
    assert precision_casts.refusal([_half_step()], "cuda") is None  # Triton keeps the roundings
    # inside a control-flow sub-program too
    cond = Step(aten.add.Tensor, "cond", (), {}, (), extra=(torch.tensor(True), [_half_step()], []))
    assert precision_casts.refusal([_float_step(), cond], "cpu") is not None


def test_refusal_is_none_where_the_codegen_keeps_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision_casts, "cpu_codegen_keeps_casts", lambda: True)
    assert precision_casts.refusal([_half_step()], "cpu") is None


def test_detection_agrees_with_a_real_compile() -> None:
    from torch._inductor import config as inductor_config

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float16) + 1).to(torch.float32)

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    eager = f(x)
    torch._dynamo.reset()
    with inductor_config.patch({"emulate_precision_casts": True}):
        compiled = torch.compile(f, backend="inductor", fullgraph=True)(x)
    torch._dynamo.reset()
    # Without the roundings the values are off by up to fp16's half ulp (4e-4 here).
    assert torch.equal(compiled, eager) == precision_casts.cpu_codegen_keeps_casts(), (
        f"torch {torch.__version__}: compiled {'equals' if torch.equal(compiled, eager) else 'differs from'}"
        f" eager, but detection says {precision_casts.cpu_codegen_keeps_casts()}")


def test_graph_falls_back_with_the_reason_and_matches_eager(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(precision_casts, "cpu_codegen_keeps_casts", lambda: False)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with caplog.at_level(logging.WARNING, "accel_graph"), accel_graph.graph(g):
        y = (x.to(torch.float16) * 3 + 1).to(torch.float32)
    info = g.compile_info() or {}
    assert "ignores emulate_precision_casts" in info.get("fallback", ""), info
    assert "ignores emulate_precision_casts" in caplog.text
    y.zero_()
    g.replay()
    assert torch.equal(y, (x.to(torch.float16) * 3 + 1).to(torch.float32))  # interpreted: bitwise
