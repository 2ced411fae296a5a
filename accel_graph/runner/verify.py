"""Eager-vs-replay verification without doubling side effects.

The first replay of each bucket is compared with an eager call on the same (padded) inputs
(and, for a padded call, with ``fn`` on the live rows alone: :mod:`.rows`).
Both mutate whatever state the function writes (a KV cache, a counter), so running both would
apply the step twice. :class:`UndoLog` records, at the dispatcher, every tensor the eager call
writes in place (cloning it just before its first write), so the runner can put the state back,
replay, compare, and keep whichever side-effects belong to the result it returns.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..foundation.tolerances import assert_close_for_dtype
from .group import GroupInfo, agreed_diff

__all__ = ["UndoLog", "compare"]


class UndoLog(TorchDispatchMode):
    """Records the pre-state of every pre-existing tensor written in place while active.

    Tensors created inside the block are not recorded (nothing outside can see them). After the
    block: :meth:`snapshot_post` keeps the state the block left, :meth:`restore` puts the
    pre-state back (in reverse order, so overlapping views end up right), :meth:`reapply` puts
    the post-state back.
    """

    def __init__(self) -> None:
        super().__init__()
        _register_control_flow(type(self))
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.post: list[torch.Tensor] = []
        self._fresh: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable and torch.Tag.inplace_view not in func.tags:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor) and t not in self._fresh and t not in self._seen:
                        self._seen[t] = True
                        self.saved.append((t, t.clone()))
        out = func(*args, **kwargs)
        if not schema.is_mutable and all(r.alias_info is None for r in schema.returns):
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._fresh[t] = True
        return out

    def snapshot_post(self) -> None:
        self.post = [t.clone() for t, _ in self.saved]

    def restore(self) -> None:
        for t, before in reversed(self.saved):
            t.copy_(before)

    def reapply(self) -> None:
        for (t, _), after in zip(self.saved, self.post):
            t.copy_(after)


#: Mode classes with eager rules for torch.cond / torch.while_loop / switch registered.
_RULES: set[type] = set()


def _register_control_flow(mode_cls: type) -> None:
    """Let ``torch.cond``, ``torch.while_loop`` and ``switch`` (torch 2.14+, skipped where
    absent) run under ``mode_cls`` (idempotent).

    torch refuses a higher-order operator under a dispatch mode that has no rule for it
    (``NotImplementedError``), so a step with control flow could not be verified. The rule runs
    the operator's own eager kernel with every branch, predicate and body function called
    under the mode again, so the writes inside them are logged like any other."""
    if mode_cls in _RULES:
        return
    from torch._C import DispatchKey

    for name in ("cond", "while_loop", "switch"):
        op = getattr(torch.ops.higher_order, name, None)
        dense = None if op is None else op.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if dense is None:  # switch before torch 2.14
            continue
        op.py_impl(mode_cls)(torch._disable_dynamo(functools.partial(_eager_rule, dense)))
    _RULES.add(mode_cls)


def _eager_rule(dense: Any, mode: TorchDispatchMode, *args: Any, **kwargs: Any) -> Any:
    def under_mode(fn: Any) -> Any:
        if isinstance(fn, (tuple, list)):  # switch's branches
            return type(fn)(under_mode(f) for f in fn)
        if not callable(fn) or isinstance(fn, torch.Tensor):
            return fn

        def run(*a: Any) -> Any:
            with mode:
                return fn(*a)
        return run

    try:
        return dense(*(under_mode(a) for a in args), **kwargs)
    finally:
        # Eager torch.cond caches a TorchDynamo skip on its wrapper after running under a mode
        # (pytorch#163013); undo it, as the recorder does.
        from ..backends.recorder.control_flow import undo_dynamo_skip

        undo_dynamo_skip()


def compare(actual: Any, expected: Any, group: GroupInfo | None = None,
            what: str = "replay vs eager") -> str | None:
    """None when ``actual`` is within the per-dtype tolerances of ``expected``, else why not
    (prefixed by ``what``, naming the output that differs and the largest difference).

    With a ``group`` (a runner with ``process_group=``) the verdict is agreed over it
    (:func:`~accel_graph.runner.group.agreed_diff`, a collective): a mismatch on any rank is a
    mismatch on every rank, so every rank disables the bucket together."""
    try:
        assert_close_for_dtype(actual, expected, msg=what)
        diff = None
    except AssertionError as exc:
        diff = str(exc)
    return diff if group is None else agreed_diff(group, diff)
