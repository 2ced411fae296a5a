"""Compiled replay whose generated code fails only at its first run (issue 24 item 3): torch
2.14.1's ``NameError: name 's53' is not defined`` was such a failure. It must fall back to
interpreted replay with the reason (``compile_info()["fallback"]``, ``replay_mode()``), at
whichever point first runs the compiled program (the timing run at instantiation, the first
real replay, the decider's first round), and leave no trace of the failed run: inputs written in
place, generators and pool memory are as if only the interpreted program had run.

The failure is injected: ``compile_fx`` is wrapped so the module it returns runs the real
compiled program completely (every effect applied, the worst partial run) and then raises the
NameError. Real Inductor, so this runs on both torch versions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accel_graph as ag
from accel_graph.backends.recorder.compiled import inductor as compiled
from accel_graph.errors import ReplayError

NAME_ERROR = "name 's53' is not defined"


@pytest.fixture
def broken_first_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every compiled module run fully, then raise NameError; returns the count of calls."""
    import torch._inductor.compile_fx as cfx

    real = cfx.compile_fx
    calls: list[int] = []

    def compile_fx(gm: Any, example: Any, **kwargs: Any) -> Any:
        module = real(gm, example, **kwargs)

        def run(*args: Any) -> Any:
            calls.append(1)
            module(*args)
            raise NameError(NAME_ERROR)

        return run

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    compiled.clear_compile_cache()  # a broken module must not serve later tests
    yield calls
    compiled.clear_compile_cache()


def _graph(replay: str) -> ag.Graph:
    return ag.Graph(device="cpu", compile="inductor", compile_options={"replay": replay})


def _assert_fell_back(g: ag.Graph) -> None:
    info = g.compile_info()
    assert info is not None and info["fallback"] == f"NameError: {NAME_ERROR}", info
    assert info["failed_at"] == "first run"
    mode = g.replay_mode()
    assert mode.mode == "interpreted" and NAME_ERROR in mode.reason, mode


def test_forced_compiled_falls_back_at_the_first_replay_and_writes_inputs_once(
        broken_first_run: list[int], caplog: pytest.LogCaptureFixture) -> None:
    acc, x = torch.zeros(6), torch.arange(6.0)
    g = _graph("compiled")
    with g:
        acc.add_(x * 2)  # an input written in place: a doubled write would show
    assert torch.equal(acc, torch.zeros(6))  # capture runs nothing
    with caplog.at_level("WARNING", logger="accel_graph"):
        g.replay()  # the compiled run wrote acc, then raised: undone, then run interpreted
    assert torch.equal(acc, x * 2)
    assert "failed at its first run" in caplog.text and NAME_ERROR in caplog.text
    _assert_fell_back(g)
    calls = len(broken_first_run)
    g.replay()
    assert torch.equal(acc, x * 4) and len(broken_first_run) == calls  # compiled never again


def test_random_draws_equal_eager_after_a_failed_first_run(broken_first_run: list[int]) -> None:
    x = torch.randn(5)
    g = _graph("compiled")
    with g:
        y = torch.rand(5) + x
    torch.manual_seed(7)
    want = torch.rand(5) + x
    after = torch.rand(3)
    torch.manual_seed(7)
    g.replay()  # the failed compiled run drew too: the generator is put back first
    _assert_fell_back(g)
    assert torch.equal(y, want)
    assert torch.equal(torch.rand(3), after)


def test_auto_falls_back_at_the_timing_run_at_instantiation(broken_first_run: list[int]) -> None:
    x = torch.randn(8)
    g = _graph("auto")
    with g:
        y = x.sin() * 2.5  # no input written: timed at instantiation
    assert len(broken_first_run) == 1  # the timing warm-up ran it, once
    _assert_fell_back(g)
    g.replay()
    torch.testing.assert_close(y, x.sin() * 2.5)
    assert len(broken_first_run) == 1


def test_auto_decider_falls_back_at_its_first_compiled_round(broken_first_run: list[int]) -> None:
    acc, x = torch.ones(4), torch.full((4,), 3.0)
    g = _graph("auto")
    with g:
        acc.mul_(x)  # an input written: decided on the real replays, compiled first
    assert g.replay_mode().mode == "undecided"
    g.replay()
    assert torch.equal(acc, torch.full((4,), 3.0))
    _assert_fell_back(g)
    for _ in range(3):
        g.replay()
    assert torch.equal(acc, torch.full((4,), 81.0)) and len(broken_first_run) == 1


def test_a_stale_input_is_the_callers_error_not_a_compile_failure(broken_first_run: list[int]) -> None:
    x = torch.zeros(4)
    g = _graph("compiled")
    with g:
        x.add_(1)
    x.resize_(8)  # re-pointed: replay refuses before running anything
    with pytest.raises(ReplayError):
        g.replay()
    assert "fallback" not in (g.compile_info() or {}) and not broken_first_run
