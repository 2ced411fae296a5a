"""What one serving step is, and what runs it: the contract between the engine and executors.

The continuous-batching engine decides, each step, which requests feed which
tokens; an executor runs that step on a model, eagerly or from captured
graphs, and returns the greedy next token of every request that samples. The two meet only
here, so a scheduler change never touches a model and a new executor never touches the
scheduler.

A step is a flat batch: the tokens of all its segments laid end to end (``[num_tokens]``), as
vLLM and SGLang lay out a mixed prefill/decode step. Each :class:`Segment` is one request's share
of the step: a chunk of its prompt (chunked prefill) or its one decode token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Segment", "StepBatch", "StepExecutor"]


@dataclass(frozen=True)
class Segment:
    """One request's tokens in a step.

    Attributes:
        slot: the request's KV-cache slot (``0 <= slot < executor.num_slots``); the engine
            owns slot assignment and never gives one slot to two live requests.
        start: how many of the request's tokens are already in the cache, i.e. the position
            of ``tokens[0]`` in the request's sequence.
        tokens: the token ids fed this step (at positions ``start .. start+len-1``); at least
            one. ``start + len(tokens) <= executor.max_seq``.
        sample: whether the logits of the segment's last token are sampled this step (the last
            chunk of a prompt, or a decode token); False for an earlier prefill chunk.
    """

    slot: int
    start: int
    tokens: tuple[int, ...]
    sample: bool


@dataclass(frozen=True)
class StepBatch:
    """The segments of one step, in the flat order their tokens are laid out."""

    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.segments if s.sample)


@runtime_checkable
class StepExecutor(Protocol):
    """Runs steps on a model with a slot KV cache. Eager and graph executors give the same
    tokens for the same steps: a request's tokens equal those of the model run alone on it.

    Attributes:
        num_slots: how many requests the KV cache holds at once.
        max_seq: the most tokens (prompt and generated) one request may have.
        max_tokens: the most tokens one step may carry (the engine's per-step token budget
            may not exceed it).
        max_segments: the most segments one step may carry.
    """

    num_slots: int
    max_seq: int
    max_tokens: int
    max_segments: int

    def run(self, batch: StepBatch) -> list[int]:
        """Run one step; return the greedy next token of each segment with ``sample=True``,
        in segment order (one host read per step). Writes each segment's keys and values into
        its slot at its positions; touches no other slot, and no position of its slot at or
        after ``start + len(tokens)``."""
        ...

    def describe(self) -> dict:
        """JSON-ready facts for reports: kind ("eager"/"graph"), buckets, compile mode,
        bucket use counts, eager fallbacks, pool bytes (where known)."""
        ...
