"""``compile_options={"replay": "auto"}``: keep whichever of the compiled and the interpreted
program replays a graph faster, without changing anything the user can observe.

Both programs have the same semantics (compiled results are float-close to interpreted ones,
not bitwise equal: Inductor fuses and reorders arithmetic), but a replay is not free of effects:
it may write captured inputs in place (a KV cache, an optimizer step, batch-norm running
statistics), draw random numbers (advancing a generator), run collectives (the other ranks
would wait for, or receive, a stray all_reduce) or write pool memory that another graph of a
shared pool now uses. Timing extra runs of such a program would be a silent wrong result. So:

- At instantiation, both programs are timed only when the program provably has none of these
  effects (:func:`instantiation_hazard`): every write lands in memory this capture allocated,
  no op is random, a collective, a host call, control flow, a side-effecting or non-aten op,
  and the graph is the only one in its pool with no capture underway. Even then the runs write
  the graph's static outputs: their bytes are saved before and put back after
  (:func:`time_programs`), so outputs read before the first replay (NaN poison in debug mode)
  are unchanged. The time spent is bounded (:func:`timing_budget`).
- A program with collectives replays compiled, untimed: ranks that chose differently would run
  float-close programs, and data-parallel replicas would drift apart.
- Any other program decides on its first real replays (:class:`ReplayDecider`): each of them
  is run by one of the two programs, in turn, and timed; after the last, the faster program
  replays from then on. Each of those replays is exactly one replay the user asked for, so
  inputs, generators and pool memory change exactly as they would under either program.
"""

from __future__ import annotations

import bisect
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from ...base import ReplayMode
from .. import rng
from ..capture import Step
from ..pool_protocol import PoolRef, storage_bytes
from ..pytree import tree_flatten

#: Share of the compile time that timing at instantiation may take, and its floor and cap
#: (seconds): a cache hit compiles in milliseconds but still gets the floor, enough for a few
#: rounds of a 10 ms program (a smaller one left convnets at batch 4 to the real replays).
TIMING_FRACTION = 0.05
TIMING_MIN_S = 0.2
TIMING_MAX_S = 1.0
#: Timed runs of each program at instantiation at most (after one untimed warm-up each), and
#: at least: fewer fit in the budget, and the decision moves to the first real replays.
MAX_ROUNDS = 15
MIN_ROUNDS = 3
#: Real replays timed per program when the decision is made on them (after one warm-up each):
#: 3 let a loaded machine pick the slower program (medians of 3 runs hit by preemption).
REPLAY_ROUNDS = 5

# FX's list of side-effecting targets (``_assert_async``, ``_print``, profiler ranges): a run
# of such an op is observable even when it writes no tensor. Read once, feature-detected.
_SIDE_EFFECTS: frozenset[Any] = frozenset(getattr(torch.fx.node, "_side_effectful_functions", ()))
_PURE_NAMESPACES = ("aten", "prims")


def not_instantiated(compile: str | None, reset: bool = False) -> ReplayMode:
    """The mode of a graph not instantiated yet (``reset``: emptied by ``reset()``)."""
    if compile is None:
        return ReplayMode("interpreted", "compile=None: the recorded program replays as captured")
    if reset:
        return ReplayMode("undecided", "reset: nothing captured; the program is chosen when a "
                          "new capture is instantiated")
    return ReplayMode("undecided", "not instantiated yet: the program is chosen at instantiation")


def run_as_replay(fn: Callable[[], None]) -> None:
    """Run ``fn`` as the recorder's ``replay()`` runs its replay function: under inference mode,
    with any dispatch mode the caller has open disabled (never re-recorded)."""
    if torch._C._len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch._C._InferenceMode(True):
            fn()
        return
    with torch._C._InferenceMode(True):
        fn()


def timing_budget(compile_s: float) -> float:
    """Seconds timing at instantiation may take after a compile of ``compile_s`` seconds."""
    return min(TIMING_MAX_S, max(TIMING_MIN_S, TIMING_FRACTION * compile_s))


