"""Planning: what capture decides once about an op with arguments of given metadata.

Whether an op may be captured, whether it is a view, functional or in-place, its outputs'
shapes, strides, dtypes and device, and how replay will run it depend only on the op, its
arguments' metadata (shape, stride, dtype, device and storage offset of tensors; type and value
of everything else) and the default dtype. :func:`plan_for` works that out on the first call
(output metadata from :mod:`.op_meta`) and caches it process-wide as a :class:`Plan`;
recording (:mod:`.capture`) then only allocates outputs, notes inputs and records the step. A refused op raises
:class:`~accel_graph.errors.CaptureError` naming the calling line and is never cached, so the
error always names the line that called it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError
from ..capture_common import collective_rules, illegal_ops
from ..capture_common.frames import user_frame
from ..capture_common.pytree import first_tensor, tree_flatten, tree_map
from . import collectives, validate
from . import ops as opinfo
from .op_meta import CACHE_MAX, op_key, run_meta

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_Tensor = torch.Tensor


# -- plans -----------------------------------------------------------------------------------
#: Plan kinds: what a cached op does on every later call with the same argument metadata.
#: ``RUN``: run it now and record nothing (metadata-only in-place ops such as ``t_``,
#: metadata queries, and observer ops such as profiler ranges); ``MUTATE``: in-place / ``out=``, recorded as called; ``VIEW``: run now
#: (views touch no data), replay refreshes the memory they alias; ``FUNCTIONAL``: outputs from
#: the pool, replayed by :attr:`Plan.strategy` (also ops that write an argument and return only
#: fresh tensors, such as ``rrelu_with_noise``: the replay call writes that argument again).
#: ``COLLECTIVE``: a c10d or functional collective (:mod:`.collectives`); refusals that depend on
#: the call (the Python caller, the process group) are checked on every call.
RUN, MUTATE, VIEW, FUNCTIONAL, COLLECTIVE = "run", "mutate", "view", "functional", "collective"


class Plan:
    """Everything about one (op, argument metadata) that capture decides once.

    Legality, the kind, output shapes, strides (with the channels_last rule applied), dtypes
    and device, the replay strategy and the argument positions of Python numbers to pre-wrap.
    Values of Python numbers (fill values, numbers to pre-wrap) and generators are read per
    call by the recorder, never from the plan.
    """

    __slots__ = ("kind", "rets", "specs", "device", "single", "structure", "strategy",
                 "positions", "prewrap", "grad", "meta")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        #: mutate: (index, name) of the argument each return is
        self.rets: tuple[tuple[int, str], ...] = ()
        #: functional: per flat output, (shape, stride, dtype), or (None, value) for a non-tensor
        self.specs: tuple[Any, ...] = ()
        self.device: torch.device | None = None
        self.single = False  # functional: the op returns one tensor
        self.structure: Any = None  # functional: the output pytree (meta), when not single
        self.strategy: opinfo.Strategy | None = None
        #: functional: index of each tensor output among the flat outputs
        self.positions: tuple[int, ...] = ()
        self.prewrap: tuple[int, ...] = ()  # out: argument indices holding Python numbers
        #: functional: the kernel's outputs depend on grad mode, which was on at capture:
        #: replay (under inference mode) runs the op with grad mode on
        self.grad = False
        #: functional: its tensor outputs are on the meta device (refused, except in a plan)
        self.meta = False


#: Plans by op key, shared by every capture in the process.
_PLANS: dict[Any, Plan] = {}
#: Plans made by memory plans on meta pool tensors (no real-kernel checks), by op key.
_META_PLANS: dict[Any, Plan] = {}


def plan_for(func: OpOverload, args: tuple, kwargs: dict) -> Plan | None:
    """The plan of ``func`` with arguments of this metadata: cached, or decided now.

    Raises CaptureError for what capture refuses (never cached). None: ``lift_fresh``, a
    constant made inside the capture, which the recorder handles on every call.
    """
    meta_mode = getattr(_PLANNING, "meta", False)
    try:
        key: Any = op_key(func, args, kwargs)
        plan = _PLANS.get(key)
        if plan is None and meta_mode:
            plan = _META_PLANS.get(key)
    except TypeError:  # an unhashable argument: decide afresh, cache nothing
        key, plan = None, None
    if plan is not None:
        if plan.meta and not meta_mode:
            _refuse_meta(func)
        return plan
    # A memory plan's plans skip the real-kernel checks (validate.py: they would run kernels on
    # zero copies of the weights, on the device a server is sizing): cached apart, never used
    # by a real capture.
    cache = _META_PLANS if meta_mode else _PLANS
    if collective_rules.is_collective(func):
        plan = _plan_collective(func, args, kwargs, key)
        # Only functional collectives are cached: the c10d ops' arguments include script
        # objects made afresh on every call (the reduce op), which would never hit and would
        # keep each one alive; their plan costs nothing to make again.
        if key is not None and collectives.role(func) == collectives.ISSUE:
            if len(cache) >= CACHE_MAX:
                cache.clear()
            cache[key] = plan
        return plan
    reason = illegal_ops.illegal_reason(func, args, kwargs)
    if reason is not None:
        raise CaptureError(
            f"{func} is not allowed during graph capture (called at {user_frame()}): {reason}."
        )
    if func is _LIFT_FRESH:
        return None
    tags = func.tags
    if torch.Tag.inplace_view in tags or illegal_ops.is_observer(func):
        plan = Plan(RUN)
    elif func._schema.is_mutable:
        plan = _plan_mutation(func, args, kwargs, key)
    elif illegal_ops.returns_host_value(func):
        plan = Plan(RUN)
    else:
        plan = _plan_functional(func, args, kwargs, key)
    if key is not None:
        if len(cache) >= CACHE_MAX:
            cache.clear()
        cache[key] = plan
    if plan.meta and not meta_mode:
        _refuse_meta(func)
    return plan


#: ``meta``: a memory plan records on this thread with ``meta`` pool tensors
#: (``recorder/memory_plan.py``), so outputs computed from them are meta too.
_PLANNING = threading.local()


@contextlib.contextmanager
def meta_outputs_allowed() -> Iterator[None]:
    """Within the block (this thread), functional ops whose outputs land on the meta device are
    planned instead of refused: a memory plan's pool tensors are meta tensors."""
    before = getattr(_PLANNING, "meta", False)
    _PLANNING.meta = True
    try:
        yield
    finally:
        _PLANNING.meta = before


