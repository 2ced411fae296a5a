"""Eager islands in a recorder capture (``accel_graph.eager_island``): capture and replay.

An island ends the piece recorded so far. At capture, inside the capturing thread:

1. the steps recorded since the last island run once, as replay would run them (capture
   computes nothing, so this is what gives the island real values: a warm-up of that piece;
   its in-place writes to captured tensors and its random draws happen now, as in a warm-up);
2. the island runs eagerly, with the recording mode lifted off the dispatch stack and the
   capture's interceptions (host reads, generator state) letting it through: ``.item()``,
   ``nonzero`` and Python ``if`` on values work there;
3. its tensor outputs are copied into static buffers allocated in the graph's pool (shape,
   dtype, device and layout fixed now), and the caller gets those buffers, in the structure
   the island returned; capture goes on with them standing for the outputs;
4. a host step (:class:`IslandCall`) is recorded: at each replay it calls the island with the
   live values (pool tensors and tensors captured by reference, as they are at that point of
   the program), under the grad, inference and autocast modes of the capture, checks its
   outputs against the buffers and copies them in.

At replay a host step is a Python call between kernels, so interpreted replay runs piece,
island, piece, ... in order; compiled replay compiles each stretch between host steps
(:mod:`.compiled.segmented`). An island output of another shape, dtype, device or structure
raises :class:`~accel_graph.errors.ReplayError` naming the island before anything is copied,
so nothing after it runs and the graph stays usable.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import CaptureError, ReplayError
from ..capture_common.dispatch_stack import lifted
from ..capture_common.frames import user_frame
from ..capture_common.islands import (
    IslandInfo,
    Runner,
    enter_island,
    leave_island,
    refusal,
    running_island,
)
from ..capture_common.pytree import tree_flatten
from . import ops as opinfo
from .program import build_replay, materialize
from .rng import HostCall
from .steps import Step

__all__ = ["IslandCall", "is_island_step", "make_runner"]

_Tensor = torch.Tensor
_InferenceMode = torch._C._InferenceMode
_set_grad_enabled = torch._C._set_grad_enabled
_WHY = ("eager island: runs eagerly at this point of each replay on the live values; its "
        "outputs are copied into the static buffers the rest of the graph reads")


class IslandCapture(Protocol):
    """What an island needs of a capture (:class:`~.capture.Capture`; typed by its surface so
    :mod:`.capture`, which installs the runner, and this module do not import each other)."""

    mode: Any
    over: str | None
    lock: Any
    device: torch.device
    pool: Any
    steps: list[Step]
    #: The capture's top-level step list (``steps`` is swapped for a cond branch's own).
    top_steps: list[Step]
    #: How many of ``top_steps`` have run (at the islands so far).
    ran_to: int
    #: Static output buffers held until the capture stops (no reuse of their memory in it).
    island_buffers: list[torch.Tensor]
    #: Pool tensors alive at the last island, held until the next one (or the capture stops).
    island_pins: list[torch.Tensor]

    def invalidate(self, func: Any, exc: BaseException) -> None: ...

    def sync_flags(self) -> None: ...

    def allocate_output(self, shape: Any, stride: Any, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor: ...

    def frozen_arg(self, x: Any) -> Any: ...

    def alive_tensors(self) -> list[torch.Tensor]: ...

    def freeze(self, x: Any) -> Any: ...


def is_island_step(step: Step) -> bool:
    """Whether ``step`` is an eager island's host step (its effects are the island's own:
    anything it writes is unknown to the program, unlike an aten op's schema)."""
    return step.kind == "host" and isinstance(step.extra, IslandCall)


