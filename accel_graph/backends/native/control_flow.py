"""Control flow inside native captures (cuda, hip, xpu): ``torch.cond`` as CUDA conditional
nodes where torch can build them, and a clear :class:`~accel_graph.errors.CaptureError`
everywhere else. UNVERIFIED on hardware (docs/backends.md "Control flow").

Eager ``torch.cond`` and ``torch.while_loop`` read their predicate on the host, a sync that
stream capture refuses with a raw device error after the capture is already ruined. During
every native capture a :class:`ControlFlowMode` (a dispatch mode, thread-local, entered at
``capture_begin`` and left at ``capture_end`` or abort) receives the control-flow operators
whole and:

- ``cond``: captures both branches into CUDA conditional IF nodes through torch's own
  mechanism (``if_else_node`` of ``torch._higher_order_ops.cudagraph_conditional_nodes``, which
  drives ``torch.cuda.CUDAGraph.begin_capture_to_if_node`` / ``end_capture_to_conditional_node``;
  the same code torch's ``CUDAGraphCaptureControlFlowOpDispatchMode`` runs). Replay evaluates the
  predicate on the device. The branches are guarded so the result stays eager's: the predicate
  is copied first (a branch that writes it cannot make the other branch run too), outputs of the
  true branch that are not fresh memory (an operand, a closed-over weight, a repeated output)
  are cloned (torch copies the false branch's results into them), and the false branch must
  return the same structure, shapes and dtypes (torch would broadcast or cast silently).
- ``while_loop`` and ``switch``: through torch's while/switch-node capture where this torch has
  it (feature-detected by API, never by version string, in :mod:`.control_flow_support`; torch
  2.13 has neither), else refused.
- random ops inside a branch or body: refused (torch's rule: CUDA graphs cannot advance the RNG
  inside a conditional node).
- where conditional nodes are missing (ROCm builds, XPU, CUDA < 12.4, torch without the API):
  the operator is refused with what is missing and the recorder as the way to run the same code.

Refusals raise inside the capture; the front end aborts it (the mode leaves the stack, torch's
capture is ended and reset), so the ``Graph`` is empty and reusable and graphs captured before
keep working. :func:`warmup` is the matching warm-up context (torch's
``ControlFlowOpWarmupDispatchMode`` idea): eager warm-up runs only the branch taken, so the
other branch's first-use setup would otherwise happen inside the real capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...errors import AccelGraphError, CaptureError
from ...foundation import config
from ..capture_common.control_flow import same_meta
from ..capture_common.dispatch_stack import mode_stack, remove_mode
from .capture_errors import as_capture_error
from .control_flow_support import RECORDER_HINT, ControlFlowSupport, torch_module

#: What a shape or dtype mismatch would do to a conditional node (said in the error).
_NODE_COPY = " (a conditional node would copy one into the other, broadcasting or casting silently)"

__all__ = ["ControlFlowMode", "end", "start", "stop", "warmup"]


# -- the capture mode ---------------------------------------------------------------------------
def _key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (None for tensors without one: never counted fresh)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _tensor_leaves(out: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = pytree.tree_flatten(out)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad:
        raise CaptureError(f"{what} returned {bad[0]}; inside a native capture its outputs must "
                           f"be tensors")
    return leaves, spec


def _predicate(pred: Any, what: str) -> torch.Tensor:
    """A fresh 0-dim bool copy of ``pred`` (integer tensors: nonzero is true, as eager's
    ``bool(pred)``), so no branch can write the value the other branch's node reads."""
    if not isinstance(pred, torch.Tensor):
        raise CaptureError(f"{what} must be a one-element bool tensor on the device, got "
                           f"{type(pred).__name__} (a Python value picks a branch at capture)")
    if pred.numel() != 1 or pred.is_floating_point() or pred.is_complex():
        raise CaptureError(f"{what} must be a one-element bool (or integer) tensor, got "
                           f"{pred.dtype} of shape {tuple(pred.shape)}")
    return pred.reshape(()) != 0


