"""The engine over two gloo ranks with FAKE executors (plumbing only: no model): rank 0
schedules and broadcasts each step, rank 1 follows; every step issues an all-reduce, as a
tensor-parallel step does, so a rank running a step the other skips would hang (the group's
short timeout turns that into a failure). The real TPDecoder under torchrun is in
tests/distributed/test_serving_torchrun.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from serving_engine_fakes import FakeStepExecutor, fake_reference

from accel_graph.serving.engine_tp import LeaderExecutor, decode_batch, encode_batch, follow
from accel_graph.serving.step import Segment, StepBatch
from accel_graph.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)


class _AllReducingFake(FakeStepExecutor):
    """FAKE: the fake executor plus one all-reduce of the step's sampled tokens per step."""

    def run(self, batch: StepBatch) -> list[int]:
        out = super().run(batch)
        t = torch.tensor([sum(out), len(out)], dtype=torch.int64)
        dist.all_reduce(t)
        assert t.tolist() == [sum(out) * dist.get_world_size(), len(out) * dist.get_world_size()]
        return out


def _ranks(rank: int, world: int) -> dict:
    from accel_graph.serving.engine import Engine
    from accel_graph.serving.workload import poisson_requests

    ex = _AllReducingFake(num_slots=3, max_tokens=8, max_segments=4)
    reqs = poisson_requests(10, 400.0, (1, 20), (1, 8), vocab_size=97, seed=1)
    if rank == 0:
        with LeaderExecutor(ex) as leader:
            run = Engine(leader).run(reqs)
        tokens = [r.tokens for r in run.results]
        ok = all(t == fake_reference(r.prompt, r.max_new_tokens, None, 97)
                 for t, r in zip(tokens, reqs))
        return {"steps": len(ex.batches), "ok": ok, "batches": [repr(b) for b in ex.batches]}
    steps = follow(ex)
    return {"steps": steps, "batches": [repr(b) for b in ex.batches]}


def test_leader_and_follower_run_the_same_steps() -> None:
    r0, r1 = run_ranks(_ranks, 2, timeout=90, pg_timeout=20)
    assert r0["ok"] and r0["steps"] > 5
    assert r1["steps"] == r0["steps"] and r1["batches"] == r0["batches"]


def test_batch_encoding_round_trip() -> None:
    b = StepBatch((Segment(2, 5, (7,), True), Segment(0, 0, (1, 2, 3), False)))
    assert decode_batch(encode_batch(b, 2 + 4 * 2 + 4)) == b
    assert decode_batch(encode_batch(None, 10)) is None
    with pytest.raises(ValueError, match="does not fit"):
        encode_batch(b, 8)
