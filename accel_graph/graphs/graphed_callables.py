"""``accel_graph.make_graphed_callables``: torch's partial-network capture on every backend.

Semantics are torch's (``torch.cuda.make_graphed_callables``, torch 2.13), restated:

- ``callables`` is one callable (a function or an ``nn.Module``) with ``sample_args`` one tuple
  of its arguments, or a tuple of callables with a tuple of such tuples. The arguments are
  flattened as torch flattens them (pytree leaves; dicts and lists allowed); every leaf must be
  a tensor. A module's parameters join its flattened arguments as static inputs.
- Each callable is warmed up ``num_warmup_iters`` times (forward, and ``torch.autograd.grad``
  of the outputs that require grad), then all forwards are captured in order and all
  backwards (``torch.autograd.grad`` inside a capture) in reverse order, into one shared pool
  (``pool`` or a new one), the order in which a training step runs them.
- The result wraps each pair in an ``autograd.Function``: forward copies the live arguments
  into the static ones (skipped where they are the same memory), replays the forward graph
  and returns detached static outputs; backward copies the incoming gradients into the static
  gradient buffers, replays the backward graph and returns the static gradients of the
  arguments and parameters (None for those that do not require grad).
- A module is returned with its ``forward`` replaced: the graphed forward runs while
  ``module.training`` equals its value at capture, the original forward otherwise.

On native backends (cuda, hip, xpu) the call goes to torch's own ``make_graphed_callables``
where the vendor module has one (unverified on hardware); everywhere else (the recorder, or a
native stack without it) the graphs are :class:`accel_graph.Graph` objects. Differences from
torch, all refusals of what torch would turn into a late or silent failure, are listed in
docs/recorder.md ("make_graphed_callables").

This module routes the call and holds the replay side (one ``autograd.Function`` per callable);
validation, warm-up and capture are in :mod:`accel_graph.graphs.graphed_capture`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends import select_backend
from ..backends.capture_common import islands
from ..errors import CaptureError, ConfigError, ReplayError
from .graph import graph_pool_handle
from .graphed_capture import (
    NO_ISLANDS,
    GraphedEntry,
    build_entries,
    capture_entries,
    device_of,
    warm_up,
)
from .graphed_checks import check_autocast, describe

__all__ = ["make_graphed_callables"]


class _Graphed:
    """The replay side of one graphed callable: checks live arguments and runs the graphs."""

    def __init__(self, e: GraphedEntry) -> None:
        self.e = e
        self.n_args = len(e.flat)
        self.handed_out: tuple[torch.Tensor | None, ...] = ()
        outer = self

        class GraphedFunction(torch.autograd.Function):
            # One autograd node per call: forward and backward are graph replays.
            @staticmethod
            def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                out = outer.run_forward(inputs)
                # Outputs that needed no grad at capture (eager would give them none) get none
                # here either; torch's wrapper gives every output a grad_fn.
                ctx.mark_non_differentiable(
                    *(o for o, s in zip(out, e.outputs, strict=True) if not s.requires_grad)
                )
                return out

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
                for k, wanted in enumerate(ctx.needs_input_grad):
                    if wanted and not e.needs_grad[k]:  # torch would return None: refuse
                        raise ReplayError(outer._no_grad_message(k))
                return outer.run_backward(grads)

        self.function = GraphedFunction

    def check(self, flat: Sequence[Any], spec: pytree.TreeSpec, grad_on: bool) -> bool:
        """Refuse live arguments the graphs cannot take; return whether autograd is needed."""
        e = self.e
        if spec != e.arg_spec:
            raise ReplayError(
                f"the graphed callables[{e.index}] was called with arguments structured as "
                f"{spec}, but captured with {e.arg_spec}: pass arguments in the same order and "
                f"format as its sample_args"
            )
        for k, (live, static) in enumerate(zip(flat, e.flat, strict=True)):
            if not isinstance(live, torch.Tensor):
                raise ReplayError(
                    f"argument {k} of the graphed callables[{e.index}] is a "
                    f"{type(live).__name__}; it was captured with a tensor ({describe(static)})"
                )
            if (live.shape, live.dtype, live.device) != (static.shape, static.dtype, static.device):
                raise ReplayError(
                    f"argument {k} of the graphed callables[{e.index}] has {describe(live)}, but "
                    f"it was captured with {describe(static)}: a graph replays only the shapes, "
                    f"dtypes and devices it captured. Pad or split to that shape, or graph the "
                    f"callable once per shape"
                )
        wants = grad_on and any(t.requires_grad for t in tuple(flat) + e.params)
        if wants and not any(e.needs_grad) and any(t.requires_grad for t in e.surface):
            # Graphed with autograd off although its parameters or samples require grad: no
            # backward graph exists, and the outputs would silently carry no gradient.
            k = next(i for i, t in enumerate(tuple(flat) + e.params) if t.requires_grad)
            raise ReplayError(self._no_grad_message(k))
        # Otherwise a live input that requires grad where the sample did not runs forward (as
        # in torch); its missing gradient is refused in backward, if one is ever asked for.
        return wants

    def _no_grad_message(self, k: int) -> str:
        e = self.e
        if any(t.requires_grad for t in e.surface) and not any(e.needs_grad):
            why = "make_graphed_callables ran with autograd disabled, so no backward graph was captured"
        else:
            why = "its sample did not require grad, so the backward graph does not compute it"
        return (
            f"{e.names[k]} of the graphed callables[{e.index}] requires grad, but {why}; its "
            f"gradient would be silently missing, so backward is refused. Give the sample argument the requires_grad of the "
            f"real one and graph again (with autograd enabled), or call under torch.no_grad()"
        )

    def run_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        e = self.e
        with torch.no_grad():
            for static, live in zip(e.flat, inputs[: self.n_args], strict=True):
                if static.data_ptr() != live.data_ptr():
                    static.copy_(live)
        assert e.fwd is not None
        e.fwd.replay()
        return tuple(o.detach() for o in e.outputs)

    def run_backward(self, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        e = self.e
        if e.bwd is None:  # no output required grad at capture: they depend on no input
            return (None,) * len(e.surface)
        with torch.no_grad():
            for static, g in zip(e.grad_outputs, grads, strict=True):
                if static is not None and static.data_ptr() != g.data_ptr():
                    static.copy_(g)
        e.bwd.replay()
        out = tuple(None if g is None else g.detach() for g in e.grad_inputs)
        # Held here until the next backward so that autograd cannot steal them: a leaf whose
        # .grad is None takes a gradient it holds the only reference to as its .grad (no copy),
        # and a .grad aliasing the static buffer would be overwritten by the next replay, so
        # accumulating over micro-batches would add the new gradient to itself. Held, they
        # are copied into .grad as eager's accumulation does.
        self.handed_out = out
        return out

    def __call__(self, *user_args: Any) -> Any:
        e = self.e
        flat, spec = pytree.tree_flatten(tuple(user_args))
        if isinstance(e.func, torch.nn.Module):
            self._check_params()
        if self.check(flat, spec, torch.is_grad_enabled()):
            out = self.function.apply(*flat, *e.params)
        else:  # the no-grad path: no autograd node, the forward graph alone
            out = self.run_forward(flat)
        assert e.out_spec is not None
        return pytree.tree_unflatten(list(out), e.out_spec)

    def _check_params(self) -> None:
        e = self.e
        assert isinstance(e.func, torch.nn.Module)
        now = tuple(e.func.parameters())
        if len(now) != len(e.params) or any(a is not b for a, b in zip(now, e.params, strict=True)):
            raise ReplayError(
                f"the parameters of the graphed callables[{e.index}] ({type(e.func).__name__}) "
                f"were added, removed or replaced after make_graphed_callables: the graphs read "
                f"the parameters captured then. Update parameters in place (param.data.copy_, "
                f"load_state_dict) or graph the module again"
            )


def _graphed_forward(module: torch.nn.Module, run: _Graphed, training: bool,
                     original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        # The graphs hold the train-or-eval behaviour of capture time (dropout, batch norm);
        # in the other mode the module runs eagerly, as torch does.
        if module.training == training:
            if kwargs:
                raise ReplayError(
                    f"the graphed {type(module).__name__} was called with keyword arguments "
                    f"{sorted(kwargs)}; a graphed module takes its sample_args positionally"
                )
            return run(*args)
        return original(*args, **kwargs)

    return forward


def _native_make_graphed(backend: Any, device: torch.device | None) -> Callable[..., Any] | None:
    """torch's own ``make_graphed_callables`` of a native backend's vendor module (None: the
    backend is not native, or its torch lacks it)."""
    if not backend.capabilities().native_graphs:
        return None
    module = getattr(torch, getattr(backend, "module_name", ""), None)
    return getattr(module, "make_graphed_callables", None)


def _island_refuser(dev: torch.device) -> Callable[..., Any]:
    """An island runner refusing every island inside torch's ``make_graphed_callables``."""
    def refuse(info: Any, fn: Any, args: tuple, kwargs: dict) -> Any:
        raise CaptureError(f"eager island {info} called inside make_graphed_callables on {dev}: "
                           f"{NO_ISLANDS}")
    return refuse


