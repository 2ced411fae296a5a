"""``compile="inductor"`` for programs with host steps (generator state, :mod:`.rng`).

A host step is a Python call between kernels (a generator snapshot or restore), which an FX
graph cannot order against Inductor's random kernels. Such a program is compiled in stretches:
each run of ops between host steps is one Inductor program (:func:`.compiled.compile_program`),
and the host steps run interpreted between them, so every draw happens in the order eager makes
it, on the generator state eager has at that point.

A stretch writes back into pool memory the graph's outputs it makes and every allocation that a
later stretch or host step reads (they read pool memory, not Inductor's buffers): one copy per
such tensor, which keeps the values equal to interpreted replay.
A stretch whose outputs reuse pool memory of tensors it reads from earlier stretches (they died
in it) replays interpreted: its compiled placeholders would alias, which AOT cannot trace with
static shapes. ``debug_dump``'s ``compiled.interpreted_stretches`` lists their sizes.
Programs without host steps compile as one program, unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .capture import InputRecord, Step
from .compiled import compile_program
from .pool_protocol import GraphPool, PoolRef, refs_overlap
from .program import build_replay, materialize
from .pytree import tree_flatten

log = logging.getLogger("accel_graph")


#: Step kinds run interpreted between compiled stretches: generator-state calls (rng.py) and
#: control flow (control_flow.py: the predicate is read on the host at replay).
HOST_KINDS = ("host", "cond", "while")


def has_host_steps(steps: list[Step]) -> bool:
    return any(s.kind in HOST_KINDS for s in steps)


def _sub_steps(step: Step) -> list[Step]:
    """Every step inside a control-flow step's sub-programs, nested ones included."""
    if step.kind not in ("cond", "while"):
        return []
    out: list[Step] = []
    for sub in step.extra[1:]:
        for s in sub:
            out.append(s)
            out.extend(_sub_steps(s))
    return out


def compile_any(
    steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef], pool: GraphPool,
    compile_fn: Callable[..., tuple[Callable[[], None], dict[str, Any]]] = compile_program,
) -> tuple[Callable[[], None], dict[str, Any]]:
    """Compile ``steps`` (as captured, with pool locations) with ``compile_fn``
    (:func:`.compiled.compile_program`, or the caller's replacement); raises on any failure,
    and returns ``(replay_fn, info)`` like it."""
    if not has_host_steps(steps):
        return compile_fn(steps, inputs, outputs, pool)
    runs: list[Callable[[], None]] = []
    stretch: list[Step] = []
    infos: list[dict[str, Any]] = []
    interpreted: list[int] = []  # sizes of stretches replayed interpreted
    hosts = 0

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
            runs.append(build_replay(materialize([step], pool), []))
            hosts += 1
        else:
            stretch.append(step)
    flush(len(steps))
    calls = tuple(runs)

    def run() -> None:
        for call in calls:
            call()

    info = {
        "backend": "inductor",
        "compile_s": sum(i["compile_s"] for i in infos),
        "cache": "hit" if infos and all(i["cache"] == "hit" for i in infos) else "miss",
        "fx_nodes": sum(i["fx_nodes"] for i in infos),
        "placeholders": sum(i["placeholders"] for i in infos),
        "intermediates": "written back to the pool between stretches",
        "stretches": len(infos),
        "host_steps": hosts,
        "interpreted_stretches": interpreted,
    }
    return run, info


def _allocations(step: Step) -> list[PoolRef]:
    """Pool memory a step allocates (empty factories included: in-place ops may fill them
    later, like dropout's mask; views and in-place ops allocate nothing; a control-flow step,
    what its sub-programs allocate)."""
    if step.kind in ("cond", "while"):
        return [ref for s in _sub_steps(step) for ref in _allocations(s)]
    if step.kind in ("view", "mutate", "host"):
        return []
    return [out for out in step.outputs if isinstance(out, PoolRef)]


def _reads(step: Step) -> list[Any]:
    """Everything a step's arguments name (a control-flow step: its predicate and every
    argument in its sub-programs), flattened."""
    if step.kind in ("cond", "while"):
        found = tree_flatten(step.extra[0])[0]
        for s in _sub_steps(step):
            found += tree_flatten((s.args, s.kwargs, s.extra if s.kind not in ("cond", "while") else s.extra[0]))[0]
        return found
    return tree_flatten((step.args, step.kwargs, step.extra))[0]


def _read_owners(steps: list[Step]) -> dict[int, list[tuple[PoolRef, int | None]]]:
    """For each step index, the pool locations in its arguments, each with the index of the
    step whose allocation it reads: the newest earlier allocation overlapping it (capture reuses
    the memory of tensors that died, so an older allocation at the same place is not read), or
    None (memory of an earlier graph in a shared pool)."""
    made: list[tuple[int, PoolRef]] = []
    owners: dict[int, list[tuple[PoolRef, int | None]]] = {}
    for k, step in enumerate(steps):
        for x in _reads(step):
            if isinstance(x, PoolRef):
                owner = next((j for j, ref in reversed(made) if refs_overlap(ref, x)), None)
                owners.setdefault(k, []).append((x, owner))
        made.extend((k, ref) for ref in _allocations(step))
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
        for ref in _allocations(steps[j]):
            newest[ref] = j
    wanted: dict[PoolRef, None] = {}
    for j in range(start, end):
        for ref in _allocations(steps[j]):
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
    return not any(refs_overlap(ref, other) for s in steps[j + 1:] for other in _allocations(s))