class Extents:
    """A union of byte ranges per pool segment (sorted, disjoint, merged on insert): memory a
    program was given, queried in logarithmic time (programs have thousands of steps)."""

    def __init__(self) -> None:
        self._spans: dict[int, tuple[list[int], list[int]]] = {}

    @staticmethod
    def span(ref: PoolRef) -> tuple[int, int, int]:
        return ref.segment, ref.byte_offset, ref.byte_offset + storage_bytes(
            ref.shape, ref.stride, ref.dtype.itemsize)

    def add(self, ref: PoolRef) -> None:
        seg, lo, hi = self.span(ref)
        if hi <= lo:
            return
        starts, ends = self._spans.setdefault(seg, ([], []))
        i = bisect.bisect_left(ends, lo)  # first span that ends at or after lo: merge from it
        j = bisect.bisect_right(starts, hi)  # spans before j start at or before hi
        if i < j:
            lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
        starts[i:j], ends[i:j] = [lo], [hi]

    def covers(self, ref: PoolRef) -> bool:
        seg, lo, hi = self.span(ref)
        if hi <= lo:
            return True
        starts, ends = self._spans.get(seg, ((), ()))
        i = bisect.bisect_right(starts, lo) - 1
        return i >= 0 and ends[i] >= hi

    def overlaps(self, ref: PoolRef) -> bool:
        seg, lo, hi = self.span(ref)
        starts, ends = self._spans.get(seg, ((), ()))
        i = bisect.bisect_right(ends, lo)  # first span ending after lo
        return hi > lo and i < len(starts) and starts[i] < hi