def _refuse_meta(func: OpOverload) -> None:
    # The pool has no meta memory: its tensor would be a real one on the capture's device,
    # silently not the meta tensor eager returns. Refused instead.
    raise CaptureError(
        f"{func} makes a tensor on the meta device (called at {user_frame()}); a recorder "
        f"capture allocates every output in the graph's pool, which holds no meta tensors. "
        f"Create meta tensors outside the capture.")


def _plan_functional(func: OpOverload, args: tuple, kwargs: dict, key: Any,
                     real_check: bool = True) -> Plan:
    """``real_check=False``: trust the meta kernel (collectives: running one on stand-ins
    would issue it for real, on this rank alone)."""
    meta = run_meta(func, args, kwargs, key)
    flat_meta, _ = tree_flatten(meta.out)
    if flat_meta and all(a is not None for a in meta.aliases):
        return Plan(VIEW)
    if any(a is not None for a in meta.aliases):
        raise CaptureError(
            f"{func} returns some outputs that alias its inputs and some that do not; the "
            f"recorder cannot capture that mix (called at {user_frame()})"
        )
    plan = Plan(FUNCTIONAL)
    strategy = opinfo.choose_strategy(func, args, kwargs)
    out = meta.out
    layout = _input_layout(func, args)
    checked = (real_check and strategy.kind in ("out", "compute") and not meta.real
               and not getattr(_PLANNING, "meta", False))
    if checked:
        # The kernel that will run decides the outputs, not the meta kernel (validate.py).
        real = validate.real_run(func, args, kwargs)
        if real is not None:
            out, layout = tree_map(lambda x: validate.standin(x, "meta"), real), None
            plan.grad = torch.is_grad_enabled() and validate.depends_on_grad_mode(
                func, args, kwargs, real)
    flat_out = tree_flatten(out)[0]
    specs: list[Any] = []
    for m in flat_out:
        if not isinstance(m, torch.Tensor):
            specs.append((None, m))
            continue
        stride = m.stride()
        if layout is not None and m.dim() == layout[1]:
            stride = torch.empty_strided(m.shape, m.stride(), device="meta").contiguous(
                memory_format=layout[0]).stride()
        specs.append((m.shape, stride, m.dtype))
    plan.specs = tuple(specs)
    plan.device = _output_device(args, kwargs)
    plan.meta = plan.device.type == "meta" and any(s[0] is not None for s in specs)
    plan.single = isinstance(out, torch.Tensor)
    plan.structure = out
    plan.positions = tuple(i for i, s in enumerate(specs) if s[0] is not None)
    n_tensors = len(plan.positions)
    undefined = len(flat_out) == len(flat_meta) and any(
        o is None and isinstance(m, torch.Tensor) for o, m in zip(flat_out, flat_meta))
    if strategy.kind == "out" and undefined:
        strategy = opinfo.Strategy("compute", why=f"{func} leaves an output undefined on "
                                   f"{plan.device.type}, which {strategy.op} cannot express")
    elif strategy.kind == "out" and checked:
        assert strategy.op is not None
        failed = validate.out_call_fails(func, strategy.op, strategy.out_names, args, kwargs,
                                         [s for s in specs if s[0] is not None], plan.device)
        if failed is not None:
            strategy = opinfo.Strategy("compute", why=failed)
    if strategy.kind == "copy":
        if first_tensor((args, kwargs)) is None:
            strategy = opinfo.Strategy("compute", why="copy op without a tensor source")
    elif strategy.kind == "out" and len(strategy.out_names) != 1 and len(strategy.out_names) != n_tensors:
        strategy = opinfo.Strategy("compute", why=f"{strategy.op} out arguments do not match outputs")
    elif strategy.kind == "out":
        plan.prewrap = _number_positions(strategy.op, args)
    plan.strategy = strategy
    return plan


