"""Evaluating configurations for :func:`~.search.tune`: one (config, policy) pair is one
:func:`~accel_graph.allocator.sim.scenario.simulate` call (one C replay), run in this process or,
with ``jobs`` > 1, in a fork pool whose workers each hold the trace once.

:class:`Evaluator` keeps the conversion cache (``ops_cache``) of the one unchanging trace a
search works on, and reports progress after every configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..sim import profiles as _profiles
from ..sim.scenario import make_scenario, simulate
from .space import SearchSpace

__all__ = ["Evaluator", "evaluate_one"]

#: The fork pool worker's copy of the search's fixed inputs (set by ``_worker_init``).
_WORKER: dict[str, Any] = {}


def evaluate_one(trace: Any, config: str | None, policy: str, profile: _profiles.Profile,
                  cap: int | None, device: int,
                  ops_cache: dict[Any, Any] | None = None) -> dict[str, Any]:
    sc = make_scenario(trace, config, policy=policy, profile=profile, cap=cap, device=device)
    r = simulate(trace, sc, device=device, ops_cache=ops_cache)
    return {**r.figures(), "notes": tuple(sc.notes) + tuple(r.notes)}


def _worker_init(trace: Any, profile: _profiles.Profile, cap: int | None, device: int) -> None:
    _WORKER.update(trace=trace, profile=profile, cap=cap, device=device, ops={})


def _worker_eval(job: tuple[str, str]) -> dict[str, Any]:
    w = _WORKER
    return evaluate_one(w["trace"], job[0], job[1], w["profile"], w["cap"], w["device"],
                         w["ops"])


class Evaluator:
    """Evaluates batches of (config, policy), in this process or in a fork pool."""

    def __init__(self, trace: Any, space: SearchSpace, device: int, jobs: int,
                 progress: Callable[[int, int], None] | None, total: int) -> None:
        self.trace, self.space, self.device = trace, space, device
        #: one search, one unchanging trace: each distinct conversion is made once
        self.ops_cache: dict[Any, Any] = {}
        self.progress, self.total, self.done = progress, total, 0
        self.pool = None
        if jobs > 1:
            # multiprocessing only when a pool is asked for (start-up time of the common case)
            import multiprocessing as mp

            methods = mp.get_all_start_methods()
            ctx = mp.get_context("fork" if "fork" in methods else None)
            self.pool = ctx.Pool(jobs, initializer=_worker_init,
                                 initargs=(trace, space.profile, space.cap, device))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None

    def run(self, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        if self.pool is not None and len(jobs) > 1:
            out = []
            for r in self.pool.imap(_worker_eval, jobs, chunksize=max(1, len(jobs) // 32)):
                out.append(r)
                self._tick()
            return out
        out = []
        for cfg, pol in jobs:
            out.append(evaluate_one(self.trace, cfg, pol, self.space.profile, self.space.cap,
                                     self.device, self.ops_cache))
            self._tick()
        return out

    def _tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.total = max(self.total, self.done)
            self.progress(self.done, self.total)
