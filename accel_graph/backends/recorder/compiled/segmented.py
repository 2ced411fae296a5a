"""``compile="inductor"`` for programs with host steps (generator state, :mod:`..rng`; eager
islands, :mod:`..islands`) and for ops Inductor refuses (op islands, :mod:`.op_islands`).

A host step is a Python call between kernels (a generator snapshot or restore, an eager
island), which an FX graph cannot order against Inductor's kernels. Such a program is compiled
in stretches: each run of ops between host steps is one Inductor program
(:func:`.inductor.compile_program`), and the host steps run interpreted between them, so every
draw happens in the order eager makes it, on the generator state eager has at that point. An op
Inductor refuses (predicted, or named by a compile failure, or bisected: :mod:`.op_islands`)
becomes such a step too: it runs interpreted, its stretch is split around it, and the rest
compiles; only when nothing compiles does the graph fall back whole.

A stretch writes back into pool memory the graph's outputs it makes and every allocation that a
later stretch or host step reads (they read pool memory, not Inductor's buffers): one copy per
such tensor, which keeps the values equal to interpreted replay.
A stretch whose outputs reuse pool memory of tensors it reads from earlier stretches (they died
in it) is compiled like any other: :func:`.inductor.compile_program` gives the compiled program a
private copy of such a read, refreshed before each run (its placeholders would otherwise alias,
which AOT cannot trace with static shapes). Such stretches used to replay interpreted;
``interpreted_stretches`` stays in the info, empty.
Programs without host steps or refused ops compile as one program, unchanged. Control-flow
steps (``cond``, ``while``) sit between stretches like host steps, with each of their
sub-programs compiled in turn (:mod:`.control_flow`, which calls back into :func:`compile_any`
for nesting).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from ..pool_protocol import GraphPool, PoolRef, refs_overlap
from ..program import build_replay, materialize
from ..steps import InputRecord, Step
from .cache import merge_reuse
from .control_flow import (
    allocations,
    compile_control,
    pool_reads,
    reads,
    stage_reads_before_writes,
    with_snapshots,
)
from .failures import failure_reason
from .inductor import compile_program
from .op_islands import Budget, Refusal, locate, predict, splittable, summary

log = logging.getLogger("accel_graph")


#: Step kinds run interpreted between compiled stretches: generator-state calls (rng.py) and
#: control flow (control_flow.py: the predicate is read on the host at replay).
HOST_KINDS = ("host", "cond", "while")


def has_host_steps(steps: list[Step]) -> bool:
    return any(s.kind in HOST_KINDS for s in steps)


def compile_any(
    steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef], pool: GraphPool,
    compile_fn: Callable[..., tuple[Callable[[], None], dict[str, Any]]] = compile_program,
    outside: list[PoolRef] | None = None, budget: Budget | None = None,
) -> tuple[Callable[[], None], dict[str, Any]]:
    """Compile ``steps`` (as captured, with pool locations) with ``compile_fn``
    (:func:`.inductor.compile_program`, or the caller's replacement); raises on any failure
    that leaves nothing compiled, and returns ``(replay_fn, info)`` like it. Control-flow steps
    have each sub-program compiled (:mod:`.control_flow`; one that fails replays interpreted,
    logged, without failing the rest). Ops Inductor refuses replay interpreted between
    compiled stretches (:mod:`.op_islands`; ``info["interpreted_ops"]``), found spending at
    most ``budget``'s failed compiles (shared with sub-programs). ``outside``: for a
    sub-program, the pool locations read outside it."""
    budget = budget if budget is not None else Budget()
    if outside is None:  # the whole graph (sub-programs are staged by compile_control)
        steps, pairs = stage_reads_before_writes(steps, pool)
        if pairs:
            run, info = compile_any(steps, inputs, outputs, pool, compile_fn, [], budget)
            return with_snapshots(run, tuple(pairs)), {**info, "snapshots": len(pairs)}
    refused = predict(steps, pool)
    failure: BaseException | None = None
    if not has_host_steps(steps) and not refused:
        try:
            return compile_fn(steps, inputs, outputs, pool)
        except Exception as exc:
            if not splittable(exc) or not budget.spend():
                raise
            failure = exc
    return _Segments(steps, outputs, pool, compile_fn, outside, budget, refused).compile(failure)


class _Segments:
    """One program compiled in stretches between host steps and op islands (module docstring);
    :meth:`compile` returns ``(replay_fn, info)``."""

    def __init__(self, steps: list[Step], outputs: list[PoolRef], pool: GraphPool,
                 compile_fn: Callable[..., tuple[Callable[[], None], dict[str, Any]]],
                 outside: list[PoolRef] | None, budget: Budget, refused: dict[int, Refusal]) -> None:
        self.steps, self.outputs, self.pool, self.compile_fn = steps, outputs, pool, compile_fn
        self.outside, self.budget, self.islands = outside, budget, refused
        self.owners = _read_owners(steps)
        self.runs: list[Callable[[], None]] = []
        self.infos: list[dict[str, Any]] = []
        self.first: BaseException | None = None  # the first compile failure, if any

    def compile(self, failure: BaseException | None) -> tuple[Callable[[], None], dict[str, Any]]:
        """Compile every stretch; ``failure``: the whole program's compile already failed so
        (it has no host steps), locate from it first."""
        steps, pool = self.steps, self.pool
        self.first = failure
        around = [*(self.outside or ()), *self.outputs]
        budget, compile_fn = self.budget, self.compile_fn

        def compile_sub(sub: list[Step], written: list[PoolRef], sub_pool: GraphPool,
                        sub_outside: list[PoolRef]) -> tuple[Callable[[], None], dict[str, Any]]:
            return compile_any(sub, [], written, sub_pool, compile_fn, sub_outside, budget)
        hosts = 0
        control: list[dict[str, Any]] = []  # per control-flow step: its sub-programs' infos
        subs: list[dict[str, Any]] = []  # the compiled ones among them (for the totals)
        if failure is not None:
            hit = locate(failure, steps, _needed(steps, 0, len(steps), self.owners, self.outputs))
            self._emit(0, len(steps), _Attempt(None, failure, hit))
        else:
            start = 0
            for i, step in enumerate(steps):
                if step.kind not in HOST_KINDS and i not in self.islands:
                    continue
                self._stretch(start, i)
                start = i + 1
                if step.kind in ("cond", "while"):
                    elsewhere = [r for j, s in enumerate(steps) if j != i for r in pool_reads([s])]
                    run, cinfo = compile_control(step, pool, compile_sub, [*around, *elsewhere])
                    self.runs.append(run)
                    control.append(cinfo)
                    subs.extend(_compiled_subs(cinfo))
                else:  # a host step, or an op island
                    self.runs.append(build_replay(materialize([step], pool), []))
                hosts += step.kind in HOST_KINDS
            self._stretch(start, len(steps))
        if self.islands and not self.infos and not subs:
            # Nothing compiled: the whole graph falls back, with the first reason.
            raise self.first or min(self.islands.items())[1].error
        calls = tuple(self.runs)

        def run() -> None:
            for call in calls:
                call()

        every = self.infos + subs
        info = {
            "backend": "inductor",
            "compile_s": sum(i["compile_s"] for i in every),
            "cache": "hit" if every and all(i["cache"] == "hit" for i in every) else "miss",
            **merge_reuse(every),  # per part: in-process, FX graph cache or compiled (.compile_cache)
            "fx_nodes": sum(i["fx_nodes"] for i in every),
            "placeholders": sum(i["placeholders"] for i in every),
            "intermediates": "written back to the pool between stretches",
            "stretches": len(self.infos),
            "host_steps": hosts,
            "interpreted_stretches": [],  # none any more (module docstring)
        }
        if self.islands:
            info["interpreted_ops"] = summary(self.islands, steps)
        if budget.failed:
            info["failed_compiles"] = budget.failed
        if control:
            info["control_flow"] = control
        return run, info

    def _stretch(self, start: int, end: int) -> None:
        """Compile ``steps[start:end]`` (no host step or island in it) as one program, or
        locate what fails in it and compile around that."""
        self._emit(start, end, self._try(start, end))

    def _try(self, start: int, end: int) -> _Attempt | None:
        """One compile of ``steps[start:end]``; None when it runs nothing. A failure that is not
        one op's, or past the budget, raises (the first failure: the graph falls back whole)."""
        stretch = self.steps[start:end]
        if not any(s.kind not in ("view", "none") for s in stretch):
            return None
        written = _needed(self.steps, start, end, self.owners, self.outputs)
        try:
            return _Attempt(self.compile_fn(stretch, [], written, self.pool), None, [])
        except Exception as exc:
            failed: BaseException = exc
        if not splittable(failed) or not self.budget.spend():
            raise self.first or failed
        self.first = self.first or failed
        return _Attempt(None, failed, [start + k for k in locate(failed, stretch, written)])

    def _emit(self, start: int, end: int, attempt: _Attempt | None) -> None:
        """Add the replay of ``steps[start:end]`` from ``attempt``: its compiled program, or,
        after a failure, the parts around the ops it names (bisected when it names none)."""
        if attempt is None:
            return
        if attempt.compiled is not None:
            self.runs.append(attempt.compiled[0])
            self.infos.append(attempt.compiled[1])
            return
        exc, hit = attempt.error, attempt.hit
        assert exc is not None
        real = [i for i in range(start, end) if self.steps[i].kind not in ("view", "none")]
        reason = failure_reason(exc)
        found = "named by a compile failure" if hit else "bisected"
        if not hit and len(real) == 1:
            hit = real
        log.info("compile='inductor': a stretch of %d ops failed to compile (%s); %s", end - start,
                 reason, f"{len(hit)} op(s) replay interpreted" if hit else "bisecting it")
        if not hit:
            mid = real[len(real) // 2]  # both halves hold real ops
            first, second = self._try(start, mid), self._try(mid, end)
            if (first is not None and second is not None and first.error is not None
                    and second.error is not None and not first.hit and not second.hit):
                # Both halves fail, naming nothing: no one op's failure to find (a program-wide
                # problem); the graph falls back whole rather than spend more compiles.
                raise self.first or exc
            self._emit(start, mid, first)
            self._emit(mid, end, second)
            return
        for i in hit:
            self.islands[i] = Refusal(reason, found, exc)
        at = start
        for i in hit:
            self._stretch(at, i)
            self.runs.append(build_replay(materialize([self.steps[i]], self.pool), []))
            at = i + 1
        self._stretch(at, end)


class _Attempt(NamedTuple):
    """One compile of a stretch: ``compiled`` (``(replay_fn, info)``) or ``error`` and the steps
    it names (``hit``, indices into the whole program)."""

    compiled: tuple[Callable[[], None], dict[str, Any]] | None
    error: BaseException | None
    hit: list[int]


def _compiled_subs(cinfo: dict[str, Any]) -> list[dict[str, Any]]:
    """The infos of the compiled sub-programs of one control-flow step (for the totals)."""
    return [sub for sub in cinfo["subprograms"] if sub.get("compiled")]


def _read_owners(steps: list[Step]) -> dict[int, list[tuple[PoolRef, int | None]]]:
    """For each step index, the pool locations in its arguments, each with the index of the
    step whose allocation it reads: the newest earlier allocation overlapping it (capture reuses
    the memory of tensors that died, so an older allocation at the same place is not read), or
    None (memory of an earlier graph in a shared pool)."""
    made: list[tuple[int, PoolRef]] = []
    owners: dict[int, list[tuple[PoolRef, int | None]]] = {}
    for k, step in enumerate(steps):
        for x in reads(step):
            if isinstance(x, PoolRef):
                owner = next((j for j, ref in reversed(made) if refs_overlap(ref, x)), None)
                owners.setdefault(k, []).append((x, owner))
        made.extend((k, ref) for ref in allocations(step))
    return owners


def _needed(steps: list[Step], start: int, end: int, owners: dict[int, set[int]],
            outputs: list[PoolRef]) -> list[PoolRef]:
    """The allocations of ``steps[start:end]`` that must land in pool memory: the graph's
    outputs and what later steps (host steps included) read, oldest first. Inductor keeps the
    rest in its own buffers; the written tensors never overlap (output placeholders that alias
    each other are what AOT cannot trace statically)."""
    read_later = {j for k, reads in owners.items() if k >= end
                  for _, j in reads if j is not None and start <= j < end}
    final = {ref: None for ref in outputs}
    newest: dict[PoolRef, int] = {}  # identical locations: only the newest can be an output
    for j in range(start, end):
        for ref in allocations(steps[j]):
            newest[ref] = j
    wanted: dict[PoolRef, None] = {}
    for j in range(start, end):
        for ref in allocations(steps[j]):
            if j in read_later or (ref in final and newest[ref] == j and _alive_at_end(ref, j, steps)):
                wanted.pop(ref, None)
                wanted[ref] = None
    return list(wanted)


def _alive_at_end(ref: PoolRef, j: int, steps: list[Step]) -> bool:
    """Whether no later allocation (in any stretch) took ``ref``'s memory after step ``j``."""
    return not any(refs_overlap(ref, other) for s in steps[j + 1:] for other in allocations(s))

