"""FAKE step executors for the serving engine's tests: plumbing only, no model, no tensors.

:class:`FakeStepExecutor` keeps a per-slot token "cache" and returns, for each sampled segment,
a deterministic function of the request's sequence read back from that cache (the prompt and
the tokens fed so far). It checks the step contract on every call (slots, positions, limits,
nothing read that was not written), so a scheduler that feeds a wrong position, mixes two
requests' slots or skips a chunk gives wrong tokens or an assertion, as a real model would give
wrong tokens. It says nothing about any model's numerics.
"""

from __future__ import annotations

from accel_graph.serving.step import StepBatch, StepExecutor


def fake_next_token(seq: list[int] | tuple[int, ...], vocab_size: int) -> int:
    """The fake model: a rolling hash of the whole sequence, so any wrong or missing token
    before the sampled position changes the answer."""
    h = 17
    for t in seq:
        h = (h * 31 + t + 7) % 1_000_003
    return h % vocab_size


def fake_reference(prompt: list[int] | tuple[int, ...], max_new_tokens: int, eos_id: int | None,
                   vocab_size: int) -> list[int]:
    """The tokens the fake model gives a request run alone (greedy, stop on EOS or length)."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = fake_next_token(seq, vocab_size)
        out.append(tok)
        seq.append(tok)
        if tok == eos_id:
            break
    return out


class FakeStepExecutor:
    """A FAKE :class:`~accel_graph.serving.step.StepExecutor` (module docstring)."""

    def __init__(self, num_slots: int = 4, max_seq: int = 64, max_tokens: int = 16,
                 max_segments: int = 8, vocab_size: int = 97) -> None:
        self.num_slots, self.max_seq = num_slots, max_seq
        self.max_tokens, self.max_segments, self.vocab_size = max_tokens, max_segments, vocab_size
        self.cache = [[-1] * max_seq for _ in range(num_slots)]
        self.batches: list[StepBatch] = []

    def run(self, batch: StepBatch) -> list[int]:
        assert 1 <= len(batch.segments) <= self.max_segments, batch
        assert batch.num_tokens <= self.max_tokens, batch
        slots = [s.slot for s in batch.segments]
        assert len(set(slots)) == len(slots), f"one slot twice in a step: {batch}"
        out = []
        for seg in batch.segments:
            assert 0 <= seg.slot < self.num_slots and seg.tokens, seg
            assert seg.start + len(seg.tokens) <= self.max_seq, seg
            row = self.cache[seg.slot]
            if seg.start == 0:  # a new request in this slot: forget the last owner's tokens
                row[:] = [-1] * self.max_seq
            assert all(t >= 0 for t in row[:seg.start]), f"reads unwritten positions: {seg}"
            row[seg.start:seg.start + len(seg.tokens)] = seg.tokens
            if seg.sample:
                out.append(fake_next_token(row[:seg.start + len(seg.tokens)], self.vocab_size))
        self.batches.append(batch)
        return out

    def describe(self) -> dict:
        return {"kind": "fake", "steps": len(self.batches)}


class FailingFakeExecutor:
    """Wraps an executor and raises on chosen steps (counted from 0) before running them: a
    FAKE graph path that fails. ``fail_steps=None`` fails every step."""

    def __init__(self, inner: StepExecutor, fail_steps: set[int] | None = None) -> None:
        self.inner, self.fail_steps, self.calls = inner, fail_steps, 0
        for name in ("num_slots", "max_seq", "max_tokens", "max_segments", "vocab_size"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def run(self, batch: StepBatch) -> list[int]:
        n, self.calls = self.calls, self.calls + 1
        if self.fail_steps is None or n in self.fail_steps:
            raise RuntimeError(f"fake graph failure at step {n}")
        return self.inner.run(batch)

    def describe(self) -> dict:
        return {"kind": "failing-fake"}
