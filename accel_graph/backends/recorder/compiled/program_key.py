"""The cache key of a compiled program (:func:`program_key`): equal keys compile to
interchangeable Inductor modules, so captures of the same program share one
(:mod:`.inductor`'s process-wide module cache).

The key is the FX graph (every node's op, target and arguments, constants exactly: ``1``,
``1.0`` and ``True`` differ) and the layout of every placeholder (what Inductor and AOT autograd
may specialize on: metadata, alignment, which placeholders share a storage).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["program_key"]


def _leaf_key(x: Any, keep: list[Any]) -> Any:
    """An exact, hashable key for one constant of the FX graph.

    Numbers carry their type (``1``, ``1.0`` and ``True`` differ) and floats their bits (``-0.0``
    and ``nan`` compare as themselves); dtypes, devices, layouts and memory formats are hashable
    values; any other object (a generator, an opaque constant) is keyed by identity and kept
    alive, so two programs share a module only if they name the very same object.
    """
    if x is None or isinstance(x, (bool, int, str)):
        return (type(x), x)
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, complex):
        return (complex, x.real.hex(), x.imag.hex())
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(x), x)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_leaf_key(y, keep) for y in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _leaf_key(v, keep)) for k, v in x.items()))
    keep.append(x)
    return ("id", id(x))


def _graph_key(graph: fx.Graph, keep: list[Any]) -> tuple:
    """The FX graph as a hashable value: every node's op, target and arguments, with nodes named
    by their position (names are positional already, but positions make it explicit)."""
    index: dict[fx.Node, int] = {}
    out = []

    def arg(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return ("node", index[x])
        if isinstance(x, (list, tuple)):
            return (type(x), tuple(arg(y) for y in x))
        if isinstance(x, dict):
            return (dict, tuple((k, arg(v)) for k, v in x.items()))
        return _leaf_key(x, keep)

    for i, node in enumerate(graph.nodes):
        index[node] = i
        target = node.target if node.op != "placeholder" else None
        out.append((node.op, target, arg(node.args), arg(node.kwargs)))
    return tuple(out)


def _tensor_key(t: torch.Tensor, storages: dict[int, int]) -> tuple:
    """What Inductor and AOT autograd may specialize a placeholder on: its metadata, its
    alignment, and which other placeholders share its storage and where (aliasing decides how
    input mutations are written back)."""
    storage = t.untyped_storage()
    sid = storages.setdefault(storage.data_ptr(), len(storages))
    return (
        type(t), t.dtype, t.device, t.layout, tuple(t.shape), t.stride(), t.storage_offset(),
        sid, storage.nbytes(), storage.data_ptr() % 64, t.requires_grad, t.is_conj(), t.is_neg(),
    )


def program_key(graph: fx.Graph, example: list[torch.Tensor]) -> tuple[tuple, list[Any]]:
    """The cache key of a compiled program: its FX graph (ops and constants) and the layout of
    every placeholder. Equal keys compile to interchangeable modules. Returns the key and the
    objects it names by identity (to be kept alive while the key is cached)."""
    keep: list[Any] = []
    storages: dict[int, int] = {}
    return (_graph_key(graph, keep), tuple(_tensor_key(t, storages) for t in example)), keep
