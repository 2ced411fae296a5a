"""Outputs shared between buckets (issue 17 item 3) and the outputs contract in debug mode."""

from __future__ import annotations

import logging

import pytest
import torch

from accel_graph import GraphRunner

W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))


def step(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ W)  # an intermediate, then an output 4x wider than the input
    return torch.cat([h, h * 2, h.exp(), h - 1], dim=1)


def make(**kw) -> GraphRunner:
    kw.setdefault("progress", False)
    return GraphRunner(step, torch.zeros(1, 16), buckets=[1, 2, 4, 8, 16], **kw).capture()


@pytest.mark.parametrize("share", [False, True])
def test_results_equal_eager_across_buckets(share: bool) -> None:
    r = make(share_outputs=share)
    gen = torch.Generator().manual_seed(1)
    for n in (16, 3, 1, 9, 16, 2):
        x = torch.randn(n, 16, generator=gen)
        torch.testing.assert_close(r(x), step(x))
    assert r.stats()["eager_calls"] == 0


def test_sharing_cuts_output_memory_to_the_largest_buckets() -> None:
    plain, shared = make(), make(share_outputs=True)
    rp, rs = plain.memory_report(), shared.memory_report()
    per_row = 4 * 64 * 4  # bytes of one output row
    assert rp["output_bytes_per_bucket_sum"] == rs["output_bytes_per_bucket_sum"] == 31 * per_row
    assert rp["outputs_shared"] is False and rp["output_bytes_saved"] == 0
    assert rp["output_region_bytes"] == 31 * per_row
    assert rs["outputs_shared"] is True
    assert rs["output_region_bytes"] == 16 * per_row  # the largest bucket's outputs
    assert rs["output_bytes_saved"] == 15 * per_row


def test_outputs_that_are_inputs_or_state_never_become_the_region() -> None:
    def passthrough(x: torch.Tensor, *, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state.add_(1)
        return x * 2, state

    r = GraphRunner(passthrough, torch.zeros(1, 4), buckets=[1, 2], share_outputs=True,
                    output_batch_dim=(0, None), state=lambda b: torch.zeros(3),
                    progress=False).capture()
    assert r.runtime.output_region is None and r.memory_report()["outputs_shared"] is False
    before = r.state(2).clone()
    r(torch.ones(1, 4))
    assert torch.equal(r.state(2), before)  # bucket 1's graph never wrote into bucket 2's state


def test_shared_views_are_valid_until_the_next_call_of_any_bucket() -> None:
    r = make(share_outputs=True)
    a = r(torch.ones(16, 16))
    kept = a.clone()
    r(torch.zeros(2, 16))  # another bucket writes the shared region
    assert not torch.equal(a, kept)  # documented: the view is overwritten
    plain = make()
    a = plain(torch.ones(16, 16))
    kept = a.clone()
    plain(torch.zeros(2, 16))
    assert torch.equal(a, kept)  # without sharing only the same bucket overwrites it


def test_debug_mode_poisons_outputs_kept_past_the_next_call(caplog) -> None:
    r = make(share_outputs=True, debug=True)
    a = r(torch.ones(3, 16))
    b = r(torch.ones(1, 16))
    assert a[1:].isnan().all()  # rows the next call did not rewrite read poison
    assert torch.equal(a[:1], b)  # row 0 of the shared region now holds the next call's output
    assert r.stats()["stale_output_warnings"] == 0


def test_debug_mode_reports_writes_into_returned_views(caplog) -> None:
    r = make(debug=True)
    out = r(torch.ones(2, 16))
    out.zero_()  # the caller writes into the runner's memory
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        r(torch.ones(2, 16))
    assert "changed before this call started" in caplog.text
    assert r.stats()["stale_output_warnings"] == 1


def test_debug_mode_lets_outputs_feed_the_next_call() -> None:
    """A decode loop passes its output back in: debug mode must not poison that input."""
    r = GraphRunner(lambda x: x * 2 + 1, torch.zeros(1, 4), buckets=[2], debug=True,
                    share_outputs=True, progress=False).capture()
    x = torch.ones(2, 4)
    for _ in range(3):
        x = r(x)
    assert torch.equal(x, torch.full((2, 4), 15.0))
