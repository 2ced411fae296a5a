"""Control flow inside a recorder capture: ``torch.cond``, ``torch.while_loop`` and ``switch``.

Both are higher-order operators: a rule registered for the recording mode's class
(``HigherOrderOperator.py_impl``) receives them whole (the predicate tensor and the Python
functions) instead of torch running them on the host. The rules are wrapped to run outside
TorchDynamo: eager ``torch.cond`` calls its operator inside ``torch.compile``, whose frame
evaluation would otherwise try to trace the recorder itself. Each branch or body is recorded once, by the same recording mode and
with the same rules as the outer capture (pool memory, views, illegal ops, inputs by
reference), into a sub-program of its own; replay evaluates the predicate from the tensor at
replay time. So a replay with other data takes the other branch, or runs another number of
iterations, exactly as eager would.

- ``cond(pred, true_fn, false_fn, operands)``: the outputs are fresh pool tensors; each branch's
  sub-program ends by copying its results into them.
- ``while_loop(cond_fn, body_fn, carried, additional)``: the carried values live in static pool
  buffers, filled from the initial values by the outer program. ``cond_fn`` is a sub-program
  whose one-element result decides; ``body_fn`` is a sub-program whose results are copied back
  into the buffers (through temporaries when a result aliases a buffer, so a body that swaps or
  reads and writes the same carry sees the old values: double buffering). The buffers are the
  loop's outputs.

- ``switch(index, branches, operands)`` (torch 2.14's prototype,
  ``torch._higher_order_ops.switch``; feature-detected: torch 2.13 has no such operator): each of
  the N branches is recorded as a sub-program writing into common outputs, as ``cond``'s two
  are, and the selection is a chain of ``cond`` steps on predicates ``index == k`` recorded in
  the outer program, so replay (interpreted or compiled) reads the index at replay time with
  the machinery ``cond`` already has. Eager ``switch`` clamps the index into range before it
  calls the operator; the operator itself refuses an index out of range (AssertionError). The
  chain's last ``else`` is a host step raising :class:`~accel_graph.errors.ReplayError`, so an
  out-of-range index at replay (only reachable through the bare operator) raises, never runs a
  wrong branch. A Python int index picks its branch at capture, as eager does.

Nesting works: a branch or body calling ``torch.cond``/``torch.while_loop`` records a nested
step. Other higher-order operators have no rule for the recording mode: torch refuses them
(``NotImplementedError``) as before.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Protocol

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import CaptureError, ReplayError
from ..capture_common.control_flow import SUPPORTED, same_meta, undo_dynamo_skip
from ..capture_common.pytree import tree_flatten, tree_map
from .ops import Strategy
from .rng import HostCall
from .steps import Step

__all__ = ["record_higher_order", "register_rules"]

_FIX = ("Inside a capture the recorder supports torch.cond, torch.while_loop and torch.switch; "
        "run this operator outside the captured region")


class RecordingCapture(Protocol):
    """What recording control flow needs of a capture (:class:`~.capture.Capture` is the one
    there is; typed by its surface so this module and :mod:`.capture`, which registers the
    rules, do not import each other)."""

    #: The recording mode (entered again around each branch or body).
    mode: Any
    #: None while recording; else why the capture is over.
    over: str | None
    #: The step list being recorded into (swapped for a branch's or body's own).
    steps: list[Step]

    def invalidate(self, func: Any, exc: BaseException) -> None: ...

    def allocate_output(self, shape: Any, stride: Any, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor: ...

    def frozen_arg(self, x: Any) -> Any: ...

    def record_control(self, kind: str, extra: tuple) -> None: ...


_registered: set[type] = set()


def register_rules(mode_cls: type) -> None:
    """Register the recorder's rules for torch.cond and torch.while_loop on ``mode_cls``
    (idempotent; the first capture of the process does it)."""
    if mode_cls in _registered:
        return
    for name in SUPPORTED:
        op = getattr(torch.ops.higher_order, name, None)
        if op is None:  # switch before torch 2.14
            continue
        op.py_impl(mode_cls)(torch._disable_dynamo(functools.partial(_rule, op)))
    _registered.add(mode_cls)


def _rule(op: HigherOrderOperator, mode: Any, *args: Any, **kwargs: Any) -> Any:
    """The rule torch calls for ``op`` under a recording mode."""
    try:
        cap = mode.capture
        if cap is None or cap.over is not None:  # a capture that is over passes ops through
            with _disable_current_modes():
                return op(*args, **kwargs)
        try:
            return record_higher_order(cap, op, args, kwargs)
        except CaptureError as exc:
            cap.invalidate(op, exc)
            raise
    finally:
        undo_dynamo_skip()


def record_higher_order(cap: RecordingCapture, func: HigherOrderOperator, args: tuple,
                        kwargs: dict) -> Any:
    """Record one higher-order operator called inside ``cap``; returns what eager would."""
    name = func.name()
    if name == "cond":
        return _record_cond(cap, *args, **kwargs)
    if name == "while_loop":
        return _record_while(cap, *args, **kwargs)
    if name == "switch":
        return _record_switch(cap, *args, **kwargs)
    raise CaptureError(f"higher-order operator {name} is not supported during graph capture. {_FIX}")


def _check_pred(pred: Any, what: str) -> None:
    """torch's rule: a predicate is a one-element bool (or integer) tensor."""
    if not isinstance(pred, torch.Tensor):
        raise CaptureError(
            f"{what} must be a tensor with one element (bool), got {type(pred).__name__}; a "
            f"Python bool picks the branch at capture, which torch.cond does without a graph"
        )
    if pred.numel() != 1 or not (pred.dtype == torch.bool or not pred.is_floating_point()):
        raise CaptureError(
            f"{what} must be a one-element bool tensor, got {pred.dtype} of shape "
            f"{tuple(pred.shape)} (torch.cond requires a single boolean)"
        )


