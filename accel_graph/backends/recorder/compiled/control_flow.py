"""``compile="inductor"`` for control-flow steps: each sub-program compiled on its own.

A ``cond`` or ``while`` step (:mod:`.control_flow`) holds sub-programs: the two branches of a
``torch.cond``; the predicate program (``cond_fn``) and the body of a ``torch.while_loop``.
Under compiled replay each sub-program becomes an Inductor program of its own, with the same
machinery as the stretches between host steps (:func:`.segmented.compile_any`, so a nested
``cond``/``while`` inside a body is compiled the same way, recursively). The branch selection
and the loop stay in Python: the predicate is read from pool memory with ``.item()`` at replay,
exactly as interpreted replay reads it. A sub-program Inductor refuses replays interpreted, on
its own, with the reason logged (the ``compile='inductor' failed`` prefix the test plug-in
watches) and kept in ``debug_dump()["compiled"]["control_flow"]``.

What a compiled sub-program writes to pool memory: Inductor keeps a program's intermediates in
its own buffers, so a sub-program writes back only the allocations that are read outside it (by
the predicate read on the host, by the other sub-programs of the step, by the rest of the graph
at any level, or that are the graph's outputs), and those of its allocations still alive when it
ends. Over-approximating is safe (interpreted replay writes every allocation to the pool); the
writes into the carry buffers and ``cond`` outputs are in-place writes to memory the program did
not allocate, which Inductor writes back as input mutations.

Why not Inductor's own ``cond``/``while_loop`` lowering: it compiles the whole loop into one
kernel program only from a graph torch itself traced (``torch.compile`` of the function); the
recorder holds aten sub-programs over pool memory, and its semantics (a body that writes a
captured input, which torch's while_loop refuses) are wider than what the functional operators
accept. The host loop costs one predicate read per iteration, which a decode step dwarfs.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...capture_common.pytree import tree_flatten
from ..memory_names import describe_memory
from ..pool_protocol import GraphPool, PoolRef, refs_overlap, storage_bytes
from ..program import CONTROL_KINDS, build_replay, materialize
from ..steps import Step

log = logging.getLogger("accel_graph")
aten = torch.ops.aten

#: What each sub-program of a control-flow step is, by step kind, in ``extra[1:]`` order.
ROLES = {"cond": ("true branch", "false branch"), "while": ("predicate (cond_fn)", "body")}

#: ``compile_sub(steps, outputs, pool, outside) -> (replay_fn, info)``: compiles a sub-program
#: (:func:`.segmented.compile_any` with the outer compile function bound); raises on failure.
SubCompiler = Callable[[list[Step], list[PoolRef], GraphPool, list[PoolRef]], tuple[Callable[[], None], dict[str, Any]]]


def sub_steps(step: Step) -> list[Step]:
    """Every step inside a control-flow step's sub-programs, nested ones included."""
    if step.kind not in CONTROL_KINDS:
        return []
    out: list[Step] = []
    for sub in step.extra[1:]:
        for s in sub:
            out.append(s)
            out.extend(sub_steps(s))
    return out


def allocations(step: Step) -> list[PoolRef]:
    """Pool memory a step allocates (empty factories included: in-place ops may fill them
    later, like dropout's mask; views and in-place ops allocate nothing; a control-flow step,
    what its sub-programs allocate)."""
    if step.kind in CONTROL_KINDS:
        return [ref for s in sub_steps(step) for ref in allocations(s)]
    if step.kind in ("view", "mutate"):
        return []  # a host step's outputs are an eager island's static buffers (islands.py)
    return [out for out in step.outputs if isinstance(out, PoolRef)]


def reads(step: Step) -> list[Any]:
    """Everything a step's arguments name (a control-flow step: its predicate and every
    argument in its sub-programs), flattened."""
    if step.kind in CONTROL_KINDS:
        found = tree_flatten(step.extra[0])[0]
        for s in sub_steps(step):
            found += tree_flatten((s.args, s.kwargs, s.extra if s.kind not in CONTROL_KINDS else s.extra[0]))[0]
        return found
    return tree_flatten((step.args, step.kwargs, step.extra))[0]


