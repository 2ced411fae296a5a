"""GraphRunner over a function with torch.cond / torch.while_loop (recorder).

The runner's eager warm-up and verification run the function under its undo log, a dispatch
mode; torch refuses a higher-order operator under a mode without a rule for it, so before the
rule these runners failed at warm-up (and eager torch.cond broke for the rest of the process).
"""

from __future__ import annotations

import pytest
import torch

import accel_graph

COUNTER = torch.zeros(())  # state the step writes, captured by reference


def _step(x: torch.Tensor, counter: torch.Tensor = COUNTER) -> torch.Tensor:
    def pos(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * 2 + c,)

    def neg(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
        return (x - 1 - c,)

    # torch's eager cond refuses a branch that writes its operands; the state write is outside
    (y,) = torch.cond(x.sum() > 0, pos, neg, (x, counter))
    counter.add_(torch.where(x.sum() > 0, 1.0, -1.0))

    def more(i: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        return i < 3

    def body(i: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, acc + y.sum()

    _, acc = torch.while_loop(more, body, (torch.zeros((), dtype=torch.long), torch.zeros(())))
    return y + acc


@pytest.mark.parametrize("capture", ["eager", "lazy"])
def test_runner_verifies_control_flow_and_keeps_state_once(capture: str) -> None:
    counter = COUNTER
    x = torch.randn(4, 3).abs()
    runner = accel_graph.GraphRunner(_step, (x,), buckets=[4], device="cpu", capture=capture,
                                     verify=True)
    runner.capture()
    before = counter.item()
    for sign in (1.0, -1.0, 1.0):
        xi = sign * torch.randn(4, 3).abs()
        expect_counter = counter.clone()
        expected = _step(xi, expect_counter)
        got = runner(xi)
        torch.testing.assert_close(got, expected)
        # the state write happened exactly once per call (the verified eager call undone)
        assert counter.item() == expect_counter.item()
    assert counter.item() == before + 1  # +1, -1, +1
    # eager torch.cond still works in this process afterwards (pytorch#163013's skip undone)
    (z,) = torch.cond(torch.tensor(True), lambda a: (a + 1,), lambda a: (a - 1,), (torch.ones(2),))
    assert torch.equal(z, torch.full((2,), 2.0))
