"""Training steps in one graph: forward, backward and ``optimizer.step()`` captured together.

``Optimizer.step`` runs inside ``torch.autograd.profiler.record_function``, whose profiler ops
are recorded as no-ops. What captures, and what is refused and why (docs/recorder.md):

- SGD with momentum (for-loop, foreach, fused), Adam and AdamW with ``fused=True``, and a
  ``GradScaler`` driving a fused optimizer: capture, replay equal to eager step after step.
- Adam and AdamW without ``fused`` (for-loop or foreach) read the step count on the host
  (``_get_value(step)`` is ``step.item()``) to compute the bias correction: refused at the
  ``.item()``, since a replay would reuse the captured count.
- ``GradScaler.step`` with an optimizer that does not take the scale itself reads
  ``found_inf`` on the host (``.item()``) to decide whether to step: refused.
- ``capturable=True`` on the CPU: torch itself refuses it (an assertion in the optimizer).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import accel_graph
from accel_graph import CaptureError
from accel_graph.testing import assert_replay_matches, capture

from ._util import gen, randn

STEPS = 3


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, scaler, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)  # grads stay in place: the graph writes them
    loss = model(x).square().mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


def _check_steps(make_graph, device, make_opt: Callable, scaler_kwargs: dict | None = None,
                 poison_at: int | None = None) -> None:
    """Capture one training step after a warm-up step, then replay it ``STEPS`` times on fresh
    batches; losses, parameters and optimizer state match eager after every step."""
    def build():
        model = _model(device)
        opt = make_opt(model.parameters())
        scaler = None if scaler_kwargs is None else torch.amp.GradScaler(device.type, **scaler_kwargs)
        return model, opt, scaler

    xs = [randn(gen(i), 5, 8, device=device) for i in range(STEPS + 1)]
    if poison_at is not None:
        xs[poison_at][0, 0] = float("inf")  # the scaler must skip this step, on the device
    ref_model, ref_opt, ref_scaler = build()
    expected = []
    for x in xs:
        loss = _train_step(ref_model, ref_opt, ref_scaler, x)
        state = [t.clone() for s in ref_opt.state.values() for t in s.values() if torch.is_tensor(t)]
        expected.append((loss.clone(), [p.detach().clone() for p in ref_model.parameters()], state))

    model, opt, scaler = build()
    static_x = xs[0].clone()
    g = make_graph()
    loss = capture(g, lambda x: _train_step(model, opt, scaler, x), static_x)  # warm-up: step 0
    for i in range(1, STEPS + 1):
        static_x.copy_(xs[i])
        g.replay()
        exp_loss, exp_params, exp_state = expected[i]
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        assert_replay_matches(
            [loss, *[p.detach() for p in model.parameters()], *state],
            [exp_loss, *exp_params, *exp_state], msg=f"step {i}",
        )


def _skip_fused_compiled(accel_graph_compile) -> None:
    if accel_graph_compile is not None:
        pytest.skip("compiled replay of fused optimizer kernels falls back to interpreted replay: "
                    "_fused_sgd_ has no meta kernel and _fused_adam(w)_ fails functionalization")


SGD_CONFIGS = {
    "sgd": {},
    "sgd-foreach": {"foreach": True},
    "sgd-fused": {"fused": True},
}


@pytest.mark.parametrize("config", list(SGD_CONFIGS))
def test_sgd_momentum_step_captured_equals_eager(make_graph, device, config, accel_graph_compile):
    if config == "sgd-fused":
        _skip_fused_compiled(accel_graph_compile)
    kw = SGD_CONFIGS[config]
    _check_steps(make_graph, device, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw))


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_fused_adam_step_captured_equals_eager(make_graph, device, cls, accel_graph_compile):
    _skip_fused_compiled(accel_graph_compile)
    _check_steps(make_graph, device, lambda p: cls(p, lr=0.01, fused=True))


def test_gradscaler_adamw_step_captured_equals_eager(make_graph, device, accel_graph_compile):
    """GradScaler + fused AdamW: unscaling, the inf check, the skipped step and the scale update
    all stay on the device (growth every 2 steps, an inf in step 2's batch)."""
    _skip_fused_compiled(accel_graph_compile)
    _check_steps(make_graph, device, lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
                 scaler_kwargs={"init_scale": 2.0**8, "growth_interval": 2}, poison_at=2)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_unfused_adam_reads_the_step_on_the_host_and_is_refused(make_graph, device, cls, foreach):
    model = _model(device)
    opt = cls(model.parameters(), lr=0.01, foreach=foreach)
    x = randn(gen(0), 5, 8, device=device)
    _train_step(model, opt, None, x)
    with pytest.raises(CaptureError, match=r"_local_scalar_dense"):
        with accel_graph.graph(make_graph()):
            _train_step(model, opt, None, x)


def test_gradscaler_with_unfused_optimizer_is_refused(make_graph, device):
    """Without fused scale handling, GradScaler.step reads found_inf with .item()."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type)
    x = randn(gen(0), 5, 8, device=device)
    _train_step(model, opt, scaler, x)
    with pytest.raises(CaptureError, match=r"_local_scalar_dense"):
        with accel_graph.graph(make_graph()):
            _train_step(model, opt, scaler, x)


def test_capturable_adam_on_the_cpu_is_refused_by_torch(make_graph, device):
    if device.type != "cpu":
        pytest.skip("torch allows capturable=True on cuda, xpu, hpu, xla and the PrivateUse1 device")
    model = _model(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    with pytest.raises(AssertionError, match="capturable=True"):
        _train_step(model, opt, None, randn(gen(0), 5, 8, device=device))


def test_record_function_ranges_are_not_refused(make_graph, device):
    """Profiler ranges (new and legacy handle forms) run at capture and replay as nothing."""
    x = randn(gen(0), 4, 4, device=device)

    def fn(x):
        with torch.autograd.profiler.record_function("outer"):
            y = x * 2
        handle = torch.ops.profiler._record_function_enter("legacy", None)
        z = y + 1
        torch.ops.profiler._record_function_exit(handle)
        return z

    g = make_graph()
    out = capture(g, fn, x)
    fresh = randn(gen(1), 4, 4, device=device)
    x.copy_(fresh)
    g.replay()
    assert_replay_matches(out, fn(fresh))
