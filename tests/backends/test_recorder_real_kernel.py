"""Recorder plans checked against the real kernel (``validate.py``), observer ops, and ops that
write an argument and return a fresh tensor."""

from __future__ import annotations

import json

import torch

import accel_graph as ag
from accel_graph.backends.recorder import plan as recorder_plan

aten = torch.ops.aten


def _lstm_layer_args():
    """The arguments nn.LSTM passes to mkldnn_rnn_layer for a one-layer LSTM(8, 16)."""
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.mkldnn_rnn_layer.default:
                seen.append(args)
            return func(*args, **(kwargs or {}))

    lstm = torch.nn.LSTM(8, 16)
    with Spy():
        lstm(torch.randn(5, 3, 8))
    return seen[0]


def test_lstm_layer_plan_follows_the_cpu_kernel_not_the_meta_kernel():
    args = _lstm_layer_args()
    with torch.no_grad():
        plan = recorder_plan.plan_for(aten.mkldnn_rnn_layer.default, args, {})
    # The CPU kernel leaves the workspace undefined without grad mode (meta: an empty tensor).
    assert plan.specs[3] == (None, None)
    assert plan.strategy.kind == "compute" and not plan.grad
    with torch.enable_grad():
        plan = recorder_plan.plan_for(aten.mkldnn_rnn_layer.default, args, {})
    # With grad mode the workspace exists, with the size the oneDNN primitive asks for.
    assert plan.specs[3][0] is not None and plan.specs[3][0].numel() > 0
    assert plan.grad  # replay (under inference mode) runs it with grad mode on


def test_reflection_pad_plan_keeps_channels_last_as_the_cpu_kernel_does():
    x = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    plan = recorder_plan.plan_for(aten.reflection_pad2d.default, (x, [1, 1, 1, 1]), {})
    assert plan.specs[0][1] == aten.reflection_pad2d.default(x, [1, 1, 1, 1]).stride()


def test_plan_checks_do_not_consume_random_numbers():
    """Capturing random ops (checked against the real kernel with a private generator) leaves
    the global generator where it was: capture consumes no random numbers."""
    x = torch.randn(4, 8)
    act = torch.nn.RReLU().train()
    state = torch.get_rng_state()
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        act(x * 1.5)  # a new shape: planned (and checked) now
    assert torch.equal(torch.get_rng_state(), state)


def test_rrelu_with_noise_writes_its_noise_at_replay():
    x = torch.randn(4, 8)
    noise = torch.zeros(4, 8)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        out = aten.rrelu_with_noise.default(x, noise, 0.1, 0.3, True)
    assert torch.count_nonzero(noise) == 0  # capture runs nothing
    torch.manual_seed(7)
    g.replay()
    expected_noise = torch.zeros(4, 8)
    torch.manual_seed(7)
    expected = aten.rrelu_with_noise.default(x, expected_noise, 0.1, 0.3, True)
    assert torch.equal(out, expected) and torch.equal(noise, expected_noise)


def test_profiler_ranges_are_run_at_capture_and_not_recorded(tmp_path):
    g = ag.Graph(device="cpu")
    x = torch.randn(3)
    with ag.graph(g):
        y = _ranged(x)
    g.debug_dump(str(tmp_path / "g.dot"))
    ops = [op["op"] for op in json.loads((tmp_path / "g.dot.json").read_text())["ops"]]
    assert ops and not any("profiler" in op for op in ops), ops
    x.copy_(torch.ones(3))
    g.replay()
    assert torch.equal(y, torch.full((3,), 2.0))
    assert ag.check_capturable(_ranged, x).ok


def _ranged(t):
    with torch.autograd.profiler.record_function("range"):
        return t * 2


def test_lstm_captured_without_grad_mode_replays_bitwise():
    """No grad mode: the CPU kernel's workspace is undefined, and replay computes the layer
    and copies its defined outputs (the .out overload cannot express an undefined output)."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        lstm(x)
        g = ag.Graph(device="cpu")
        with ag.graph(g):
            out, (h, c) = lstm(x)
        for seed in (1, 2):
            x.copy_(torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed)))
            g.replay()
            e_out, (e_h, e_c) = lstm(x)
            assert torch.equal(out, e_out) and torch.equal(h, e_h) and torch.equal(c, e_c)
