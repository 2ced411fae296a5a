"""Nested tuples, lists and dicts of aten arguments: a fast subset of torch's pytree.

Capture walks every op's arguments, so these are plain recursive functions over the three
container types aten uses, without torch's registry of node types.
"""

from __future__ import annotations

from typing import Any

import torch

_Tensor = torch.Tensor
_LIST_TYPES = (list, tuple)


def tree_flatten(x: Any) -> tuple[list, None]:
    """Leaves of nested tuples/lists/dicts, in order (the ``None`` mirrors torch's spec slot)."""
    out: list = []
    _flatten_into(x, out)
    return out, None


def _flatten_into(x: Any, out: list) -> None:
    if isinstance(x, (tuple, list)):
        for y in x:
            _flatten_into(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flatten_into(y, out)
    else:
        out.append(x)


def tree_map(fn: Any, x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf of nested tuples/lists/dicts."""
    if isinstance(x, tuple):
        return tuple(tree_map(fn, y) for y in x)
    if isinstance(x, list):
        return [tree_map(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor among the leaves of nested tuples/lists/dicts, in flattening order."""
    if isinstance(x, _Tensor):
        return x
    if isinstance(x, _LIST_TYPES):
        for y in x:
            t = first_tensor(y)
            if t is not None:
                return t
    elif isinstance(x, dict):
        for y in x.values():
            t = first_tensor(y)
            if t is not None:
                return t
    return None
