"""``compile="inductor"`` for programs with host steps (generator state, :mod:`..rng`).

A host step is a Python call between kernels (a generator snapshot or restore), which an FX
graph cannot order against Inductor's random kernels. Such a program is compiled in stretches:
each run of ops between host steps is one Inductor program (:func:`.inductor.compile_program`),
and the host steps run interpreted between them, so every draw happens in the order eager makes
it, on the generator state eager has at that point.

A stretch writes back into pool memory the graph's outputs it makes and every allocation that a
later stretch or host step reads (they read pool memory, not Inductor's buffers): one copy per
such tensor, which keeps the values equal to interpreted replay.
A stretch whose outputs reuse pool memory of tensors it reads from earlier stretches (they died
in it) replays interpreted: its compiled placeholders would alias, which AOT cannot trace with
static shapes. ``debug_dump``'s ``compiled.interpreted_stretches`` lists their sizes.
Programs without host steps compile as one program, unchanged. Control-flow steps (``cond``,
``while``) sit between stretches like host steps, with each of their sub-programs compiled in
turn (:mod:`.control_flow`, which calls back into :func:`compile_any` for nesting).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

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
from .inductor import compile_program

log = logging.getLogger("accel_graph")


#: Step kinds run interpreted between compiled stretches: generator-state calls (rng.py) and
#: control flow (control_flow.py: the predicate is read on the host at replay).
HOST_KINDS = ("host", "cond", "while")


def has_host_steps(steps: list[Step]) -> bool:
    return any(s.kind in HOST_KINDS for s in steps)


def compile_any(
    steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef], pool: GraphPool,
    compile_fn: Callable[..., tuple[Callable[[], None], dict[str, Any]]] = compile_program,
    outside: list[PoolRef] | None = None,
) -> tuple[Callable[[], None], dict[str, Any]]:
    """Compile ``steps`` (as captured, with pool locations) with ``compile_fn``
    (:func:`.inductor.compile_program`, or the caller's replacement); raises on any failure,
    and returns ``(replay_fn, info)`` like it. Control-flow steps have each sub-program compiled
    (:mod:`.control_flow`; one that fails replays interpreted, logged, without failing
    the rest). ``outside``: for a sub-program, the pool locations read outside it."""
    if outside is None:  # the whole graph (sub-programs are staged by compile_control)
        steps, pairs = stage_reads_before_writes(steps, pool)
        if pairs:
            run, info = compile_any(steps, inputs, outputs, pool, compile_fn, [])
            return with_snapshots(run, tuple(pairs)), {**info, "snapshots": len(pairs)}
    if not has_host_steps(steps):
        return compile_fn(steps, inputs, outputs, pool)
    around = [*(outside or ()), *outputs]

    def compile_sub(sub: list[Step], written: list[PoolRef], sub_pool: GraphPool,
                    sub_outside: list[PoolRef]) -> tuple[Callable[[], None], dict[str, Any]]:
        return compile_any(sub, [], written, sub_pool, compile_fn, sub_outside)
    runs: list[Callable[[], None]] = []
    stretch: list[Step] = []
    infos: list[dict[str, Any]] = []
    interpreted: list[int] = []  # sizes of stretches replayed interpreted
    hosts = 0
    control: list[dict[str, Any]] = []  # per control-flow step: its sub-programs' infos
    subs: list[dict[str, Any]] = []  # the compiled ones among them (for the totals)

    owners = _read_owners(steps)
    start = 0

    def flush(end: int) -> None:
        if any(s.kind not in ("view", "none") for s in stretch):
            written = _needed(steps, start, end, owners, outputs)
            if _writes_what_it_reads(owners, start, end, written):
                # Its outputs reuse memory of tensors it reads from earlier stretches: the
                # compiled program's placeholders would alias, which AOT cannot trace with
                # static shapes. Replayed interpreted (same kernels, same values).
                runs.append(build_replay(materialize(list(stretch), pool), []))
                interpreted.append(end - start)
                log.info("compile='inductor': a stretch of %d ops between generator-state steps "
                         "replays interpreted (its outputs reuse memory it reads)", end - start)
            else:
                run, info = compile_fn(list(stretch), [], written, pool)
                runs.append(run)
                infos.append(info)
        stretch.clear()

    for i, step in enumerate(steps):
        if step.kind in HOST_KINDS:
            flush(i)
            start = i + 1
            if step.kind == "host":
                runs.append(build_replay(materialize([step], pool), []))
            else:
                elsewhere = [r for j, s in enumerate(steps) if j != i for r in pool_reads([s])]
                run, cinfo = compile_control(step, pool, compile_sub, [*around, *elsewhere])
                runs.append(run)
                control.append(cinfo)
                subs.extend(_compiled_subs(cinfo))
            hosts += 1
        else:
            stretch.append(step)
    flush(len(steps))
    calls = tuple(runs)

    def run() -> None:
        for call in calls:
            call()

    every = infos + subs
    info = {
        "backend": "inductor",
        "compile_s": sum(i["compile_s"] for i in every),
        "cache": "hit" if every and all(i["cache"] == "hit" for i in every) else "miss",
        **merge_reuse(every),  # per part: in-process, FX graph cache or compiled (.compile_cache)
        "fx_nodes": sum(i["fx_nodes"] for i in every),
        "placeholders": sum(i["placeholders"] for i in every),
        "intermediates": "written back to the pool between stretches",
        "stretches": len(infos),
        "host_steps": hosts,
        "interpreted_stretches": interpreted,
    }
    if control:
        info["control_flow"] = control
    return run, info


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


def _writes_what_it_reads(owners: dict[int, list[tuple[PoolRef, int | None]]], start: int,
                          end: int, written: list[PoolRef]) -> bool:
    """Whether an allocation the stretch writes back overlaps pool memory it reads from before
    it (a tensor of an earlier stretch that died in this one, its memory reused)."""
    for k in range(start, end):
        for ref, j in owners.get(k, ()):
            if (j is None or j < start) and any(refs_overlap(ref, w) for w in written):
                return True
    return False


def _alive_at_end(ref: PoolRef, j: int, steps: list[Step]) -> bool:
    """Whether no later allocation (in any stretch) took ``ref``'s memory after step ``j``."""
    return not any(refs_overlap(ref, other) for s in steps[j + 1:] for other in allocations(s))

