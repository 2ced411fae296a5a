"""``compile_options={"freeze": True}``: captured parameters compiled as constants.

Compiled replay normally passes every tensor captured by reference to the Inductor module as an
argument, so a weight updated in place between replays is read anew by the next replay, as in
CUDA graphs. With ``freeze`` the captured parameters the program never writes become constants
of the compiled module (Inductor's freezing: constant folding, and on the CPU mkldnn weight
prepacking for convolutions and linear layers), so an in-place update of such a parameter after
instantiation is **not** seen by replay. That is why it is opt-in.

Which tensors are frozen: the captured ``torch.nn.Parameter`` objects whose storage no step of
the program writes (in-place ops, ``out=``, in-place collectives; control-flow sub-programs
included). Everything else stays an argument: user inputs and module buffers (the recorder
cannot tell a buffer from an input, and inputs are rewritten between replays), parameters the
program updates (an optimizer step), and any tensor sharing storage with a written one. To freeze
a buffer, register it as ``nn.Parameter(t, requires_grad=False)``.

A program with frozen constants is never shared through the compile cache: every capture
compiles with the values its parameters have then. (A key of identity and version is not
enough: ``p.data.mul_()`` updates values without bumping the version counter.)
"""

from __future__ import annotations

from typing import Any

import torch

from ...capture_common.pytree import tree_flatten
from ..islands import is_island_step
from ..steps import Step

__all__ = ["FrozenConstants", "written_storages"]

#: Step kinds whose ``extra`` is ``(predicate, sub-program, ...)`` (control_flow.py).
_CONTROL_KINDS = ("cond", "while")


def _storage_id(t: torch.Tensor) -> tuple[Any, int]:
    """Where ``t``'s memory lives; a tensor without a readable storage (a wrapper subclass) is
    named by its identity, so it is never frozen (``may_freeze``) nor mistaken for another."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def _written_args(step: Step) -> list[Any]:
    """The argument values ``step`` writes, per its op's schema (``Tensor(a!)``). An in-place
    or ``out=`` step whose schema marks nothing written counts every argument as written."""
    func = step.func
    schema = getattr(func, "_schema", None)
    if schema is None:  # a host call: generator state writes no tensor argument; an eager
        # island may write any tensor it is given (what it reaches otherwise is documented)
        return tree_flatten((step.args, step.kwargs))[0] if is_island_step(step) else []
    written = []
    for pos, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.kwarg_only or pos >= len(step.args):
            if arg.name in step.kwargs:
                written.append(step.kwargs[arg.name])
        else:
            written.append(step.args[pos])
    if not written and step.kind == "mutate":
        return [step.args, step.kwargs]
    return written


def written_storages(steps: list[Step]) -> set[tuple[Any, int]]:
    """Storages of captured tensors that ``steps`` (and their control-flow sub-programs) write."""
    found: set[tuple[Any, int]] = set()
    for step in steps:
        if step.kind in _CONTROL_KINDS:
            for sub in step.extra[1:]:
                found |= written_storages(sub)
            continue
        for x in tree_flatten(_written_args(step))[0]:
            if isinstance(x, torch.Tensor):
                found.add(_storage_id(x))
    return found


class FrozenConstants:
    """The tensors one compiled program freezes, collected while its FX graph is built.

    ``written`` is :func:`written_storages` of the *whole* captured program (a stretch of a
    segmented program must not freeze what another stretch writes). :meth:`add` names a tensor
    as a constant (a ``get_attr`` target) or returns None when it must stay an argument.
    """

    def __init__(self, written: set[tuple[Any, int]]) -> None:
        self.written = written
        #: get_attr target -> tensor, in the order they were frozen.
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}

    def may_freeze(self, t: torch.Tensor) -> bool:
        """Whether ``t`` may be compiled as a constant (module docstring)."""
        if not isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        where = _storage_id(t)
        return where[0] != "id" and where not in self.written

    def add(self, t: torch.Tensor) -> str | None:
        """The attribute name of ``t`` as a constant, or None if it stays an argument."""
        name = self._names.get(id(t))
        if name is None and self.may_freeze(t):
            name = self._names[id(t)] = f"frozen{len(self.tensors)}"
            self.tensors[name] = t
        return name

    def module(self) -> torch.nn.Module:
        """A module holding the constants as attributes (the root of the GraphModule)."""
        root = torch.nn.Module()
        for name, t in self.tensors.items():
            # The user's own Parameter objects (registered here, not copied): AOT lifts them as
            # the graph's parameters and Inductor's freezing folds them, leaving them unchanged.
            setattr(root, name, t)
        return root
