"""The capture side of :func:`accel_graph.make_graphed_callables` off native backends.

Contract: :func:`build_entries` validates the callables and their sample arguments into one
:class:`GraphedEntry` each (refusing what torch would turn into a late or silent failure);
:func:`device_of` names the one device they share; :func:`warm_up` runs each eagerly (forward
and ``autograd.grad``) so lazy initialisation stays out of the graphs; :func:`capture_entries`
captures every forward in order, then every backward in reverse order, into one pool, and
fills each entry's graphs, static outputs and gradient buffers. The replay side (the
``autograd.Function`` that replays them) is in :mod:`accel_graph.graphs.graphed_callables`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends.capture_common import islands
from ..errors import CaptureError, ConfigError
from .graph import Graph, graph
from .graphed_checks import check_module, describe, flatten_args, output_leaves

#: Why make_graphed_callables refuses eager islands (accel_graph.eager_island).
NO_ISLANDS = (
    "make_graphed_callables replays each forward and backward as one whole graph inside an "
    "autograd.Function, and gradients cannot flow through an island (its outputs are copies "
    "made outside autograd). Call the island outside the graphed callable (graph the parts "
    "before and after it separately), or capture inference with accel_graph.Graph")

__all__ = ["NO_ISLANDS", "GraphedEntry", "build_entries", "capture_entries", "device_of", "warm_up"]


@dataclass
class GraphedEntry:
    """Everything known about one callable, from validation to its built wrapper."""

    index: int
    func: Callable[..., Any]
    args: tuple[Any, ...]
    flat: tuple[torch.Tensor, ...]
    arg_spec: pytree.TreeSpec
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]  # how errors name each static input
    fwd: Graph | None = None
    bwd: Graph | None = None
    outputs: tuple[torch.Tensor, ...] = ()
    out_spec: pytree.TreeSpec | None = None
    grad_outputs: tuple[torch.Tensor | None, ...] = ()
    grad_inputs: tuple[torch.Tensor | None, ...] = ()
    #: requires_grad of each static input at capture (all False if autograd was off)
    needs_grad: tuple[bool, ...] = field(default_factory=tuple)

    @property
    def surface(self) -> tuple[torch.Tensor, ...]:
        return self.flat + self.params


def build_entries(callables: tuple[Any, ...], sample_args: Sequence[Any]) -> list[GraphedEntry]:
    """One validated entry per callable: its flattened sample arguments, its parameters (a
    module's join its static inputs) and the names errors give each static input."""
    if not isinstance(sample_args, (tuple, list)) or len(sample_args) != len(callables):
        got = len(sample_args) if isinstance(sample_args, (tuple, list)) else type(sample_args).__name__
        raise ConfigError(
            f"{len(callables)} callables were given but sample_args has {got} entries: pass one "
            f"tuple of sample arguments per callable, in the same order"
        )
    out = []
    for i, (c, args) in enumerate(zip(callables, sample_args, strict=True)):
        if not callable(c):
            raise TypeError(f"callables[{i}] is a {type(c).__name__}, not a callable or nn.Module")
        params: tuple[torch.nn.Parameter, ...] = ()
        pnames: tuple[str, ...] = ()
        if isinstance(c, torch.nn.Module):
            check_module(i, c)
            named = list(c.named_parameters())
            params, pnames = tuple(p for _, p in named), tuple(f"parameter {n!r}" for n, _ in named)
        flat, spec = flatten_args(i, args)
        names = tuple(f"argument {j}" for j in range(len(flat))) + pnames
        out.append(GraphedEntry(i, c, tuple(args), flat, spec, params, names))
    return out


def device_of(entries: list[GraphedEntry]) -> torch.device | None:
    """The one device of every static input (None when there are none: routing decides)."""
    devices = {t.device for e in entries for t in e.surface}
    if len(devices) > 1:
        raise ConfigError(
            f"the sample arguments and parameters are on several devices "
            f"({', '.join(sorted(map(str, devices)))}): a set of graphed callables shares one "
            f"pool on one device; move them to one device"
        )
    return next(iter(devices), None)


def _check_unused(e: GraphedEntry, grads: Sequence[torch.Tensor | None], wanted: list[int]) -> None:
    unused = [e.names[k] for k, g in zip(wanted, grads, strict=True) if g is None]
    if unused:
        raise CaptureError(
            f"{', '.join(unused)} of callables[{e.index}] require(s) grad but the outputs do not "
            f"depend on them, so their gradient would always be None. Pass "
            f"allow_unused_input=True to accept that, or give them requires_grad=False"
        )


def _grad(
    e: GraphedEntry, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
    allow_unused: bool,
) -> tuple[list[int], tuple[torch.Tensor | None, ...]]:
    """``autograd.grad`` of ``outputs`` with respect to the static inputs that require grad.
    Returns their positions in the surface and their gradients (None: unused)."""
    wanted = [k for k, t in enumerate(e.surface) if t.requires_grad]
    if not wanted:
        raise CaptureError(
            f"outputs of callables[{e.index}] require grad, but none of its sample arguments or "
            f"parameters does: it reads a tensor that requires grad from elsewhere (a closure, a "
            f"global), whose gradient the backward graph would silently drop. Pass that tensor "
            f"as an argument (or make it a parameter of a Module)"
        )
    grads = torch.autograd.grad(
        outputs=tuple(outputs),
        inputs=tuple(e.surface[k] for k in wanted),
        grad_outputs=tuple(grad_outputs),
        only_inputs=True,
        allow_unused=True,
    )
    if not allow_unused:
        _check_unused(e, grads, wanted)
    return wanted, grads


def _foreign_leaves(e: GraphedEntry, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that the outputs depend on but that are not static inputs:
    torch's wrapper would drop their gradients without a word."""
    own = {id(t) for t in e.surface}
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    found: list[torch.Tensor] = []
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it feeds
        if isinstance(var, torch.Tensor) and id(var) not in own:
            found.append(var)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


def warm_up(entries: list[GraphedEntry], iters: int, allow_unused: bool) -> None:
    """``iters`` eager forwards (and ``autograd.grad`` of the outputs that require grad) of
    each callable, so lazy initialisation and autotuning happen before capture."""
    for e in entries:
        for _ in range(iters):
            outs, _ = output_leaves(e.index, e.func(*e.args))
            needs = [o for o in outs if o.requires_grad]
            if needs:
                _grad(e, needs, [torch.empty_like(o) for o in needs], allow_unused)
            del outs, needs


def capture_entries(entries: list[GraphedEntry], pool: object, device: torch.device | None,
                    allow_unused: bool) -> None:
    """Forwards in order, then backwards in reverse order, all into ``pool``."""
    grad_on = torch.is_grad_enabled()
    for e in entries:
        e.fwd = Graph(device=device)
        with graph(e.fwd, pool=pool), islands.refused(NO_ISLANDS):
            result = e.func(*e.args)
        leaves, e.out_spec = output_leaves(e.index, result)
        e.outputs = tuple(leaves)
        foreign = _foreign_leaves(e, e.outputs)
        if foreign:
            raise CaptureError(
                f"the outputs of callables[{e.index}] depend on {len(foreign)} tensor(s) that "
                f"require grad but are neither its sample arguments nor its parameters (first: "
                f"{describe(foreign[0])}): the backward graph would drop their gradients. "
                f"Pass them as arguments, or make them parameters of the Module"
            )
    for e in reversed(entries):
        e.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in e.outputs)
        needs = [o for o in e.outputs if o.requires_grad]
        grads: tuple[torch.Tensor | None, ...] = ()
        wanted: list[int] = []
        if needs:
            e.bwd = Graph(device=device)
            with graph(e.bwd, pool=pool):
                wanted, grads = _grad(e, needs, [g for g in e.grad_outputs if g is not None],
                                      allow_unused)
        by_pos = dict(zip(wanted, grads, strict=True))
        e.grad_inputs = tuple(by_pos.get(k) for k in range(len(e.surface)))
        # What the graphs were made for: a live input that requires grad where this is False
        # would get no gradient (checked at each call).
        e.needs_grad = tuple(grad_on and t.requires_grad for t in e.surface)