class ControlFlowMode(TorchDispatchMode):
    """The dispatch mode active during one native capture (see the module docstring).

    ``ignore_compile_internals``: ``torch.compile``'d code inside the capture still compiles, as
    without the mode (torch's own conditional-node modes do the same)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, support: ControlFlowSupport, device: object) -> None:
        super().__init__()
        self.support = support
        self.device = device
        self.thread = threading.current_thread()
        #: False once the capture is over: every op then passes through (the mode may still be
        #: on a thread's stack, e.g. when another thread aborted the capture).
        self.active = True
        self.depth = 0  # conditional bodies being captured (random ops refused inside)
        #: Storages made inside the bodies being captured (outputs of ops whose inputs do not
        #: hold them): such a branch output is fresh memory, anything else gets cloned.
        self.fresh: set[int] = set()
        #: Why the capture cannot be used (an error left a conditional body), else None.
        self.broken: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        try:
            return self._dispatch(func, args, kwargs)
        except RuntimeError as exc:
            # torch's raw "operation not permitted when stream is capturing" becomes the
            # CaptureError the recorder raises for the same code (native_capture_errors).
            err = as_capture_error(func, self.device, exc)
            if err is None:
                raise
            raise err from exc

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.active:
            return func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            handler = _HANDLERS.get(func.name())
            return func(*args, **kwargs) if handler is None else handler(self, func, args, kwargs)
        if not self.depth:
            return func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise CaptureError(
                f"{func} draws random numbers inside a torch.cond branch or torch.while_loop "
                f"body captured on {self.device}: CUDA graphs cannot advance the generator inside "
                f"a conditional node (torch refuses it too). Draw the random values before the "
                f"torch.cond and pass them in as operands, or capture with the recorder "
                f"(device='cpu')"
            )
        out = func(*args, **kwargs)
        held = {_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            key = _key(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in held:
                self.fresh.add(key)
        return out

    @contextlib.contextmanager
    def body(self) -> Iterator[None]:
        """Capture a conditional body: this mode on the stack again, random ops refused. An
        error leaving it breaks the capture (torch's node may be half-built): :func:`end`."""
        self.depth += 1
        try:
            with self:
                yield
        except BaseException as exc:
            self.broken = self.broken or f"{type(exc).__name__}: {str(exc)[:300]}"
            raise
        finally:
            self.depth -= 1
            if not self.depth:
                self.fresh.clear()

    def call_torch(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run torch's node builder ``fn`` as a body; torch's refusals become CaptureError."""
        try:
            with self.body():
                return fn(*args, **kwargs)
        except AccelGraphError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise CaptureError(
                f"torch.{op} could not be captured into a {self.support.kind} conditional node on "
                f"{self.device}: {exc}. The predicate must be a one-element bool tensor on "
                f"{self.device}; warm up under backend.control_flow_warmup(spec) first (as "
                f"GraphRunner does). {RECORDER_HINT}"
            ) from exc


def _cond(mode: ControlFlowMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    missing = mode.support.cond
    if missing:
        raise mode.support.refusal("cond", mode.device)
    pred, true_fn, false_fn, operands = (*args, *kwargs.values())[:4]
    p = _predicate(pred, "torch.cond's predicate")
    first: list[torch.Tensor] = []
    spec: list[Any] = []

    def on_true(*ops: Any) -> Any:
        # Fresh means made by this branch: a tensor an enclosing branch made earlier may be
        # this cond's operand, which the false branch's copy must not overwrite.
        outer, mode.fresh = mode.fresh, set()
        try:
            leaves, out_spec = _tensor_leaves(true_fn(*ops), "torch.cond's true_fn")
        finally:
            made, mode.fresh = mode.fresh, outer | mode.fresh
        claimed: set[int] = set()
        outs = []
        for t in leaves:
            # torch copies the false branch's results into these: they must be memory of their
            # own, never an operand, a weight or another output.
            if _key(t) is None or _key(t) not in made or _key(t) in claimed:
                t = t.clone()
            claimed.add(_key(t))
            outs.append(t)
        first.extend(outs)
        spec.append(out_spec)
        return pytree.tree_unflatten(outs, out_spec)

    def on_false(*ops: Any) -> Any:
        out = false_fn(*ops)
        leaves, out_spec = _tensor_leaves(out, "torch.cond's false_fn")
        if spec and out_spec != spec[0]:
            raise CaptureError(f"torch.cond's branches return different structures: {spec[0]} "
                               f"against {out_spec}")
        same_meta(first, leaves, "torch.cond's branches", _NODE_COPY)
        return out

    api = torch_module()
    return mode.call_torch("cond", api.if_else_node, p, on_true, on_false, tuple(operands))


def _while(mode: ControlFlowMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    if mode.support.while_loop:
        raise mode.support.refusal("while_loop", mode.device)
    api = torch_module()
    can = getattr(api, "_can_capture_while_loop", None)
    if can is not None and not can(args, kwargs):
        raise CaptureError(
            f"torch's while-node capture refuses this torch.while_loop on {mode.device}: the "
            f"carried inputs must be tensors on the device, additional inputs device tensors or "
            f"Python values, and the body must not write its inputs. {RECORDER_HINT}")
    cond_fn, body_fn, carried, *rest = args
    n = len(carried)

    def cond(*ops: Any) -> torch.Tensor:
        return _predicate(cond_fn(*ops), "torch.while_loop's cond_fn result")

    def body(*ops: Any) -> tuple[torch.Tensor, ...]:
        new, _ = _tensor_leaves(body_fn(*ops), "torch.while_loop's body_fn")
        same_meta(list(ops[:n]), new, "torch.while_loop's carried values and body_fn's results", _NODE_COPY)
        # torch copies the results into the carries one by one: a result that is a carry (or a
        # view of one: returned as is, swapped) is read before it is overwritten.
        state = {_key(t) for t in ops[:n]}
        return tuple(t.clone() if _key(t) in state else t for t in new)

    return mode.call_torch("while_loop", api.while_loop_node, cond, body, carried, *rest, **kwargs)


def _switch(mode: ControlFlowMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    if mode.support.switch:
        raise mode.support.refusal("switch", mode.device)
    return mode.call_torch("switch", torch_module().switch_node, *args, **kwargs)


_HANDLERS: dict[str, Callable[[ControlFlowMode, HigherOrderOperator, tuple, dict], Any]] = {
    "cond": _cond, "while_loop": _while, "switch": _switch,
}


# -- lifecycle (called by backends/native/graph_impl.py) --------------------------------------------
def start(support: ControlFlowSupport, device: object) -> ControlFlowMode | None:
    """Enter a fresh mode on this thread for a capture beginning on ``device``; modes left on
    this thread's stack by captures that ended elsewhere are taken off first. None (no mode:
    torch.cond runs as plain torch) when ``ACCEL_GRAPH_NATIVE_CONTROL_FLOW=0``."""
    if not config.native_control_flow():
        return None

    for m in mode_stack():
        if isinstance(m, ControlFlowMode) and not m.active:
            remove_mode(m)
    mode = ControlFlowMode(support, device)
    mode.__enter__()
    return mode


def stop(mode: ControlFlowMode | None) -> None:
    """The capture is over (idempotent): the mode passes ops through from now on and leaves
    the stack when this is its thread (else at that thread's next :func:`start`)."""
    if mode is None:
        return
    mode.active = False
    if mode.thread is threading.current_thread():
        remove_mode(mode)


def end(mode: ControlFlowMode | None) -> None:
    """:func:`stop` at a normal capture end; raises ``CaptureError`` when an error left a
    conditional body during the capture (caught by user code, the capture went on): the
    graph would hold a half-built conditional node, so it must not be used."""
    stop(mode)
    if mode is not None and mode.broken:
        raise CaptureError(
            f"the capture on {mode.device} is invalid: an error left a torch.cond/while_loop "
            f"body during it ({mode.broken}), so its conditional node is half-built; capture "
            f"again without that error")


# -- warm-up ------------------------------------------------------------------------------------
class _WarmupMode(TorchDispatchMode):
    """Eager everything; a ``cond``/``while_loop`` is first captured with both branches into a
    throwaway relaxed graph (nothing runs), so every branch's first-use setup happens here."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, support: ControlFlowSupport, module: Any, device: object) -> None:
        super().__init__()
        self.support, self.module, self.device = support, module, device
        self.stream: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.name() if isinstance(func, HigherOrderOperator) else None
        if name in _HANDLERS and not self.support.missing(name):
            mod = self.module
            if self.stream is None:
                self.stream = mod.Stream()
            graph = mod.CUDAGraph()
            # Only the capture mode sees the throwaway capture: modes below (an undo log, a
            # counter) would otherwise take captured, never-run ops for real work.
            with _disable_current_modes(), mod.stream(self.stream):
                # relaxed: first-use setup (handles, workspaces) is allowed in this capture
                graph.capture_begin(capture_error_mode="relaxed")
                mode = start(self.support, self.device)
                done = False
                try:
                    func(*args, **kwargs)
                    done = True
                finally:
                    stop(mode)
                    try:
                        graph.capture_end()
                    except Exception:
                        if done:  # else the body's own error is the one to see
                            raise
            graph.reset()  # thrown away: nothing of it ever runs
        return func(*args, **kwargs)


def warmup(support: ControlFlowSupport, module: Any, device: object) -> contextlib.AbstractContextManager[Any]:
    """A context for the eager warm-up before a native capture with ``torch.cond``: both
    branches are captured once into a throwaway graph (torch's ``ControlFlowOpWarmupDispatchMode``
    does the same). A no-op where nothing can be captured natively."""
    if (support.cond and support.while_loop and support.switch) or not config.native_control_flow():
        return contextlib.nullcontext()
    return _WarmupMode(support, module, device)
