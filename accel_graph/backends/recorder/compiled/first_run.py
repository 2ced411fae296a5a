"""The first run of a compiled replay program, checked: a failure falls back to interpreted.

Some Inductor failures show only when the generated code first runs, not at compilation: a
wrapper naming an undefined size symbol (torch 2.14.1 without ``ignore_shape_env``,
:func:`.cache.static_kwargs`), a kernel that fails to load or to autotune at its first
launch. Such a failure must not escape ``replay()`` when the interpreted program can replay the
graph instead (the contract of issue 15 for compile failures), and it must not leave a silent
wrong result behind: a compiled run that failed half-way may already have written inputs in
place (a KV cache, an optimizer step), drawn random numbers or overwritten pool memory that it
read from an earlier graph, and the interpreted run that replaces it would then apply those
effects twice.

So the first run is wrapped (:class:`FirstRun`): before it, :class:`UndoPlan` saves what a
partial run could have changed that the interpreted run would read again (tensors the program
writes in place, pool memory of earlier graphs it reads, the state of the generators it draws
from); after a failure those are put back, the owner is told (it switches to interpreted replay
and records the reason in ``compile_info()``) and the interpreted program runs this replay.
After a successful first run the compiled program replays directly (one attribute read more
than calling it). A program with collectives cannot be undone (the other ranks matched what
already ran), nor one with eager islands (an island writes what it likes): its failure falls
back for later replays and raises :class:`ReplayError` for this one. The :class:`ReplayError`
of an island whose outputs do not match is the caller's, not a compile failure: it propagates
and the next replay's run is checked again.
The saved copies live only during the first run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ....errors import ReplayError
from ...capture_common.island_outputs import is_island_exception
from ...capture_common.pytree import tree_flatten
from ..islands import is_island_step
from ..pool_protocol import GraphPool, PoolRef
from ..program import CONTROL_KINDS
from ..steps import Step
from .replay_choice import Extents, written_args

__all__ = ["FirstRun", "UndoPlan", "undo_plan"]

#: ``on_failure(exc, undone) -> program``: called once when the first compiled run raised
#: (``undone``: its effects were put back); returns the program that replays from then on.
OnFailure = Callable[[BaseException, bool], Callable[[], None]]


class UndoPlan:
    """What to save before a compiled program's first run, to undo a partial run of it."""

    def __init__(self, tensors: list[torch.Tensor], refs: list[PoolRef],
                 generators: list[torch.Generator]) -> None:
        self.tensors = tensors
        self.refs = refs
        self.generators = generators

    def save(self, pool: GraphPool) -> Callable[[], None]:
        """Copy everything now; returns the function that puts the copies back."""
        targets = [*self.tensors, *(pool.materialize(r) for r in self.refs)]
        copies = [t.clone() for t in targets]
        states = [g.get_state() for g in self.generators]

        def restore() -> None:
            with torch.no_grad():
                for t, c in zip(targets, copies):
                    t.copy_(c)
            for g, s in zip(self.generators, states):
                g.set_state(s)

        return restore


def _device_generators(device_type: str, index: int | None) -> list[torch.Generator]:
    """The default generators random ops on the device draw from (CPU's always: host-side
    draws). Probing never raises: a device module without generators adds none."""
    gens = [torch.default_generator]
    if device_type != "cpu":
        try:
            mod = torch.get_device_module(device_type)
            index = index if index is not None else mod.current_device()
            gens.append(mod.default_generators[index])
        except Exception:  # no such module or attribute: nothing more to save
            pass
    return gens


def undo_plan(steps: list[Step], device_type: str, index: int | None = None) -> UndoPlan | None:
    """The :class:`UndoPlan` of a captured program (``steps`` as captured, with pool
    locations, control-flow sub-programs included), or None when a partial run cannot be undone
    (the program runs collectives). Conservative: pool memory is saved when it is read before
    the program allocated it (an earlier graph's, or a loop body's previous iteration), tensors
    captured by reference when any step writes them, generators when any step draws or sets
    generator state."""
    allocated = Extents()
    tensors: dict[int, torch.Tensor] = {}
    refs: dict[PoolRef, None] = {}
    generators: dict[int, torch.Generator] = {}
    draws = False

    def read(x: Any) -> None:
        if isinstance(x, PoolRef) and not allocated.covers(x):
            refs[x] = None
        elif isinstance(x, torch.Generator):
            generators[id(x)] = x

    def written(step: Step) -> list[Any]:
        try:
            return written_args(step)
        except Exception:  # no schema (not an aten overload): any tensor argument may be written
            return tree_flatten((step.args, step.kwargs))[0]

    def visit(step: Step) -> bool:
        nonlocal draws
        if step.kind == "collective":
            return False
        if step.kind in CONTROL_KINDS:
            for x in tree_flatten(step.extra[0])[0]:
                read(x)
            return all(visit(s) for sub in step.extra[1:] for s in sub)
        for x in tree_flatten((step.args, step.kwargs, step.extra))[0]:
            read(x)
        if is_island_step(step):
            return False  # an eager island writes what it likes (closures, module state)
        if step.kind == "host":  # generator state: the call's arguments name the generators
            draws = True
            for x in tree_flatten(getattr(step.func, "args", ()))[0]:
                read(x)
            return True
        if step.kind == "random" or torch.Tag.nondeterministic_seeded in getattr(step.func, "tags", ()):
            draws = True
        for target in written(step):
            if isinstance(target, torch.Tensor):
                tensors[id(target)] = target
            elif isinstance(target, PoolRef) and not allocated.covers(target):
                refs[target] = None
        if step.kind not in ("view", "mutate"):
            for out in step.outputs:
                if isinstance(out, PoolRef):
                    allocated.add(out)
        return True

    if not all(visit(s) for s in steps):
        return None
    if draws:
        for g in _device_generators(device_type, index):
            generators.setdefault(id(g), g)
    return UndoPlan(list(tensors.values()), list(refs), list(generators.values()))


class FirstRun:
    """The compiled program, its first run checked (module docstring). Call :attr:`fn`: the
    checking wrapper until the first run ends, then the program that replays from then on."""

    __slots__ = ("fn", "_run", "_plan", "_pool", "_on_failure")

    def __init__(self, run: Callable[[], None], plan: UndoPlan | None, pool: GraphPool,
                 on_failure: OnFailure) -> None:
        self._run, self._plan, self._pool, self._on_failure = run, plan, pool, on_failure
        self.fn: Callable[[], None] = self._first

    def _first(self) -> None:
        restore = self._plan.save(self._pool) if self._plan is not None else None
        try:
            self._run()
        except Exception as exc:
            if is_island_exception(exc):
                # An eager island raised (its own error, or its outputs did not match): the
                # caller's error, not a compile failure; the next replay is a checked first
                # run again.
                raise
            if restore is not None:
                restore()
            fallback = self._on_failure(exc, restore is not None)
            self.fn = fallback
            if restore is None:
                raise ReplayError(
                    "the compiled program failed at its first run and runs collectives or eager "
                    "islands, which may have partly run (on this rank), so this replay was not "
                    "repeated interpreted; later replays run the interpreted program") from exc
            fallback()
            return
        self.fn = self._run