def pool_reads(steps: list[Step]) -> list[PoolRef]:
    """The pool locations ``steps`` read (nested sub-programs included), each once."""
    return list(dict.fromkeys(x for s in steps for x in reads(s) if isinstance(x, PoolRef)))


def written_back(steps: list[Step], outside: list[PoolRef]) -> list[PoolRef]:
    """The allocations of ``steps`` a compiled run must leave in pool memory: those alive at the
    end (no later allocation took their memory) that overlap a location read ``outside``.
    Oldest first; they never overlap one another (an older overlapping one is not alive)."""
    made = [(j, ref) for j, s in enumerate(steps) if s.kind not in CONTROL_KINDS for ref in allocations(s)]
    later = [(j, ref) for j, s in enumerate(steps) for ref in allocations(s)]
    out: dict[PoolRef, None] = {}
    for j, ref in made:
        if any(k > j and refs_overlap(ref, other) for k, other in later):
            continue
        if any(refs_overlap(ref, o) for o in outside):
            out[ref] = None
    return list(out)


def compile_control(step: Step, pool: GraphPool, compile_sub: SubCompiler,
                    outside: list[PoolRef]) -> tuple[Callable[[], None], dict[str, Any]]:
    """The replay function of one ``cond``/``while`` step with each sub-program compiled by
    ``compile_sub`` (or interpreted where that fails, logged), and its info for ``debug_dump``.

    ``outside``: the pool locations read anywhere outside this step (the rest of the graph at
    every level, and the graph's outputs). Never raises for a compiler failure."""
    pred_arg, *subs = step.extra
    pred = pool.materialize(pred_arg) if isinstance(pred_arg, PoolRef) else pred_arg
    around = [*outside, *([pred_arg] if isinstance(pred_arg, PoolRef) else [])]
    runs: list[Callable[[], None]] = []
    infos: list[dict[str, Any]] = []
    for k, (sub, role) in enumerate(zip(subs, ROLES[step.kind])):
        others = [r for j, o in enumerate(subs) if j != k for r in pool_reads(o)]
        sub_outside = [*around, *others]
        run, info = _compiled_sub(sub, pool, compile_sub, sub_outside, role, step.kind)
        runs.append(run)
        infos.append(info)
    info = {"op": f"torch.{'cond' if step.kind == 'cond' else 'while_loop'}", "subprograms": infos}
    return _host_control(step.kind, pred, runs[0], runs[1]), info


def _compiled_sub(sub: list[Step], pool: GraphPool, compile_sub: SubCompiler, outside: list[PoolRef],
                  role: str, kind: str) -> tuple[Callable[[], None], dict[str, Any]]:
    """One sub-program compiled, or interpreted with the reason logged."""
    if not any(s.kind not in ("view", "none") for s in sub):
        return _nothing, {"role": role, "compiled": False, "reason": "nothing to run"}
    try:
        staged_sub, pairs = stage_reads_before_writes(sub, pool)
        run, info = compile_sub(staged_sub, written_back(sub, outside), pool, outside)
        if pairs:
            run = with_snapshots(run, tuple(pairs))
            info = {**info, "snapshots": len(pairs)}
    except Exception as exc:  # any compiler failure: this sub-program alone runs interpreted
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        what = "torch.cond" if kind == "cond" else "torch.while_loop"
        log.warning("compile='inductor' failed for the %s of a %s (%s); that sub-program replays "
                    "interpreted, the rest of the graph stays compiled", role, what, reason)
        return build_replay(materialize(sub, pool), []), {"role": role, "compiled": False, "fallback": reason}
    return run, {"role": role, "compiled": True, **info}


class StagingUnsupported(Exception):
    """Memory a sub-program reads and then overwrites is also reached through another view."""


#: In-place ops that overwrite their target without reading it.
_WRITE_ONLY = ("aten::copy_", "aten::fill_", "aten::zero_")