def _tensors(out: Any, what: str) -> list[torch.Tensor]:
    leaves = tree_flatten(out)[0]
    bad = [x for x in leaves if not isinstance(x, torch.Tensor)]
    if bad:
        raise CaptureError(f"{what} returned {type(bad[0]).__name__}; its outputs must be tensors")
    return leaves


def _record_sub(cap: RecordingCapture, fn: Any, operands: tuple) -> tuple[list, Any]:
    """Record ``fn(*operands)`` into a new step list; returns (steps, result)."""
    outer = cap.steps
    cap.steps = []
    try:
        # The handler runs with the mode popped: push it back for the body, under the dispatch
        # keys of the outer capture, so that the body records the same ops the outer capture
        # would (linear as t + mm, not linear whole: composite ops decompose at the autograd key).
        with _outer_dispatch_keys(), cap.mode:
            result = fn(*operands)
        return cap.steps, result
    finally:
        sub = cap.steps
        cap.steps = outer
        del sub


def _outer_dispatch_keys() -> Any:
    """Undo the autograd-key exclusion torch's cond/while_loop autograd rule puts around the
    operator (``_AutoDispatchBelowAutograd``) before it reaches the recording mode.

    Without this a branch or body records composite ops whole (``linear``, ``matmul``,
    ``softmax``) that the outer capture records decomposed (``mm``, ``bmm``, ``_softmax``); the
    composite ``.out`` kernels re-decompose at every replay, with reshapes and expands between
    (a decode step's body replayed about twice as slow as the same step captured outside the
    loop). Under inference mode the outer capture excludes the autograd keys too: left as is.
    """
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if torch.is_inference_mode_enabled() or not excluded.has(keys.AutogradOther):
        return contextlib.nullcontext()
    restored = excluded.remove(keys.AutogradOther).remove(keys.AutogradNestedTensor).remove(keys.AutogradCPU)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), restored)


def _fresh_like(cap: RecordingCapture, t: torch.Tensor) -> torch.Tensor:
    """A pool tensor with ``t``'s shape, dtype and device (and its strides where they are dense
    and non-overlapping, as ``empty_like``), booked as an output of the capture."""
    # Outside the recording mode: inside a cond branch the mode is active, and the meta
    # factory would be recorded as a step (a meta tensor Inductor's program then copied into).
    with _disable_current_modes():
        stride = torch.empty_like(t, device="meta").stride()
    return cap.allocate_output(t.shape, stride, t.dtype, t.device)


def _into_common(cap: RecordingCapture, common: list[torch.Tensor],
                 firsts: list[torch.Tensor], what: str) -> Any:
    """A wrapper making a branch copy its results into ``common`` (made, as fresh pool memory,
    by the first branch recorded; later branches must match its outputs)."""
    def wrap(fn: Any, label: str) -> Any:
        def branch(*ops: Any) -> Any:
            out = fn(*ops)
            leaves = _tensors(out, label)
            if not common:
                # Fresh pool memory, so that no branch's results (which may be views of
                # operands) are what the caller holds.
                common.extend(_fresh_like(cap, t) for t in leaves)
                firsts.extend(leaves)
            else:
                same_meta(firsts, leaves, what)
            for dst, src in zip(common, leaves):
                dst.copy_(src)  # recorded: the branch's last steps
            return out
        return branch
    return wrap


def _record_cond(cap: RecordingCapture, pred: Any, true_fn: Any, false_fn: Any,
                 operands: Any) -> Any:
    _check_pred(pred, "torch.cond's predicate")
    operands = tuple(operands)
    common: list[torch.Tensor] = []  # the outputs, made by the true branch's recording
    firsts: list[torch.Tensor] = []
    into_common = _into_common(cap, common, firsts, "torch.cond's branches")
    true_steps, true_out = _record_sub(cap, into_common(true_fn, "torch.cond's true_fn"), operands)
    false_steps, _ = _record_sub(cap, into_common(false_fn, "torch.cond's false_fn"), operands)
    firsts.clear()
    cap.record_control("cond", (cap.frozen_arg(pred), true_steps, false_steps))
    it = iter(common)
    return tree_map(lambda _: next(it), true_out)


