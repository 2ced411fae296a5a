"""``Engine``: a continuous-batching server loop over a :class:`~.step.StepExecutor`.

The engine owns requests, the bounded queue, the clock and the failure rules; the
:class:`~.scheduler.Scheduler` decides each step; the executor runs it (eagerly, or from
graphs). The eager and the graph engine are the same class with a different executor, so a
comparison between them measures the executor, not two schedulers.

Back-pressure: :meth:`Engine.submit` never blocks and never grows the queue past ``max_queue``;
it raises :class:`~.requests.QueueFull` and the caller retries after a step (:meth:`Engine.run`,
the simulated client, keeps such requests on its side and retries them each step, their wait
counted in their time to first token).

Failure rules: a request with bad input is refused at :meth:`~Engine.submit` with
:class:`~.requests.InvalidRequest` (in :meth:`~Engine.run`: a ``"rejected"`` result with the
reason), and the others are served. A step whose executor raises is run again on the
``fallback`` executor (eager, on the same model and KV cache), the reason logged once; with no
fallback, or if the fallback fails too, that step's requests end with ``"error"`` and the
others go on. No request is ever dropped without a result.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigError
from .engine_memory import KVCacheSizing, size_kv_cache
from .requests import InvalidRequest, QueueFull, Request, RequestResult
from .scheduler import Live, Scheduler
from .step import StepBatch, StepExecutor

__all__ = ["Engine", "EngineRun"]

logger = logging.getLogger("accel_graph")


class EngineRun:
    """What :meth:`Engine.run` returns: every request's result (in input order), the wall time
    from the run's start to its last token, and the engine's step statistics."""

    def __init__(self, results: list[RequestResult], elapsed_s: float, stats: dict[str, Any]) -> None:
        self.results, self.elapsed_s, self.stats = results, elapsed_s, stats


class Engine:
    """Continuous batching over ``executor`` (module docstring).

    Args:
        executor: runs the steps (``EagerExecutor``, ``GraphExecutor``, a TP wrapper, ...).
        max_queue: most requests waiting for a slot; :meth:`submit` raises ``QueueFull`` past it.
        token_budget: most tokens per step (prefill chunks and decode tokens together);
            default and cap ``executor.max_tokens``.
        max_segments: most requests per step; default and cap ``executor.max_segments``.
        fallback: an executor on the same model and cache that serves a step the executor
            failed (eager); None: such a step's requests end with ``"error"``.
        max_prompt: the longest prompt accepted (default ``executor.max_seq``).
        vocab_size: when given (default: the executor's ``vocab_size`` attribute, if any),
            prompt token ids outside ``0..vocab_size-1`` are refused at submission.
        clock: seconds, monotonic (``time.perf_counter``); tests pass a fake one.
    """

    def __init__(self, executor: StepExecutor, *, max_queue: int = 1024,
                 token_budget: int | None = None, max_segments: int | None = None,
                 fallback: StepExecutor | None = None, max_prompt: int | None = None,
                 vocab_size: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        for name in ("num_slots", "max_seq", "max_tokens", "max_segments"):
            value = getattr(executor, name, None)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"the executor's {name} must be a positive int, got {value!r}: pass a "
                    f"StepExecutor (accel_graph.serving.step)")
        self.executor, self.fallback, self.clock = executor, fallback, clock
        self.max_queue = _positive("max_queue", max_queue)
        budget = _capped("token_budget", token_budget, executor.max_tokens)
        segments = _capped("max_segments", max_segments, executor.max_segments)
        self.max_prompt = _capped("max_prompt", max_prompt, executor.max_seq)
        self.vocab_size = vocab_size if vocab_size is not None else getattr(executor, "vocab_size", None)
        self.scheduler = Scheduler(executor.num_slots, budget, segments)
        self.steps = 0
        self.step_tokens = 0
        self.fallback_steps = 0
        self.fallback_reason: str | None = None
        self.failed_steps = 0
        #: How the KV cache was sized (:meth:`from_memory_budget`); None when not from a budget.
        self.kv_cache: KVCacheSizing | None = None

    @classmethod
    def from_memory_budget(cls, build: Callable[..., StepExecutor], budget_bytes: int, *,
                           max_slots: int | None = None, **engine_kwargs: Any) -> Engine:
        """An engine whose executor's KV cache takes the memory ``budget_bytes`` leaves after
        weights, the graph pool (planned, or measured after capture) and the warm-up peak;
        ``build(num_slots, capture=bool)`` makes the executor
        (:func:`~.engine_memory.size_kv_cache`). The sizing is in ``engine.kv_cache``."""
        executor, sizing = size_kv_cache(build, budget_bytes, max_slots=max_slots)
        engine = cls(executor, **engine_kwargs)
        engine.kv_cache = sizing
        return engine

    # -- admission ----------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise :class:`InvalidRequest` (saying what to change) if ``request`` cannot be
        served by this engine; return None if it can."""
        prompt, k = request.prompt, request.max_new_tokens
        if not prompt:
            raise InvalidRequest(f"request {request.id!r}: the prompt is empty; give at least one token")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidRequest(
                f"request {request.id!r}: max_new_tokens must be an int >= 1, got {k!r}")
        if len(prompt) > self.max_prompt:
            raise InvalidRequest(
                f"request {request.id!r}: prompt of {len(prompt)} tokens is longer than the "
                f"engine's maximum {self.max_prompt} (KV cache max_seq={self.executor.max_seq}); "
                f"shorten it or build the executor with a larger max_seq")
        # The last generated token is never fed back, so the cache holds prompt + k - 1.
        if len(prompt) + k - 1 > self.executor.max_seq:
            raise InvalidRequest(
                f"request {request.id!r}: prompt of {len(prompt)} tokens + max_new_tokens={k} "
                f"needs {len(prompt) + k - 1} cache positions, the KV cache has "
                f"max_seq={self.executor.max_seq}; ask for at most "
                f"{self.executor.max_seq - len(prompt) + 1} new tokens")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise InvalidRequest(f"request {request.id!r}: prompt token ids must be ints")
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise InvalidRequest(
                f"request {request.id!r}: token id {bad} is outside the vocabulary "
                f"0..{self.vocab_size - 1}")
        if request.eos_id is not None and (isinstance(request.eos_id, bool)
                                           or not isinstance(request.eos_id, int)):
            raise InvalidRequest(f"request {request.id!r}: eos_id must be an int or None")

    def submit(self, request: Request, *, arrival: float | None = None) -> RequestResult:
        """Queue ``request``; returns its result object, filled in as it is served (its
        ``finish_reason`` is set when it ends). ``arrival`` (the engine's clock; default now)
        is where its time to first token starts.

        Raises:
            InvalidRequest: bad input (nothing is queued; other requests are untouched).
            QueueFull: ``max_queue`` requests already wait; retry after :meth:`step`.
        """
        self.check(request)
        if len(self.scheduler.waiting) >= self.max_queue:
            raise QueueFull(
                f"the request queue is full ({self.max_queue} waiting): retry after a step, or "
                f"build the Engine with a larger max_queue")
        result = RequestResult(request.id, prompt_len=len(request.prompt),
                               arrival=self.clock() if arrival is None else arrival)
        self.scheduler.waiting.append((request, result))
        return result

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        """Whether a request waits or runs."""
        return self.scheduler.has_work()

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestResult]:
        """Schedule and run one step; returns the results of the requests it finished (empty
        when there was nothing to do)."""
        planned = self.scheduler.next_batch()
        if planned is None:
            return []
        batch, owners = planned
        tokens = self._run(batch, owners)
        if tokens is None:  # failed without a fallback: the step's requests end with "error"
            return self.scheduler.fail(owners, self.fallback_reason or "step failed")
        self.steps += 1
        self.step_tokens += batch.num_tokens
        return self.scheduler.complete(batch, owners, tokens, self.clock())

    def _run(self, batch: StepBatch, owners: list[Live]) -> list[int] | None:
        try:
            return self._checked(self.executor, batch)
        except Exception as exc:  # any executor failure: the step is served eagerly or ends
            reason = f"{type(exc).__name__}: {exc}"
        if self.fallback is None:
            self.failed_steps += 1
            logger.warning("serving: step of %d requests failed and there is no fallback "
                           "executor; they end with 'error': %s", len(owners), reason)
            self.fallback_reason = reason
            return None
        if self.fallback_steps == 0:  # once per engine: a failing graph path fails every step
            logger.warning("serving: a step failed in the graph path, serving it (and any "
                           "later failing step) eagerly: %s", reason)
            self.fallback_reason = reason
        self.fallback_steps += 1
        try:
            return self._checked(self.fallback, batch)
        except Exception as exc:
            self.failed_steps += 1
            self.fallback_reason = f"{reason}; the fallback failed too: {type(exc).__name__}: {exc}"
            logger.warning("serving: the eager fallback failed as well; the step's %d "
                           "requests end with 'error': %s", len(owners), self.fallback_reason)
            return None

    @staticmethod
    def _checked(executor: StepExecutor, batch: StepBatch) -> list[int]:
        tokens = executor.run(batch)
        if len(tokens) != batch.num_samples:  # a wrong count would shift tokens between requests
            raise RuntimeError(f"the executor returned {len(tokens)} tokens for "
                               f"{batch.num_samples} sampled segments")
        return [int(t) for t in tokens]

    # -- a simulated client -------------------------------------------------------------------

    def run(self, requests: Iterable[Request],
            progress: Callable[[int, int], None] | None = None) -> EngineRun:
        """Serve ``requests`` as a client would send them: each is submitted once the engine's
        wall clock passes its ``arrival`` (seconds after this call starts), the engine idles
        (sleeps) until the next arrival when it has nothing to do, and a request meeting a full
        queue waits on the client side and is retried each step. Bad requests get a
        ``"rejected"`` result with the reason. ``progress(done, total)`` is called as requests
        finish. Returns every result in input order.
        """
        reqs = [r if r.id is not None else _with_id(r, i) for i, r in enumerate(requests)]
        results: dict[int, RequestResult] = {}
        pending = deque(sorted(range(len(reqs)), key=lambda i: reqs[i].arrival))
        live: dict[int, RequestResult] = {}
        t0 = self.clock()
        steps0, fb0 = self.steps, self.fallback_steps
        done = 0
        while pending or live:
            now = self.clock()
            while pending and t0 + reqs[pending[0]].arrival <= now:
                i = pending[0]
                try:
                    live[i] = self.submit(reqs[i], arrival=t0 + reqs[i].arrival)
                except QueueFull:
                    break  # the client keeps it and retries after the next step
                except InvalidRequest as exc:
                    results[i] = RequestResult(reqs[i].id, finish_reason="rejected",
                                               prompt_len=len(reqs[i].prompt),
                                               arrival=t0 + reqs[i].arrival, error=str(exc))
                pending.popleft()
            if not self.has_work():
                if pending:  # idle: wait for the next arrival on the wall clock
                    time.sleep(max(0.0, t0 + reqs[pending[0]].arrival - self.clock()))
                continue
            self.step()
            for i in [i for i, r in live.items() if r.finish_reason is not None]:
                results[i] = live.pop(i)
            if progress is not None and len(results) != done:
                done = len(results)
                progress(done, len(reqs))
        last = max((r.token_times[-1] for r in results.values() if r.token_times), default=t0)
        for r in results.values():  # times relative to the run's start
            r.arrival -= t0
            r.token_times = [t - t0 for t in r.token_times]
        stats = {"steps": self.steps - steps0, "fallback_steps": self.fallback_steps - fb0}
        return EngineRun([results[i] for i in range(len(reqs))], max(last - t0, 0.0), stats)


def _with_id(request: Request, index: int) -> Request:
    return Request(request.prompt, request.max_new_tokens, request.eos_id, request.arrival, index)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _capped(name: str, value: int | None, cap: int) -> int:
    if value is None:
        return cap
    value = _positive(name, value)
    if value > cap:
        raise ConfigError(f"{name}={value} exceeds the executor's limit {cap}")
    return value