def stage_reads_before_writes(sub: list[Step], pool: GraphPool) -> tuple[list[Step], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``sub`` (a sub-program, or a whole graph) with the reads of memory it copies and then
    overwrites (a carry buffer the body clones, then overwrites with its result; memory the
    program did not allocate) taken from a private snapshot instead, and the
    ``(memory, snapshot)`` pairs to copy before each run.

    Why: Inductor (torch 2.13) elides the copy of an input that is overwritten later in the
    same program (``c = a.clone()`` or ``c = empty_like(a).copy_(a)``, then ``a.copy_(b)``:
    ``c`` reads the new ``a``), so a body that swaps two carries (``a, b = b.clone(),
    a.clone()``) lost one; ``torch.compile`` of the same function gets it wrong too. Reads by
    other ops (arithmetic, matmul, indexing) came out right and are left alone, so a decode body
    or a training step pays nothing. A snapshot is never written, so the order no longer
    matters; every read of such memory before its first write uses it, reads at or after the
    first write stay on the memory itself (they must see the write).
    Raises :class:`StagingUnsupported` where such memory is also reached through another,
    overlapping location (a view of it), which the substitution would miss.
    """
    made = _Allocated([ref for step in sub for ref in allocations(step)])
    first_write: dict[Any, int] = {}
    last_read: dict[Any, int] = {}
    views: set[Any] = set()  # views made by the sub-program itself
    places: dict[Any, Any] = {}  # key -> the PoolRef or tensor
    first_copied: dict[Any, int] = {}  # read by a copying op (the reads Inductor gets wrong)
    for k, step in enumerate(sub):
        written, read = _step_access(step)
        for x in _copied(step):
            key = _key(x, made)
            if key is not None:
                first_copied.setdefault(key, k)
        if step.kind == "view":
            views.update(_key(x, made) for x in step.outputs)
        for x in read:
            key = _key(x, made)
            if key is not None:
                last_read[key] = k
                places[key] = x
        for x in written:
            key = _key(x, made)
            if key is not None:
                first_write.setdefault(key, k)
                places[key] = x
    staged = [key for key, k in first_write.items() if first_copied.get(key, k) < k]
    if not staged:
        return sub, []
    for key in staged:
        # A view the sub-program makes of this memory before overwriting it reads the snapshot
        # too (its view step is substituted); it must not be read after the write.
        if any(other != key and _overlap(places[other], places[key])
               and not (other in views and last_read[other] < first_write[key]) for other in places):
            raise StagingUnsupported(
                f"a sub-program reads, then overwrites memory ({describe_memory(places[key])}) that it also "
                f"reaches through another view; compiled, it could read the overwritten values")
    snaps = {key: _tensor_of(places[key], pool).clone() for key in staged}
    pairs = [(_tensor_of(places[key], pool), snaps[key]) for key in staged]
    out = []
    for k, step in enumerate(sub):
        here = {key: snaps[key] for key in staged if k < first_write[key]}
        out.append(_substituted(step, here, made) if here else step)
    return out, pairs


def _copied(step: Step) -> list[Any]:
    """What a step reads only to copy it (``clone``, ``copy_`` from it; in sub-programs too)."""
    if step.kind in CONTROL_KINDS:
        return [x for s in sub_steps(step) for x in _copied(s)]
    if step.func is aten.clone.default and step.args:
        return [step.args[0]]
    if step.kind == "mutate" and step.func is aten.copy_.default and len(step.args) > 1:
        return [step.args[1]]
    return []


class _Allocated:
    """The memory a program allocates: ``ref in made`` is whether ``ref`` overlaps any of it
    (a view of an allocation is the program's own memory too). Sorted ranges per segment with a
    running maximum of their ends, so a query is a binary search, not a scan."""

    def __init__(self, refs: list[PoolRef]) -> None:
        by_seg: dict[int, list[tuple[int, int]]] = {}
        for r in refs:
            n = storage_bytes(r.shape, r.stride, r.dtype.itemsize)
            if n:
                by_seg.setdefault(r.segment, []).append((r.byte_offset, r.byte_offset + n))
        self._index: dict[int, tuple[list[int], list[int]]] = {}
        for seg, ranges in by_seg.items():
            ranges.sort()
            ends, top = [], 0
            for _, end in ranges:
                top = max(top, end)
                ends.append(top)
            self._index[seg] = ([start for start, _ in ranges], ends)

    def __contains__(self, ref: object) -> bool:
        if not isinstance(ref, PoolRef) or ref.segment not in self._index:
            return False
        n = storage_bytes(ref.shape, ref.stride, ref.dtype.itemsize)
        if not n:
            return False
        starts, ends = self._index[ref.segment]
        i = bisect.bisect_left(starts, ref.byte_offset + n) - 1  # ranges starting before its end
        return i >= 0 and ends[i] > ref.byte_offset


def _key(x: Any, made: _Allocated) -> Any:
    """The identity of memory a sub-program did not allocate (None for its own allocations)."""
    if x.__class__ is PoolRef:
        return None if x in made else x
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    return None


def _overlap(a: Any, b: Any) -> bool:
    if a.__class__ is PoolRef and b.__class__ is PoolRef:
        return refs_overlap(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):  # conservative: one storage
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    return False


def _tensor_of(x: Any, pool: GraphPool) -> torch.Tensor:
    return pool.materialize(x) if x.__class__ is PoolRef else x


def _step_access(step: Step) -> tuple[list[Any], list[Any]]:
    """(what a step writes in place, what it reads): pool locations and tensors; a control-flow
    step, everything its sub-programs write and read (its predicate read too)."""
    if step.kind in CONTROL_KINDS:
        written: list[Any] = []
        read = list(tree_flatten(step.extra[0])[0])
        for sub in step.extra[1:]:
            for s in sub:
                w, r = _step_access(s)
                written += w
                read += r
        return written, read
    if step.kind == "mutate":
        return _mutate_access(step)
    return [], tree_flatten((step.args, step.kwargs, step.extra))[0]


def _mutate_access(step: Step) -> tuple[list[Any], list[Any]]:
    """(what an in-place or ``out=`` step writes, what it reads). An in-place op reads its
    target too, except the overwriting ones (copy_, fill_, zero_); ``out=`` targets are
    written only."""
    func = step.func
    schema_args = func._schema.arguments
    written: list[Any] = []
    read: list[Any] = []
    reads_target = func._overloadname != "out" and func.name().split(".")[0] not in _WRITE_ONLY
    named = dict(zip((a.name for a in schema_args), step.args))
    named.update(step.kwargs)
    for a in schema_args:
        leaves = tree_flatten(named.get(a.name))[0]
        if a.alias_info is not None and a.alias_info.is_write:
            written += leaves
            if reads_target:
                read += leaves
        else:
            read += leaves
    return written, read


def _substituted(step: Step, snaps: dict[Any, torch.Tensor], made: _Allocated) -> Step:
    """``step`` (and its sub-programs) reading the snapshots in ``snaps`` (by memory key)."""
    def swap(x: Any) -> Any:
        if x.__class__ is PoolRef or isinstance(x, torch.Tensor):
            return snaps.get(_key(x, made), x)
        if isinstance(x, (tuple, list)):
            return type(x)(swap(y) for y in x)
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x

    if step.kind in CONTROL_KINDS:
        pred, *subs = step.extra
        extra = (swap(pred), *[[_substituted(s, snaps, made) for s in sub] for sub in subs])
    else:
        extra = swap(step.extra)
    return Step(step.func, step.kind, swap(step.args), swap(step.kwargs), step.outputs,
                step.strategy, extra, step.positions, step.grad)


def with_snapshots(run: Callable[[], None], pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> Callable[[], None]:
    """``run`` preceded by refreshing each snapshot from its memory."""
    def snapshot_then_run() -> None:
        for memory, snap in pairs:
            snap.copy_(memory)
        run()
    return snapshot_then_run


def _nothing() -> None:
    return None


def _host_control(kind: str, pred: torch.Tensor, first: Callable[[], None],
                  second: Callable[[], None]) -> Callable[[], None]:
    """The host side of a control-flow step: read the predicate the programs wrote, pick."""
    item = pred.item
    if kind == "cond":
        def run_cond() -> None:
            if item():
                first()
            else:
                second()
        return run_cond

    def run_while() -> None:  # first: the predicate program, second: the body
        first()
        while item():
            second()
            first()
    return run_while
