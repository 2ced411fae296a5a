"""The engine over tensor-parallel ranks: one scheduler, the same steps on every rank.

A tensor-parallel step issues collectives (two all-reduces per layer) that pair up across ranks
by order, so every rank must run exactly the same steps in the same order. Rank ``src`` (0)
runs the :class:`~.engine.Engine` (queue, scheduler, clock) over a :class:`LeaderExecutor`,
which broadcasts each step's :class:`~.step.StepBatch` to the group before running it on the
local shard; every other rank runs :func:`follow`, which receives each batch and runs it on its
shard. No rank decides anything on its own, so no rank waits on a collective another skips.

Shutdown is agreed: :meth:`LeaderExecutor.close` (also on leaving its ``with`` block, error or
not) broadcasts a stop message, and each follower returns from :func:`follow` on it.

Each batch travels as one fixed-size int64 tensor (``2 + 4 * max_segments + max_tokens``
values: a header, the segments, the tokens), so every broadcast has the same shape. With gloo
(CPU) the tensor is on the CPU; with NCCL pass ``device=torch.device("cuda", local_rank)``.
Every rank computes the same (replicated) logits, so the followers' tokens are the leader's;
the leader's are the ones the engine uses.

Failures: a step that raises on one rank may already have issued some of its collectives, so
ranks cannot safely run it again on another path; build the engine without ``fallback`` under
tensor parallelism (the step's requests then end with ``"error"``, and the followers, which
raised too or are waiting in a collective, fail on the group's timeout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .step import Segment, StepBatch, StepExecutor

__all__ = ["LeaderExecutor", "decode_batch", "encode_batch", "follow"]

_STEP, _STOP = 1, 0


def _capacity(executor: StepExecutor) -> int:
    return 2 + 4 * executor.max_segments + executor.max_tokens


def encode_batch(batch: StepBatch | None, capacity: int) -> torch.Tensor:
    """``batch`` (None: the stop message) as a ``[capacity]`` int64 tensor: ``[kind, n]``, then
    ``(slot, start, length, sample)`` per segment, then the tokens in flat order."""
    buf = torch.zeros(capacity, dtype=torch.int64)
    if batch is None:
        return buf  # kind 0: stop
    head = [_STEP, len(batch.segments)]
    for s in batch.segments:
        head += [s.slot, s.start, len(s.tokens), int(s.sample)]
    flat = [t for s in batch.segments for t in s.tokens]
    if len(head) + len(flat) > capacity:
        raise ValueError(f"a step of {len(batch.segments)} segments and {len(flat)} tokens does "
                         f"not fit the broadcast buffer of {capacity} values")
    buf[:len(head) + len(flat)] = torch.tensor(head + flat, dtype=torch.int64)
    return buf


def decode_batch(buf: torch.Tensor) -> StepBatch | None:
    """The inverse of :func:`encode_batch` (None for the stop message)."""
    vals = buf.tolist()
    if vals[0] == _STOP:
        return None
    n = vals[1]
    pos = 2 + 4 * n
    segs = []
    for i in range(n):
        slot, start, length, sample = vals[2 + 4 * i: 6 + 4 * i]
        segs.append(Segment(slot, start, tuple(vals[pos:pos + length]), bool(sample)))
        pos += length
    return StepBatch(tuple(segs))


class LeaderExecutor:
    """The scheduling rank's executor: broadcasts each batch, then runs it on ``inner`` (this
    rank's shard). Has ``inner``'s limits, so the engine schedules for every rank at once.

    Args:
        inner: this rank's executor (over a ``TPDecoder`` shard).
        group: the process group (None: the default group).
        src: the scheduling rank (its rank in the default group).
        device: where the broadcast buffer lives (CPU for gloo, the rank's GPU for NCCL).
    """

    def __init__(self, inner: StepExecutor, group: Any = None, src: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.inner, self.group, self.src = inner, group, src
        self.device = torch.device(device or "cpu")
        self.num_slots, self.max_seq = inner.num_slots, inner.max_seq
        self.max_tokens, self.max_segments = inner.max_tokens, inner.max_segments
        if hasattr(inner, "vocab_size"):
            self.vocab_size = inner.vocab_size
        self.capacity = _capacity(inner)
        self.closed = False

    def run(self, batch: StepBatch) -> list[int]:
        if self.closed:
            raise RuntimeError("the followers were told to stop: this LeaderExecutor is closed")
        dist.broadcast(encode_batch(batch, self.capacity).to(self.device), self.src, group=self.group)
        return self.inner.run(batch)

    def describe(self) -> dict:
        return {**self.inner.describe(), "tensor_parallel": {
            "world_size": dist.get_world_size(self.group), "src": self.src}}

    def close(self) -> None:
        """Tell every follower to stop (once; later calls do nothing)."""
        if not self.closed:
            self.closed = True
            dist.broadcast(encode_batch(None, self.capacity).to(self.device), self.src,
                           group=self.group)

    def __enter__(self) -> LeaderExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def follow(inner: StepExecutor, group: Any = None, src: int = 0,
           device: torch.device | str | None = None) -> int:
    """A non-scheduling rank: run every batch rank ``src`` broadcasts on ``inner`` until the
    stop message; returns how many steps ran. ``inner`` must have the leader's limits
    (``max_segments``, ``max_tokens``: they size the broadcast)."""
    buf = torch.zeros(_capacity(inner), dtype=torch.int64, device=torch.device(device or "cpu"))
    steps = 0
    while True:
        dist.broadcast(buf, src, group=group)
        batch = decode_batch(buf.cpu())
        if batch is None:
            return steps
        inner.run(batch)
        steps += 1