def make_runner(cap: IslandCapture) -> Runner:
    """The island runner of ``cap`` (held weakly: an island called after the capture is gone,
    or over, is a plain call, as every op then runs eagerly)."""
    ref = weakref.ref(cap)

    def run(info: IslandInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        c = ref()
        if c is None or c.over is not None:
            return fn(*args, **kwargs)
        with c.lock:
            if c.over is not None:  # ended from another thread (relaxed) meanwhile
                return fn(*args, **kwargs)
            try:
                return _capture_island(c, info, fn, args, kwargs)
            except CaptureError as exc:
                c.invalidate(f"eager island {info.name}", exc)  # the capture is over, as at an op
                raise

    return run


class IslandCall:
    """The function of an island's host step: ``call(args, kwargs, buffers)`` runs the island
    on the materialized arguments, under the grad and inference mode it was captured with,
    checks its outputs against ``buffers`` (the static pool tensors, one per tensor output) and
    copies them in; :class:`ReplayError` (nothing copied) if they do not match."""

    __slots__ = ("info", "fn", "spec", "slots", "grad", "inference", "where", "autocast", "_single")

    def __init__(self, info: IslandInfo, fn: Callable[..., Any], spec: Any,
                 slots: tuple[int | None, ...], grad: bool, inference: bool, where: str,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        self.info = info
        #: The island itself; under autocast at capture, wrapped to run under it at replay
        #: too (replay runs no autocast, which works above the dispatcher).
        self.fn = fn if autocast is None else _under_autocast(fn, *autocast)
        self.autocast = autocast
        #: The output's pytree spec; ``slots[i]``: which buffer leaf i fills (None: a None leaf).
        self.spec = spec
        self.slots = slots
        self.grad = grad
        self.inference = inference
        #: The user's line that called the island at capture (for messages).
        self.where = where
        #: One tensor output returned bare: no pytree walk at replay.
        self._single = spec.is_leaf() and slots == (0,)

    def __call__(self, args: tuple, kwargs: dict, buffers: tuple) -> None:
        enter_island()  # not a context manager: this is the per-replay cost of an island
        try:
            if self.inference:
                out = self.fn(*args, **kwargs)
            else:  # replay runs under inference mode; the island runs as it was captured.
                # torch's C guard (3x cheaper than the Python context managers) restores the
                # whole autograd state on exit, grad mode included.
                with _InferenceMode(False):
                    _set_grad_enabled(self.grad)
                    out = self.fn(*args, **kwargs)
        finally:
            leave_island()
        if self._single and out.__class__ is _Tensor:
            buf = buffers[0]
            if out.shape == buf.shape and out.dtype == buf.dtype and out.device == buf.device:
                buf.copy_(out)
                return
            leaves = [out]
        else:
            leaves, spec = pytree.tree_flatten(out)
            if spec != self.spec:
                raise _island_error(
                    f"eager island {self.info} returned {_structure(out)} at replay; at capture "
                    f"(called at {self.where}) it returned {self.spec}, which fixed the static "
                    f"outputs the rest of the graph reads. {_REPLAY_FIX}")
        leaves = [_awaited(x) for x in leaves]
        for i, (slot, x) in enumerate(zip(self.slots, leaves)):
            if slot is None:
                if x is not None:
                    raise _island_error(
                        f"eager island {self.info} returned {_value(x)} as output {i} at replay, "
                        f"where it returned None at capture (called at {self.where}). {_REPLAY_FIX}")
                continue
            buf = buffers[slot]
            if not isinstance(x, _Tensor) or x.shape != buf.shape or x.dtype != buf.dtype or x.device != buf.device:
                raise _island_error(
                    f"eager island {self.info} returned {_value(x)} as output {i} at replay; at "
                    f"capture (called at {self.where}) it returned a tensor of shape "
                    f"{tuple(buf.shape)}, dtype {buf.dtype} on {buf.device}, which fixed the "
                    f"static buffer the rest of the graph reads. {_REPLAY_FIX}")
        for slot, x in zip(self.slots, leaves):
            if slot is not None:
                buffers[slot].copy_(x)


def _awaited(x: Any) -> Any:
    """``x``, or, for a functional collective's result (an ``AsyncCollectiveTensor``: a wrapper
    with no storage of its own, its collective possibly in flight), the plain tensor after its
    collective completed. An island's collectives run eagerly and complete within the island,
    as its other work does; the static buffer gets the finished value."""
    if x.__class__ is _Tensor or not isinstance(x, _Tensor):
        return x
    # Only where torch.distributed's functional collectives are loaded can such a tensor exist.
    fc = sys.modules.get("torch.distributed._functional_collectives")
    if fc is not None and isinstance(x, fc.AsyncCollectiveTensor):
        return x.trigger_wait()
    return x


def _storage_ptr(x: _Tensor) -> int | None:
    """The address of ``x``'s storage (a functional collective's result: of the tensor it
    wraps); None for a tensor subclass with no storage of its own."""
    fc = sys.modules.get("torch.distributed._functional_collectives")
    if fc is not None and isinstance(x, fc.AsyncCollectiveTensor):
        x = x.elem
    try:
        return x.untyped_storage().data_ptr()
    except RuntimeError:  # "invalid python storage": a wrapper subclass
        return None


def _under_autocast(fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


def _autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    """The autocast the capture runs under on ``device_type`` (None: off)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)


def _island_error(message: str) -> ReplayError:
    """A :class:`ReplayError` of an island's outputs; its ``island`` attribute tells
    :mod:`.compiled.first_run` that the caller's island failed, not the compiled program."""
    err = ReplayError(message)
    err.island = True  # type: ignore[attr-defined]
    return err


_REPLAY_FIX = ("Nothing after the island ran in this replay and the graph is unchanged: make "
               "the island return outputs of the captured shapes and dtypes (pad to the captured "
               "size), or reset() and capture again with the new shapes")


def _capture_island(cap: IslandCapture, info: IslandInfo, fn: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
    where = user_frame()
    reason = refusal()
    if reason is not None:
        raise CaptureError(f"eager island {info} called (at {where}) during a capture on "
                           f"{cap.device} that cannot take islands: {reason}")
    if cap.steps is not cap.top_steps:
        raise CaptureError(
            f"eager island {info} called inside a torch.cond branch or a torch.while_loop body "
            f"during capture on {cap.device} (at {where}): a branch or body is recorded whole, "
            f"without running, and replay picks it on values the capture never sees, so there "
            f"are no real values to run the island on. Call the island outside the "
            f"cond/while_loop (an island may branch on values in Python itself)")
    _check_devices(cap, info, (args, kwargs), where)
    cap.sync_flags()  # settings changed since the last op belong to the piece before the island
    _run_piece(cap)
    # Hold every pool tensor alive here until the next island: one that dies in the stretch
    # after this island would otherwise have its memory reused there by a tensor that stretch
    # writes, while the stretch also reads the dead one's value. A compiled stretch cannot
    # alias its inputs and outputs (static shapes in AOT), so segmented.py replays such a
    # stretch interpreted; held, every stretch compiles. What dies in the stretch becomes
    # reusable at the next island (the following stretches cannot read it), so the pool
    # grows by at most one stretch's dead tensors.
    cap.island_pins = []  # the last island's first: what died since must not count as alive
    cap.island_pins = cap.alive_tensors()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = _autocast_state(cap.device.type)
    with lifted(cap.mode), running_island():
        out = fn(*args, **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    leaves = [_awaited(x) for x in leaves]
    _check_outputs(cap, info, leaves, (args, kwargs), where, grad and not inference)
    # Not under inference mode: pool tensors made there would be inference tensors (the pool
    # caches the tensors it makes views of), which compiled replay and users cannot write.
    with _disable_current_modes(), torch.no_grad():
        buffers = []
        slots: list[int | None] = []
        for x in leaves:
            if x is None:
                slots.append(None)
                continue
            stride = torch.empty_like(x, device="meta").stride()  # dense layouts kept, as empty_like
            buf = cap.allocate_output(x.shape, stride, x.dtype, x.device)
            buf.copy_(x)
            slots.append(len(buffers))
            buffers.append(buf)
    cap.island_buffers.extend(buffers)
    call = IslandCall(info, fn, spec, tuple(slots), grad, inference, where, autocast)
    fargs = cap.frozen_arg(args)
    fkwargs = cap.frozen_arg(kwargs)
    out_refs = tuple([cap.freeze(b) for b in buffers])
    cap.steps.append(Step(HostCall(f"eager_island {info}", call, (fargs, fkwargs), _WHY), "host",
                          (fargs, fkwargs), {}, out_refs, opinfo.Strategy("host", why=_WHY), call))
    cap.ran_to = len(cap.steps)
    result = pytree.tree_unflatten([None if s is None else buffers[s] for s in slots], spec)
    del leaves, out
    return result


def _run_piece(cap: IslandCapture) -> None:
    """Run the steps recorded since the last island once, as replay runs them, so the island
    sees real values (the recording mode and every other mode off, as at replay)."""
    piece = cap.steps[cap.ran_to:]
    cap.ran_to = len(cap.steps)
    if not any(s.kind not in ("view", "none") for s in piece):
        return
    with _disable_current_modes():
        # Materialized outside inference mode (the pool caches the tensors it makes views of:
        # inference tensors there could not be written outside it later); run as replay runs.
        run = build_replay(materialize(piece, cap.pool), [])
        with torch.inference_mode():
            run()


def _check_devices(cap: IslandCapture, info: IslandInfo, args: Any, where: str) -> None:
    for x in tree_flatten(args)[0]:
        if isinstance(x, _Tensor) and not _same_device(x.device, cap.device):
            raise CaptureError(
                f"eager island {info} was called (at {where}) with a tensor on {x.device} (shape "
                f"{tuple(x.shape)}, {x.dtype}) during a capture on {cap.device}: the graph "
                f"replays its pieces on {cap.device}, and the island's arguments are read from "
                f"that device's memory. Move the tensor to {cap.device} before the capture, or "
                f"move it inside the island")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_outputs(cap: IslandCapture, info: IslandInfo, leaves: list, args: Any, where: str,
                   grad: bool) -> None:
    """Island outputs must be tensors (or None) of the capture's device, in fresh memory, and
    need no gradient (``grad``: grad mode was on)."""
    arg_storages = {p for x in tree_flatten(args)[0] if isinstance(x, _Tensor)
                    and (p := _storage_ptr(x))}  # 0/None: no memory, nothing shared
    for i, x in enumerate(leaves):
        if x is None:
            continue
        if not isinstance(x, _Tensor):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned {_value(x)} as output {i}: an "
                f"island's outputs must be tensors, or tuples, lists and dicts of them (None "
                f"allowed). A Python value would be baked into the graph at its capture value "
                f"while the island computes it anew at every replay. Return it as a tensor "
                f"(torch.tensor(value)), or keep the use of the value inside the island")
        if not _same_device(x.device, cap.device):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} on {x.device} "
                f"(shape {tuple(x.shape)}, {x.dtype}) during a capture on {cap.device}: its static "
                f"buffer lives in the graph's pool on {cap.device}. Return it on {cap.device} "
                f"(.to({str(cap.device)!r}) inside the island)")
        if grad and x.requires_grad:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} (shape "
                f"{tuple(x.shape)}, {x.dtype}) that requires grad, with grad mode on: gradients "
                f"cannot flow through an island (the rest of the graph reads a static copy of "
                f"its outputs, made outside autograd), so a backward would silently miss every "
                f"parameter before it. Capture inference under torch.no_grad() or "
                f"torch.inference_mode(), or detach() the output inside the island if no "
                f"gradient should flow through it")
        ptr = _storage_ptr(x)
        if ptr is None:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i}, a "
                f"{type(x).__qualname__} (shape {tuple(x.shape)}, {x.dtype}) with no storage of "
                f"its own: the graph copies each island output into a static buffer, which "
                f"needs a plain tensor. Return a plain tensor (for a tensor subclass, the tensor "
                f"it wraps)")
        if ptr in arg_storages or cap.pool.owns(x):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} (shape "
                f"{tuple(x.shape)}, {x.dtype}) sharing memory with one of its arguments: the "
                f"rest of the graph reads a static copy of each island output, so a write "
                f"through it would not reach the argument as it does in eager. Return a new "
                f"tensor (x.clone()), or return nothing and use the argument itself")


def _value(x: Any) -> str:
    if isinstance(x, _Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}"
    with running_island():  # repr of an object holding tensors is no host read to refuse here
        text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (a {type(x).__name__})"


def _structure(out: Any) -> str:
    try:
        return str(pytree.tree_flatten(out)[1])
    except Exception:  # a spec that cannot print itself
        return type(out).__name__
