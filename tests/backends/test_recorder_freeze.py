"""``compile_options={"freeze": True}``: captured parameters the program never writes are compiled
as constants; written ones, inputs and buffers stay arguments; results equal freeze=False. And
``compile_options={"cpp_wrapper": True}``, with its fallback to the Python wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel_graph
from accel_graph.backends.recorder.compiled.freezing import FrozenConstants, written_storages
from accel_graph.backends.recorder.compiled.inductor import clear_compile_cache
from accel_graph.foundation.tolerances import assert_close_for_dtype


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    net.register_buffer("shift", torch.full((4,), 0.5))  # a buffer: never frozen
    return net.eval()


def _forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x) + net.shift


def _capture(fn, *, compile: str | None = "inductor", freeze: bool = False):
    g = accel_graph.Graph(device="cpu", compile=compile,
                          compile_options={"freeze": freeze} if compile else None)
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = fn()
        g.replay()
    return g, out


def _compiled_info(g) -> dict:
    info = g._impl._compiled
    assert info is not None and "fallback" not in info, info
    return info


def test_freeze_equals_unfrozen_and_eager() -> None:
    net, x = _mlp(), torch.randn(3, 8)
    before = [p.detach().clone() for p in net.parameters()]
    plain, out_plain = _capture(lambda: _forward(net, x))
    frozen, out_frozen = _capture(lambda: _forward(net, x), freeze=True)
    for p, p0 in zip(net.parameters(), before, strict=True):  # freezing leaves them as they were
        assert torch.equal(p, p0) and p.shape == p0.shape
    assert _compiled_info(frozen)["frozen"] == 4  # two weights, two biases; not the buffer
    assert "frozen" not in _compiled_info(plain)
    for values in (torch.randn(3, 8), torch.randn(3, 8) * 10):
        x.copy_(values)
        net.shift.fill_(float(values[0, 0]))  # buffers stay arguments: the change is seen
        plain.replay()
        frozen.replay()
        with torch.inference_mode():
            want = _forward(net, x)
        assert_close_for_dtype(out_frozen, out_plain)
        assert_close_for_dtype(out_frozen, want)


def test_parameter_written_by_the_program_is_not_frozen() -> None:
    """A program that updates a weight in place (an optimizer-like step) reads the updated
    weight at every replay: that weight stays an argument, the other is frozen."""
    w = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    v = nn.Parameter(torch.randn(4), requires_grad=False)
    x = torch.randn(2, 4)

    def step() -> torch.Tensor:
        w.mul_(0.5).add_(v)  # written in place through the program
        return x @ w.t() + v

    w0 = w.detach().clone()
    g, out = _capture(step, freeze=True)
    assert _compiled_info(g)["frozen"] == 1  # v only
    expect_w = w0
    for i in range(1, 4):  # the capture ran no kernel; replay i applies the update i times
        expect_w = expect_w * 0.5 + v
        if i > 1:
            g.replay()
        assert_close_for_dtype(w.detach(), expect_w)
        assert_close_for_dtype(out, x @ expect_w.t() + v)


def test_recapture_after_an_update_does_not_reuse_old_constants() -> None:
    """A program with frozen constants is never shared through the compile cache: an identical
    capture after a weight update compiles again with the new values, also after an update
    through ``.data`` (which leaves the version counter alone: a key of identity and version
    reused the old weights)."""
    clear_compile_cache()
    net, x = _mlp(), torch.randn(2, 8)
    g1, out1 = _capture(lambda: _forward(net, x), freeze=True)
    for update in (lambda w: w.mul_(-1.0), lambda w: w.data.mul_(2.0)):
        version = net[0].weight._version
        with torch.no_grad():
            update(net[0].weight)
        g2, out2 = _capture(lambda: _forward(net, x), freeze=True)
        assert _compiled_info(g2)["cache"] == "miss"
        with torch.inference_mode():
            want = _forward(net, x)
        assert_close_for_dtype(out2, want)
    assert net[0].weight._version == version  # the .data update: the case a version key missed


def test_written_storages_sees_views_out_and_control_flow_free_programs() -> None:
    """The freeze decision without compiling: writes through a view made in the capture and
    through ``out=`` mark the parameter's storage; reads do not."""
    a = nn.Parameter(torch.randn(6), requires_grad=False)
    b = nn.Parameter(torch.randn(6), requires_grad=False)
    c = nn.Parameter(torch.randn(6), requires_grad=False)
    x = torch.randn(6)

    def fn() -> torch.Tensor:
        a[:3].add_(1.0)               # a view of a, written
        torch.mul(x, 2.0, out=b)      # b written through out=
        return x * c                  # c only read

    g, _ = _capture(fn, compile=None)
    written = written_storages(g._impl._frozen_steps)
    frozen = FrozenConstants(written)
    assert not frozen.may_freeze(a) and not frozen.may_freeze(b)
    assert frozen.may_freeze(c)
    assert not frozen.may_freeze(x)  # not a Parameter: an input, rewritten between replays
    assert frozen.add(c) == "frozen0" and frozen.add(c) == "frozen0" and frozen.add(x) is None


@pytest.mark.parametrize("value", [1, "yes", None])
def test_freeze_takes_only_bools(value) -> None:
    with pytest.raises(accel_graph.ConfigError, match="True or False"):
        accel_graph.Graph(device="cpu", compile="inductor", compile_options={"freeze": value})


def test_cpp_wrapper_option_compiles_and_matches() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"cpp_wrapper": True})
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = (x @ w).relu() + 1
        x.copy_(torch.randn(4, 8))
        g.replay()
        want = (x @ w).relu() + 1
    assert _compiled_info(g)["wrapper"] == "cpp"
    assert_close_for_dtype(out, want)


def test_cpp_wrapper_failure_compiles_with_the_python_wrapper(monkeypatch) -> None:
    import accel_graph.backends.recorder.compiled.inductor as compiled

    real = compiled._compiled_module

    def no_cpp(graph, example, frozen=None, cpp_wrapper=False):
        if cpp_wrapper:
            raise RuntimeError("C++ wrapper unavailable in this test")
        return real(graph, example, frozen, cpp_wrapper)

    monkeypatch.setattr(compiled, "_compiled_module", no_cpp)
    x = torch.randn(5)
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"cpp_wrapper": True})
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = x * 3 + 1
        x.fill_(2.0)
        g.replay()
    info = _compiled_info(g)
    assert info["wrapper"].startswith("python (the C++ wrapper failed: RuntimeError")
    assert torch.equal(out, torch.full((5,), 7.0))