def written_args(step: Step) -> list[Any]:
    """The arguments a step's op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    out: list[Any] = []
    for i, arg in enumerate(step.func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = step.args[i] if i < len(step.args) else step.kwargs.get(arg.name)
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return [v for v in out if v is not None]


def _allocations(step: Step) -> list[Any]:
    """What a step allocates: the outputs of a functional op (views and in-place ops none)."""
    return [] if step.kind in ("view", "mutate") else list(step.outputs)


def instantiation_hazard(steps: list[Step]) -> str | None:
    """Why running the captured program (``steps`` as captured, with pool locations) outside a
    replay the user asked for could be observed, or None when it provably cannot: every write
    lands in memory this program allocated before it, no pool memory it reads before writing
    (an earlier graph's) is memory it later writes, and no step is random, a collective, a host
    call, control flow, a side-effecting op or an op outside aten/prims (a custom op may do
    anything). The caller also checks that no other graph shares the pool."""
    everything = Extents()  # all memory the program allocates, at any step
    for step in steps:
        for out in _allocations(step):
            if isinstance(out, PoolRef):
                everything.add(out)
    allocated = Extents()  # memory allocated before the step at hand
    for step in steps:
        if step.kind == "collective":
            return f"it runs collectives ({step.func})"
        if step.kind in ("host", "cond", "while") or not isinstance(step.func, OpOverload):
            return f"it has a host step ({step.func}): generator state or control flow"
        func = step.func
        if step.kind == "random" or torch.Tag.nondeterministic_seeded in func.tags or rng.generator_params(func):
            return f"it draws random numbers ({func})"
        if func in _SIDE_EFFECTS or func.namespace not in _PURE_NAMESPACES:
            return f"{func} may have effects beyond the tensors it writes"
        for target in written_args(step):
            if not (isinstance(target, PoolRef) and allocated.covers(target)):
                return (f"{func} writes memory the program did not allocate (a tensor captured "
                        f"by reference, or pool memory of another graph)")
        for x in tree_flatten((step.args, step.kwargs, step.extra))[0]:
            if isinstance(x, PoolRef) and not allocated.covers(x) and everything.overlaps(x):
                return (f"{func} reads pool memory of an earlier graph that the program later "
                        f"overwrites (an extra run would change what the next replay reads)")
        for out in _allocations(step):
            if not isinstance(out, PoolRef):
                return f"{func} writes a tensor outside the pool"
            allocated.add(out)
    return None


def time_programs(compiled: Callable[[], None], interpreted: Callable[[], None],
                  run: Callable[[Callable[[], None]], None], outputs: list[torch.Tensor],
                  budget_s: float) -> tuple[float, float, int] | None:
    """Time both programs in interleaved rounds (the order alternating, so neither always runs
    on the other's warm caches) and return ``(compiled median s, interpreted median s,
    rounds)``; None when :data:`MIN_ROUNDS` rounds do not fit in ``budget_s`` after one warm-up
    run of each (the caller then decides on real replays). ``run(fn)`` runs one program as a
    replay would (inference mode, no dispatch mode). The bytes of ``outputs`` (the graph's
    static outputs, which both programs write) are saved first and put back before returning,
    also when a run raises (the exception propagates). Spends about ``budget_s`` at most,
    plus one run of each program."""
    saved = [t.clone() for t in outputs]
    try:
        start = time.perf_counter()
        run(compiled)  # warm-ups: first calls load kernels and fill caches
        if time.perf_counter() - start > budget_s / 4:
            return None
        run(interpreted)
        warm = time.perf_counter() - start
        if warm * (1 + MIN_ROUNDS) > budget_s:
            return None
        times: tuple[list[float], list[float]] = ([], [])
        programs = (compiled, interpreted)
        for r in range(MAX_ROUNDS):
            if r >= MIN_ROUNDS and time.perf_counter() - start + warm > budget_s:
                break
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                run(programs[k])
                times[k].append(time.perf_counter() - t0)
        return statistics.median(times[0]), statistics.median(times[1]), len(times[0])
    finally:
        for t, s in zip(outputs, saved):
            t.copy_(s)


def verdict(compiled_s: float, interpreted_s: float, rounds: int, where: str) -> ReplayMode:
    """The mode timing chose: compiled unless interpreted was faster (ties keep compiled)."""
    mode = "compiled" if compiled_s <= interpreted_s else "interpreted"
    return ReplayMode(
        mode,
        f"{mode} replay measured faster: median {compiled_s * 1e3:.3f} ms compiled, "
        f"{interpreted_s * 1e3:.3f} ms interpreted ({rounds} interleaved run(s) each, {where})",
        compiled_s, interpreted_s, rounds,
        "instantiate" if where == "at instantiation" else "replay")


class ReplayDecider:
    """The replay function while the first real replays decide (module docstring): replay
    ``2 * (1 + rounds)`` runs the two programs in turn, the first of each untimed; after the
    last, ``owner.settle_replay(self, winner, mode)`` is called once. ``owner`` (the graph) is
    held weakly, so a graph never decided on is freed by reference counting."""

    __slots__ = ("_programs", "_times", "_n", "_total", "_owner", "why")

    def __init__(self, owner: Any, compiled: Callable[[], None], interpreted: Callable[[], None],
                 why: str, rounds: int = REPLAY_ROUNDS) -> None:
        self._programs = (compiled, interpreted)
        self._times: tuple[list[float], list[float]] = ([], [])
        self._n = 0
        self._total = 2 * (1 + rounds)
        self._owner = weakref.ref(owner)
        #: Why the decision is made on real replays (kept in the mode's reason).
        self.why = why

    @property
    def remaining(self) -> int:
        """Replays left before the decision."""
        return self._total - self._n

    def __call__(self) -> None:
        k = self._n % 2
        t0 = time.perf_counter()
        self._programs[k]()  # a replay that raises is not counted: the next runs the same program
        dt = time.perf_counter() - t0
        if self._n >= 2:
            self._times[k].append(dt)
        self._n += 1
        if self._n == self._total:
            c, i = statistics.median(self._times[0]), statistics.median(self._times[1])
            mode = verdict(c, i, len(self._times[0]), "on the first real replays")
            owner = self._owner()
            if owner is not None:
                owner.settle_replay(self, self._programs[0 if mode.mode == "compiled" else 1], mode)
