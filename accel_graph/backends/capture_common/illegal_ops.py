"""The aten ops a device graph cannot capture, and why: host syncs, data-dependent output
shapes, boolean-mask indexing, refused collectives.

One table for every user of it: the recorder refuses these ops when it plans them
(``backends/recorder/plan.py``), and ``check_capturable`` reports them without capturing. Each
verdict is decided once per op (and, for the few ops whose legality depends on their
arguments, per call) and cached.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._ops import OpOverload

from . import collective_rules

__all__ = [
    "ILLEGAL_OPS", "METADATA_OPS", "OBSERVER_OPS", "illegal_reason", "is_observer",
    "returns_host_value",
]

_HOST_READ_FIX = (
    "it reads a tensor value on the host, which a device graph cannot do. Keep the value on "
    "the device (torch.where, masks, clamp) instead of branching in Python, branch with "
    "torch.cond / loop with torch.while_loop (captured with their predicate read at replay), "
    "or move the read out of the captured region"
)

#: Ops refused by name, with the fix to suggest. Keys are overload-packet names.
ILLEGAL_OPS: dict[str, str] = {
    "_local_scalar_dense": "(.item(), bool(tensor), int(tensor), float(tensor), `if tensor:`) "
    + _HOST_READ_FIX,
    "is_nonzero": "(bool(tensor) / `if tensor:`) " + _HOST_READ_FIX,
    "equal": "returns a Python bool (a host sync); use torch.eq(a, b).all() and keep it a tensor",
    "allclose": "returns a Python bool (a host sync); use torch.isclose(a, b).all() and keep it a tensor",
    "nonzero": "its output shape depends on the data; use torch.nonzero_static(x, size=N) or a mask",
    "argwhere": "its output shape depends on the data; use torch.nonzero_static or a mask",
    "masked_select": "its output shape depends on the data; use torch.where(mask, x, 0) instead",
    "_unique": "its output shape depends on the data; compute unique values outside the capture",
    "_unique2": "its output shape depends on the data; compute unique values outside the capture",
    "unique_dim": "its output shape depends on the data; compute unique values outside the capture",
    "unique_consecutive": "its output shape depends on the data; compute it outside the capture",
    "unique_dim_consecutive": "its output shape depends on the data; compute it outside the capture",
    "bincount": "its output length depends on the largest value; scatter_add_/index_add_ into a "
    "tensor of fixed size instead",
    "_assert_async": "asserts read device values on the host; check the condition after replay",
    "_assert_scalar": "asserts read device values on the host; check the condition after replay",
    "item": "(.item()) " + _HOST_READ_FIX,
}

_MASK_FIX = (
    "boolean-mask indexing has a data-dependent shape (it syncs with the host); use "
    "torch.where(mask, value, x) or integer index tensors, which capture fine"
)

#: Non-tensor results that are pure metadata and safe to compute at capture.
METADATA_OPS: frozenset[str] = frozenset(
    {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
     "_has_compatible_shallow_copy_type", "size", "stride", "dim", "numel", "is_contiguous",
     "_nested_tensor_size", "is_complex", "is_floating_point", "_debug_has_internal_overlap",
     "is_set_to", "_is_zerotensor", "is_conj", "is_neg"}
)


#: Observer ops, by schema name: profiler ranges and annotations. They return a handle (a
#: ``RecordFunction`` object, or a handle tensor of the legacy ``_record_function_enter``) or
#: nothing, and read no tensor data, so they are not host reads. Capture runs them for real (the
#: range appears in a profile of the capture) and records nothing: replay runs no host-side
#: profiler ranges, as a CUDA graph does not. ``Optimizer.step`` runs inside such a range.
#: Left out on purpose: ``profiler::_call_end_callbacks_on_jit_fut`` (it chains a ``Future``,
#: asynchronous RPC work a graph cannot contain; refused as a host value).
OBSERVER_OPS: frozenset[str] = frozenset(
    {"profiler::_record_function_enter", "profiler::_record_function_enter_new",
     "profiler::_record_function_exit", "debug_mode_ops::annotate"}
)


def is_observer(func: OpOverload) -> bool:
    """Whether ``func`` is an observer op (:data:`OBSERVER_OPS`): run at capture, not recorded."""
    return func._schema.name in OBSERVER_OPS


@functools.lru_cache(maxsize=8192)
def returns_host_value(func: OpOverload) -> bool:
    """Whether the op returns a Python value (number, bool) rather than tensors: such an op
    reads tensor data on the host (a sync) unless it only reads metadata (``METADATA_OPS``)."""
    for ret in func._schema.returns:
        kind = str(ret.type)
        if "Tensor" not in kind:
            return True
    return False


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


_ARG_DEPENDENT = frozenset({"repeat_interleave", "index", "index_put", "index_put_",
                            "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"})


@functools.lru_cache(maxsize=8192)
def _static_verdict(func: OpOverload) -> tuple[bool, str | None]:
    """(depends on the arguments, reason) for ``func``, computed once per op."""
    name = func.overloadpacket.__name__
    if collective_rules.is_collective(func):  # they return Work handles, which are not host values
        return False, collective_rules.refusal(func)
    if name in ILLEGAL_OPS:
        return False, ILLEGAL_OPS[name]
    if is_observer(func):
        return False, None
    if name in _ARG_DEPENDENT:
        return True, None
    return False, _tag_reason(func, name)


def illegal_reason(func: OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why capturing ``func`` with these arguments is illegal, or None when it is legal."""
    depends, reason = _static_verdict(func)
    if not depends:
        return reason
    return _argument_reason(func, args, kwargs)


def _tag_reason(func: OpOverload, name: str) -> str | None:
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on the data, which a device graph cannot capture"
    if torch.Tag.data_dependent_output in tags or (
        returns_host_value(func) and name not in METADATA_OPS
    ):
        return "it returns a value computed on the host (a device sync); " + _HOST_READ_FIX
    return None


def _argument_reason(func: OpOverload, args: tuple, kwargs: dict) -> str | None:
    name = func.overloadpacket.__name__
    if name in ILLEGAL_OPS:
        return ILLEGAL_OPS[name]
    if name == "repeat_interleave":
        repeats = args[0] if func._overloadname == "Tensor" else (args[1] if len(args) > 1 else None)
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            size_arg = [a for a in func._schema.arguments if a.name == "output_size"]
            pos = func._schema.arguments.index(size_arg[0]) if size_arg else None
            if pos is None or len(args) <= pos or args[pos] is None:
                return (
                    "a tensor of repeat counts makes the output shape depend on the data; pass "
                    "output_size=... or repeat by a Python int"
                )
        # With output_size given the shape is known without reading the counts: legal, as in
        # torch's own docs on avoiding the sync (the op's dynamic_output_shape tag is generic).
        return None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index",
                "_unsafe_index_put"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in (indices or ())):
            return _MASK_FIX
        # Integer-tensor indexing is legal under CUDA capture (its shape is the index's shape),
        # even though the op carries the dynamic_output_shape tag for the boolean case.
        return None
    return _tag_reason(func, name)
