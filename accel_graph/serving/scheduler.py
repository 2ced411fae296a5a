"""The continuous-batching policy: which requests feed which tokens in the next step.

One :class:`Scheduler` serves both the eager and the graph engine (it never sees a model).
Each step, under a token budget and a segment limit:

1. **decode first**: every running request that has finished its prompt feeds its last
   generated token (one token, sampled), oldest admission first, so time per output token
   does not grow with the prompts arriving behind it;
2. **then prefill chunks**: requests admitted but not done with their prompt continue it,
   oldest first, each chunk as large as the budget left allows (chunked prefill); only a
   prompt's last chunk is sampled;
3. **then admission**: waiting requests (first come, first served) are given a free KV slot and
   their first chunk while budget, segments and slots last.

A request holds its slot from admission to finish; a slot is never given to two live requests.
The work per step is one pass over the live requests (scheduling); tensors are the executor's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .requests import Request, RequestResult
from .step import Segment, StepBatch

__all__ = ["Live", "Scheduler"]


@dataclass(eq=False)  # identity: two live requests are never "equal"
class Live:
    """A request admitted to a slot. ``fed`` counts its tokens already written to the cache
    (prompt first, then generated tokens fed back)."""

    request: Request
    slot: int
    result: RequestResult
    fed: int = 0
    order: int = 0  # admission order: the scheduler's tie-break
    out: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt)


class Scheduler:
    """Slots, the waiting queue and the step policy (module docstring).

    Args:
        num_slots: KV slots (the executor's ``num_slots``).
        token_budget: most tokens per step (at most the executor's ``max_tokens``).
        max_segments: most segments per step (at most the executor's ``max_segments``).
    """

    def __init__(self, num_slots: int, token_budget: int, max_segments: int) -> None:
        self.num_slots = num_slots
        self.token_budget = token_budget
        self.max_segments = max_segments
        self.waiting: deque[tuple[Request, RequestResult]] = deque()
        self.live: list[Live] = []  # in admission order
        # Lowest free slot first, so a light load uses few slots (and reads the same cache rows).
        self._free = list(range(num_slots - 1, -1, -1))
        self._admitted = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def next_batch(self) -> tuple[StepBatch, list[Live]] | None:
        """The next step's batch and the live request of each segment (same order), or None
        when nothing waits and nothing runs. Admits waiting requests (assigns their slots)."""
        budget, segs, owners = self.token_budget, [], []
        for lv in self.live:  # 1. decode
            if len(segs) == self.max_segments or budget == 0:
                break
            if not lv.prefilling:
                segs.append(Segment(lv.slot, lv.fed, (lv.out[-1],), True))
                owners.append(lv)
                budget -= 1
        for lv in self.live:  # 2. continue prompts
            if len(segs) == self.max_segments or budget == 0:
                break
            if lv.prefilling:
                budget -= self._chunk(lv, budget, segs, owners)
        while (self.waiting and self._free and budget > 0  # 3. admit
               and len(segs) < self.max_segments):
            request, result = self.waiting.popleft()
            lv = Live(request, self._free.pop(), result, order=self._admitted)
            self._admitted += 1
            self.live.append(lv)
            budget -= self._chunk(lv, budget, segs, owners)
        if not segs:
            return None
        return StepBatch(tuple(segs)), owners

    @staticmethod
    def _chunk(lv: Live, budget: int, segs: list[Segment], owners: list[Live]) -> int:
        prompt = lv.request.prompt
        n = min(len(prompt) - lv.fed, budget)
        segs.append(Segment(lv.slot, lv.fed, prompt[lv.fed:lv.fed + n], lv.fed + n == len(prompt)))
        owners.append(lv)
        return n

    def complete(self, batch: StepBatch, owners: list[Live], tokens: list[int],
                 now: float) -> list[RequestResult]:
        """Apply a step's sampled ``tokens`` (one per ``sample=True`` segment, in order), stamp
        them ``now``, finish requests on EOS or length and free their slots; returns the results
        of the requests finished by this step."""
        it = iter(tokens)
        finished: list[RequestResult] = []
        for seg, lv in zip(batch.segments, owners):
            lv.fed += len(seg.tokens)
            if not seg.sample:
                continue
            tok = next(it)
            lv.out.append(tok)
            res = lv.result
            res.token_times.append(now)
            if tok == lv.request.eos_id:
                res.finish_reason = "eos"
            elif len(lv.out) >= lv.request.max_new_tokens:
                res.finish_reason = "length"
            else:
                continue
            finished.append(self._release(lv))
        return finished

    def fail(self, owners: list[Live], reason: str) -> list[RequestResult]:
        """End every request of a failed step with ``"error"`` and free their slots (their
        cache rows may be half written; a slot's next owner overwrites from position 0)."""
        finished = []
        for lv in dict.fromkeys(owners):  # a request appears once per step, but be sure
            if lv in self.live:
                lv.result.finish_reason, lv.result.error = "error", reason
                finished.append(self._release(lv))
        return finished

    def _release(self, lv: Live) -> RequestResult:
        self.live.remove(lv)
        self._free.append(lv.slot)
        self._free.sort(reverse=True)
        lv.result.tokens = lv.out
        return lv.result