def _record_while(cap: RecordingCapture, cond_fn: Any, body_fn: Any, carried: Any,
                  additional: Any = ()) -> Any:
    carried, additional = tuple(carried), tuple(additional)
    bad = [type(c).__name__ for c in carried if not isinstance(c, torch.Tensor)]
    if bad:
        raise CaptureError(
            f"torch.while_loop's carried_inputs must be tensors inside a capture, got {bad[0]}; "
            f"a Python number would be frozen at its capture value"
        )
    # Static carry buffers, filled from the initial values by the outer program.
    buffers = [_fresh_like(cap, c) for c in carried]
    with cap.mode:
        for b, c in zip(buffers, carried):
            b.copy_(c)
    held = {b.untyped_storage()._cdata for b in buffers}

    def body(*ops: Any) -> Any:
        new = _tensors(body_fn(*ops), "torch.while_loop's body_fn")
        same_meta(buffers, new, "torch.while_loop's carried values and body_fn's results")
        # Double buffering: a result over a carry buffer (returned as is, swapped, a view) is
        # copied out before any buffer is overwritten.
        staged = [n.clone() if n.untyped_storage()._cdata in held else n for n in new]
        for b, n in zip(buffers, staged):
            b.copy_(n)
        return None

    operands = (*buffers, *additional)
    cond_steps, pred = _record_sub(cap, cond_fn, operands)
    _check_pred(pred, "torch.while_loop's cond_fn result")
    body_steps, _ = _record_sub(cap, body, operands)
    cap.record_control("while", (cap.frozen_arg(pred), cond_steps, body_steps))
    return tuple(buffers)


def _check_index(index: Any, n: int) -> None:
    """torch's rule for a tensor index: one element, integer (or bool)."""
    if index.numel() != 1 or index.is_floating_point() or index.is_complex():
        raise CaptureError(
            f"torch.switch's index must be a one-element integer tensor (or a Python int), got "
            f"{index.dtype} of shape {tuple(index.shape)}; it selects one of {n} branches"
        )


def _control_steps(cap: RecordingCapture, kind: str, extra: tuple) -> list:
    """One control-flow step, recorded into a step list of its own (not the program)."""
    outer = cap.steps
    cap.steps = []
    try:
        cap.record_control(kind, extra)
        return cap.steps
    finally:
        cap.steps = outer


def _out_of_range_step(cap: RecordingCapture, index: torch.Tensor, n: int) -> Any:
    """The host step ending the selection chain: reached only for an index outside
    ``[0, n)``, where eager's operator raises; replay raises ReplayError the same way."""
    def out_of_range(idx: torch.Tensor) -> None:
        raise ReplayError(
            f"torch.switch's index is {int(idx.item())} at replay, out of range for its {n} "
            f"branches (0..{n - 1}); eager's switch operator refuses it too. torch's switch() "
            f"clamps its index before calling the operator: call that, or clamp the index"
        )

    why = f"torch.switch index out of range for {n} branches: raise, as eager's operator does"
    args = (cap.frozen_arg(index),)
    return Step(HostCall("switch index check", out_of_range, args, why), "host", args, {}, (),
                Strategy("host", why=why), out_of_range)


def _record_switch(cap: RecordingCapture, index: Any, branches: Any, operands: Any = ()) -> Any:
    branches, operands = tuple(branches), tuple(operands)
    n = len(branches)
    if n == 0:
        raise CaptureError("torch.switch needs at least one branch")
    if isinstance(index, int) and not isinstance(index, bool):
        # A Python int picks the branch now, as eager does (torch's switch() itself calls the
        # branch directly for an int): the branch is recorded inline.
        if not 0 <= index < n:
            raise CaptureError(f"torch.switch index {index} is out of range for {n} branches "
                               f"(eager's switch operator refuses it; torch's switch() clamps it)")
        with _outer_dispatch_keys(), cap.mode:
            return branches[index](*operands)
    if not isinstance(index, torch.Tensor):
        raise CaptureError(f"torch.switch's index must be a one-element integer tensor or an int, "
                           f"got {type(index).__name__}")
    _check_index(index, n)
    # The predicates first (recorded in the outer program, read at replay), held alive while
    # the branches record, so no branch's memory is theirs.
    with cap.mode:
        flat = index.reshape(())
        preds = [flat == k for k in range(n)]
    common: list[torch.Tensor] = []
    firsts: list[torch.Tensor] = []
    into_common = _into_common(cap, common, firsts, "torch.switch's branches")
    subs: list[list] = []
    first_out: Any = None
    for k, fn in enumerate(branches):
        steps, out = _record_sub(cap, into_common(fn, f"torch.switch's branch {k}"), operands)
        subs.append(steps)
        if k == 0:
            first_out = out
    firsts.clear()
    # cond(index == 0, branch 0, cond(index == 1, branch 1, ... cond(index == n-1, branch n-1,
    # raise))): replay reads one predicate per branch passed over, and never runs a wrong one.
    chain = [_out_of_range_step(cap, index, n)]
    for k in range(n - 1, -1, -1):
        chain = _control_steps(cap, "cond", (cap.frozen_arg(preds[k]), subs[k], chain))
    cap.steps.extend(chain)
    it = iter(common)
    return tree_map(lambda _: next(it), first_out)