def _plan_collective(func: OpOverload, args: tuple, kwargs: dict, key: Any) -> Plan:
    """A collective: refused by name, or planned by its role (see :mod:`.collectives`)."""
    reason = collective_rules.refusal(func)
    if reason is not None:
        raise CaptureError(
            f"{func} is not allowed during graph capture (called at {user_frame()}): {reason}."
        )
    role = collectives.role(func)
    if role == collectives.ISSUE:
        # Outputs from the pool, as a functional op's; never run on stand-ins (validate.py).
        plan = _plan_functional(func, args, kwargs, key, real_check=False)
        if plan.kind is not FUNCTIONAL:  # pragma: no cover - collectives return new tensors
            raise CaptureError(f"{func} returned a view of its input; cannot capture it")
    else:
        plan = Plan(FUNCTIONAL)
    plan.kind = COLLECTIVE
    plan.strategy = opinfo.Strategy("collective", op=func, why=f"collective ({role}): issued and "
                                    "waited for at replay, in capture order")
    return plan


def _plan_mutation(func: OpOverload, args: tuple, kwargs: dict, key: Any) -> Plan:
    name = func.overloadpacket.__name__
    if name in ("set_", "resize_", "resize_as_", "_resize_output_", "_local_scalar_dense"):
        raise CaptureError(
            f"{func} re-points or resizes a tensor during capture (called at {user_frame()}); "
            f"allocate tensors at their final size before capture"
        )
    returns = func._schema.returns
    fresh = sum(1 for ret in returns if ret.alias_info is None)
    if fresh and fresh == len(returns):
        # Writes an argument and returns only fresh tensors (rrelu_with_noise writes its noise,
        # _native_batch_norm_legit its running stats): planned as a functional op. Its replay
        # call (the .out overload, or the op itself) writes the same arguments again, exactly
        # as eager does; the fresh results go to pool memory.
        return _plan_functional(func, args, kwargs, key)
    # Check that the op would not resize its outputs (out= with a wrong shape): replay
    # writes in place, so a resize at capture time cannot be replayed.
    meta = run_meta(func, args, kwargs, key)
    for t in _mutated_tensors(func, args, kwargs):
        if isinstance(t, torch.Tensor) and t.numel() == 0 and any(
            isinstance(m, torch.Tensor) and m.numel() for m in tree_flatten(meta.out)[0]
        ):
            raise CaptureError(
                f"{func} would resize its out= tensor during capture (called at "
                f"{user_frame()}); allocate the out= tensor with its final shape"
            )
    # In-place and out= ops return the tensors they mutate, per their schema.
    rets = []
    for ret in returns:
        alias = ret.alias_info
        where = None if alias is None else _alias_arg_position(func, alias)
        if where is None:
            # Some returns alias mutated arguments and some are fresh: no aten op does that
            # today, and recording it would need both kinds of output in one step.
            raise CaptureError(
                f"{func} returns some mutated arguments and some fresh tensors; the recorder "
                f"cannot capture that mix (called at {user_frame()})"
            )
        rets.append(where)
    plan = Plan(MUTATE)
    plan.rets = tuple(rets)
    return plan


def _mutated_tensors(func: OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    return out


def _alias_arg_position(func: OpOverload, alias: Any) -> tuple[int, str] | None:
    """(index, name) of the argument a return aliases, per the schema."""
    sets = alias.before_set
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set == sets:
            return i, a.name
    return None


def _output_device(args: tuple, kwargs: dict) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    fallback = None
    for t in tree_flatten((args, kwargs))[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if t.device.type != "cpu" or t.dim() > 0:
            return t.device
        fallback = fallback or t.device
    # No tensor and no device= (a factory without device): the op makes a host tensor, as
    # eager does; a default device set by the user reaches the dispatcher as device=.
    return fallback or torch.device("cpu")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number_positions(op: OpOverload, args: tuple) -> tuple[int, ...]:
    """Indices of ``args`` where ``op`` takes a Tensor and a Python number was given (the
    numbers the recorder pre-wraps once as 0-dim tensors); empty when there is no tensor to
    promote with."""
    params = opinfo.tensor_params(op)
    if not params or next((a for a in args if isinstance(a, _Tensor)), None) is None:
        return ()
    return tuple(i for i, _ in params if i < len(args) and _is_number(args[i]))


def _input_layout(func: OpOverload, args: tuple) -> tuple[torch.memory_format, int] | None:
    """The channels_last layout an op's output takes from its first input, if it does."""
    if func.overloadpacket.__name__ not in opinfo.LAYOUT_FOLLOWING_OPS or not args:
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_contiguous():
        return None
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last, 4
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d, 5
    return None