def _native_pool(backend: Any, device: torch.device, pool: object) -> object:
    """What torch's function takes as ``pool=``: a torch pool id. Our handles map to one."""
    if pool is None:
        return None
    handle = backend.resolve_pool(pool, backend.device_spec(device))
    torch_id = backend.pools.torch_id(handle) if hasattr(backend, "pools") else handle.id
    if torch_id is not None and hasattr(backend, "pools"):
        backend.pools.captured(handle)  # graphs now hold it: keep its torch id for later captures
    return torch_id


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: object | None = None,
) -> Any:
    """Graphed versions of ``callables`` (functions or ``nn.Module``), as torch's
    ``make_graphed_callables``: forward and backward each replay a captured graph.

    Args:
        callables: one callable, or a tuple of callables in the order they run in a step.
        sample_args: a tuple of tensors (nested tuples, lists and dicts allowed) per callable:
            the static inputs the graphs read. ``requires_grad`` of each must match the real
            argument it stands for.
        num_warmup_iters: eager forward+backward runs before capture (torch's default, 3).
        allow_unused_input: accept static inputs that require grad but that the outputs do
            not depend on (their gradient is None); else ``CaptureError``.
        pool: a pool handle to capture into; None makes one, shared by every graph made here.

    Returns:
        The graphed callable (one in, one out) or a tuple of them. Modules are returned
        themselves, with ``forward`` replaced.

    Raises:
        TypeError: a non-tensor sample argument or output. ``ConfigError``: mismatched
        ``sample_args``, a module with hooks or trainable buffers, inputs on several devices.
        ``CaptureError``: autocast with its cache on, an unused input without
        ``allow_unused_input``, outputs depending on a tensor that requires grad but is no
        static input. The graphed callables raise ``ReplayError`` for arguments of another
        structure, shape, dtype or device, for an argument that requires grad where the
        sample did not, and for parameters replaced after capture.
    """
    single = not isinstance(callables, tuple)
    funcs: tuple[Any, ...] = (callables,) if single else callables
    samples = (sample_args,) if single else sample_args
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 0:
        raise ConfigError(f"num_warmup_iters={num_warmup_iters!r}; pass an int >= 0")
    entries = build_entries(funcs, samples)
    device = device_of(entries)
    check_autocast(device)
    backend, dev = select_backend(device)
    native = _native_make_graphed(backend, device)
    if native is not None:
        torch_pool = _native_pool(backend, dev, pool)
        # torch's own capture installs no island runner: an island would be captured inline
        # and not run eagerly at replay. Refused for the whole call, as our capture refuses it.
        refuse = _island_refuser(dev)
        outer = islands.capture_runner()
        islands.set_runner(refuse)
        try:
            return native(callables, sample_args, num_warmup_iters, allow_unused_input, pool=torch_pool)
        finally:
            if outer is not None:
                islands.set_runner(outer)
            else:
                islands.clear_runner(refuse)
    if pool is None:
        pool = graph_pool_handle(dev)
    # Warm up where capture will run (a side stream on native devices; nothing on the recorder),
    # so lazy initialisation and autotuning stay out of the graphs.
    spec = backend.device_spec(dev)
    backend.synchronize(spec)
    with backend.stream_context(backend.capture_stream(spec)):
        warm_up(entries, num_warmup_iters, allow_unused_input)
    backend.synchronize(spec)
    capture_entries(entries, pool, dev, allow_unused_input)
    out: list[Any] = []
    for e in entries:
        run = _Graphed(e)
        if isinstance(e.func, torch.nn.Module):
            e.func.forward = _graphed_forward(e.func, run, e.func.training, e.func.forward)
            out.append(e.func)
        else:
            out.append(run)
    return out[0] if single else tuple(out)
