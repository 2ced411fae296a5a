"""An eager island's arguments and outputs, checked the same way on every backend that runs
islands (the recorder's ``backends/recorder/islands.py``, the native backends'
``backends/native/pieces.py``), and the step that replays an island (:class:`IslandCall`).

At capture (:func:`check_argument_devices`, :func:`check_outputs`): arguments on the capture's
device; outputs tensors (or tuples, lists and dicts of them, None allowed) on that device, in
memory of their own (not an argument's, not the graph pool's), needing no gradient under grad
mode. Anything else is a :class:`~accel_graph.errors.CaptureError` naming the island, the value
and what to do.

At replay (:class:`IslandCall`): the island runs on the live values under the grad, inference
and autocast modes of its capture; its outputs must have the captured structure, shapes, dtypes
and devices, else :class:`~accel_graph.errors.ReplayError` (built by :func:`island_error`)
before anything is copied, so nothing after the island runs and the graph stays usable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ...errors import CaptureError, ReplayError
from .islands import IslandInfo, enter_island, leave_island, running_island
from .pytree import tree_flatten

__all__ = [
    "REPLAY_FIX", "IslandCall", "autocast_state", "awaited", "check_argument_devices", "check_outputs",
    "describe_structure", "describe_value", "held_storages", "is_island_exception", "island_error",
    "mark_island_exception", "same_device", "storage_ptr",
]

_Tensor = torch.Tensor
_InferenceMode = torch._C._InferenceMode
_set_grad_enabled = torch._C._set_grad_enabled

REPLAY_FIX = ("Nothing after the island ran in this replay and the graph is unchanged: make "
              "the island return outputs of the captured shapes and dtypes (pad to the captured "
              "size), or reset() and capture again with the new shapes")


class IslandCall:
    """Replays one island: ``call(args, kwargs, buffers)`` runs it on ``args``/``kwargs`` (the
    live values), under the grad and inference mode it was captured with, checks its outputs
    against ``buffers`` (the static pool tensors, one per tensor output) and copies them in;
    :class:`ReplayError` (nothing copied) if they do not match.

    ``replay_inference``: replay already runs under inference mode (the recorder's does), so an
    island captured under it needs no guard of its own; native replay runs in the caller's
    modes, so the island's are set around it."""

    __slots__ = ("info", "fn", "spec", "slots", "grad", "inference", "where", "autocast",
                 "_single", "_guard_inference")

    def __init__(self, info: IslandInfo, fn: Callable[..., Any], spec: Any,
                 slots: tuple[int | None, ...], grad: bool, inference: bool, where: str,
                 autocast: tuple[str, torch.dtype] | None = None, *,
                 replay_inference: bool = True) -> None:
        self.info = info
        #: The island itself; under autocast at capture, wrapped to run under it at replay
        #: too (the recorder's replay runs no autocast, which works above the dispatcher).
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
        self._guard_inference = inference and not replay_inference

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The island's outputs on ``args``/``kwargs``, computed eagerly in its captured modes."""
        enter_island()  # not a context manager: this is the per-replay cost of an island
        try:
            if self._guard_inference:
                with _InferenceMode(True):
                    return self.fn(*args, **kwargs)
            if self.inference:
                return self.fn(*args, **kwargs)
            # torch's C guard (3x cheaper than the Python context managers) restores the whole
            # autograd state on exit, grad mode included.
            with _InferenceMode(False):
                _set_grad_enabled(self.grad)
                return self.fn(*args, **kwargs)
        except BaseException as exc:
            mark_island_exception(exc)
            raise
        finally:
            leave_island()

    def __call__(self, args: tuple, kwargs: dict, buffers: tuple) -> None:
        # run() and copy_out() inlined for a bare tensor output: this is the per-replay cost.
        enter_island()
        try:
            if self._guard_inference:
                with _InferenceMode(True):
                    out = self.fn(*args, **kwargs)
            elif self.inference:
                out = self.fn(*args, **kwargs)
            else:
                with _InferenceMode(False):
                    _set_grad_enabled(self.grad)
                    out = self.fn(*args, **kwargs)
        except BaseException as exc:  # no cost on the path that raises nothing
            mark_island_exception(exc)
            raise
        finally:
            leave_island()
        if self._single and out.__class__ is _Tensor:
            buf = buffers[0]
            if out.shape == buf.shape and out.dtype == buf.dtype and out.device == buf.device:
                buf.copy_(out)
                return
        self.copy_out(out, buffers)

    def copy_out(self, out: Any, buffers: tuple) -> None:
        """Check ``out`` against the captured outputs and copy it into ``buffers``."""
        if self._single and out.__class__ is _Tensor:
            buf = buffers[0]
            if out.shape == buf.shape and out.dtype == buf.dtype and out.device == buf.device:
                buf.copy_(out)
                return
            leaves = [out]
        else:
            leaves, spec = pytree.tree_flatten(out)
            if spec != self.spec:
                raise island_error(
                    f"eager island {self.info} returned {describe_structure(out)} at replay; at "
                    f"capture (called at {self.where}) it returned {self.spec}, which fixed the "
                    f"static outputs the rest of the graph reads. {REPLAY_FIX}")
            leaves = [awaited(x) for x in leaves]
        for i, (slot, x) in enumerate(zip(self.slots, leaves)):
            if slot is None:
                if x is not None:
                    raise island_error(
                        f"eager island {self.info} returned {describe_value(x)} as output {i} at "
                        f"replay, where it returned None at capture (called at {self.where}). "
                        f"{REPLAY_FIX}")
                continue
            buf = buffers[slot]
            if not isinstance(x, _Tensor) or x.shape != buf.shape or x.dtype != buf.dtype or x.device != buf.device:
                raise island_error(
                    f"eager island {self.info} returned {describe_value(x)} as output {i} at "
                    f"replay; at capture (called at {self.where}) it returned a tensor of shape "
                    f"{tuple(buf.shape)}, dtype {buf.dtype} on {buf.device}, which fixed the "
                    f"static buffer the rest of the graph reads. {REPLAY_FIX}")
        for slot, x in zip(self.slots, leaves):
            if slot is not None:
                buffers[slot].copy_(x)


def _under_autocast(fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


def autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    """The autocast the capture runs under on ``device_type`` (None: off)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return device_type, torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        return None


def island_error(message: str) -> ReplayError:
    """A :class:`ReplayError` of an island's outputs; its ``island`` attribute tells the
    recorder's checked first run that the caller's island failed, not the compiled program."""
    err = ReplayError(message)
    err.island = True  # type: ignore[attr-defined]
    mark_island_exception(err)
    return err


#: Set on an exception an island raised (its own, or :func:`island_error`'s) at replay.
_ISLAND_EXCEPTION = "_accel_graph_island_error"


def mark_island_exception(exc: BaseException) -> None:
    """Mark ``exc`` as raised by an island at replay: the caller's error, never a failure of
    the program around it (the recorder's checked first compiled run lets it through instead of
    falling back to interpreted replay)."""
    try:
        setattr(exc, _ISLAND_EXCEPTION, True)
    except Exception:  # an exception type that takes no attributes: left unmarked
        pass


def is_island_exception(exc: BaseException) -> bool:
    """Whether an island raised ``exc`` at replay (:func:`mark_island_exception`)."""
    return bool(getattr(exc, _ISLAND_EXCEPTION, False))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_argument_devices(info: IslandInfo, args: Any, where: str, device: torch.device) -> None:
    """``CaptureError`` for a tensor argument of the island that is not on ``device``."""
    for x in tree_flatten(args)[0]:
        if isinstance(x, _Tensor) and not same_device(x.device, device):
            raise CaptureError(
                f"eager island {info} was called (at {where}) with a tensor on {x.device} (shape "
                f"{tuple(x.shape)}, {x.dtype}) during a capture on {device}: the graph "
                f"replays its pieces on {device}, and the island's arguments are read from "
                f"that device's memory. Move the tensor to {device} before the capture, or "
                f"move it inside the island")


def check_outputs(info: IslandInfo, leaves: list, args: Any, where: str, device: torch.device,
                  grad: bool, owns: Callable[[torch.Tensor], bool] | None = None,
                  held: frozenset[int] | set[int] = frozenset()) -> None:
    """Island outputs (``leaves``, flattened) must be tensors (or None) of ``device``, in fresh
    memory (not an argument's storage, nor one ``owns`` claims: the graph pool's, nor one in
    ``held``: :func:`held_storages` of the island, nor another output's), and need no
    gradient (``grad``: grad mode was on). ``CaptureError`` naming the output otherwise.

    Why fresh memory: the rest of the graph reads a static copy of each output, so a write
    through an output that shares memory with anything would not reach it, as it does in eager
    (a silent wrong result)."""
    arg_storages = {p for x in tree_flatten(args)[0] if isinstance(x, _Tensor)
                    and (p := storage_ptr(x))}  # 0/None: no memory, nothing shared
    seen: dict[int, int] = {}  # storage address -> the first output living there
    for i, x in enumerate(leaves):
        if x is None:
            continue
        if not isinstance(x, _Tensor):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned {describe_value(x)} as output "
                f"{i}: an island's outputs must be tensors, or tuples, lists and dicts of them "
                f"(None allowed). A Python value would be baked into the graph at its capture "
                f"value while the island computes it anew at every replay. Return it as a tensor "
                f"(torch.tensor(value)), or keep the use of the value inside the island")
        if not same_device(x.device, device):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} on {x.device} "
                f"(shape {tuple(x.shape)}, {x.dtype}) during a capture on {device}: its static "
                f"buffer lives in the graph's pool on {device}. Return it on {device} "
                f"(.to({str(device)!r}) inside the island)")
        if grad and x.requires_grad:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} (shape "
                f"{tuple(x.shape)}, {x.dtype}) that requires grad, with grad mode on: gradients "
                f"cannot flow through an island (the rest of the graph reads a static copy of "
                f"its outputs, made outside autograd), so a backward would silently miss every "
                f"parameter before it. Capture inference under torch.no_grad() or "
                f"torch.inference_mode(), or detach() the output inside the island if no "
                f"gradient should flow through it")
        ptr = storage_ptr(x)
        if ptr is None:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i}, a "
                f"{type(x).__qualname__} (shape {tuple(x.shape)}, {x.dtype}) with no storage of "
                f"its own: the graph copies each island output into a static buffer, which "
                f"needs a plain tensor. Return a plain tensor (for a tensor subclass, the tensor "
                f"it wraps)")
        if ptr and ptr in seen:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned outputs {seen[ptr]} and {i} "
                f"sharing memory (the same tensor twice, or views of one): each output gets a "
                f"static buffer of its own, so a write through one would not show in the other "
                f"as it does in eager. Return the tensor once, or return independent tensors "
                f"(.clone() one of them)")
        seen.setdefault(ptr, i)
        if ptr and ptr in held:
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} (shape "
                f"{tuple(x.shape)}, {x.dtype}) sharing memory with a tensor the island holds (a "
                f"parameter, buffer or tensor attribute of its module, or a tensor in its closure "
                f"or globals): the rest of the graph reads a static copy of each island output, "
                f"so a write through it would not reach that tensor as it does in eager. Return "
                f"a new tensor (x.clone()), or read the held tensor outside the island")
        if ptr in arg_storages or (owns is not None and owns(x)):
            raise CaptureError(
                f"eager island {info} (called at {where}) returned output {i} (shape "
                f"{tuple(x.shape)}, {x.dtype}) sharing memory with one of its arguments (or a "
                f"static tensor of the graph's pool): the rest of the graph reads a static copy "
                f"of each island output, so a write through it would not reach that tensor as "
                f"it does in eager. Return a new tensor (x.clone()), or return nothing and use "
                f"the tensor itself")


def held_storages(fn: Any) -> set[int]:
    """Storage addresses of the tensors island ``fn`` holds, as far as they can be found
    cheaply: the parameters, buffers and tensor attributes of the module a bound ``forward``
    belongs to (and of its submodules), and tensors (or modules) in the function's closure and
    in the globals its code names. Called at capture only."""
    ptrs: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, _Tensor):
            p = storage_ptr(v)
            if p:
                ptrs.add(p)
        elif isinstance(v, torch.nn.Module):
            for m in v.modules():
                for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
                    if isinstance(t, _Tensor):
                        add(t)

    for _ in range(32):  # a bounded walk down __wrapped__ chains
        add(getattr(fn, "__self__", None))
        func = getattr(fn, "__func__", fn)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        code, names = getattr(func, "__code__", None), getattr(func, "__globals__", None)
        if code is not None and isinstance(names, dict):
            for name in code.co_names:
                add(names.get(name))
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            break
        fn = inner
    return ptrs


def awaited(x: Any) -> Any:
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


def storage_ptr(x: torch.Tensor) -> int | None:
    """The address of ``x``'s storage (a functional collective's result: of the tensor it
    wraps); None for a tensor subclass with no storage of its own."""
    fc = sys.modules.get("torch.distributed._functional_collectives")
    if fc is not None and isinstance(x, fc.AsyncCollectiveTensor):
        x = x.elem
    try:
        return x.untyped_storage().data_ptr()
    except RuntimeError:  # "invalid python storage": a wrapper subclass
        return None


def describe_value(x: Any) -> str:
    """A short description of ``x`` for an error message (a tensor by its metadata)."""
    if isinstance(x, _Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}"
    with running_island():  # repr of an object holding tensors is no host read to refuse here
        text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (a {type(x).__name__})"


def describe_structure(out: Any) -> str:
    """The pytree structure of ``out`` for an error message."""
    try:
        return str(pytree.tree_flatten(out)[1])
    except Exception:  # a spec that cannot print itself
        return type(out).__name__
