"""What an op's outputs look like, worked out from metadata alone, and the key the recorder's
per-op caches share.

:func:`op_key` is the op, its arguments' metadata, the default dtype and grad mode: everything
an op's outputs and plan depend on. :func:`run_meta` runs the op on meta tensors (or, without a
meta kernel, once on zero-filled stand-ins of the same layout) to learn its outputs' shapes,
strides, dtypes and which inputs they alias, cached process-wide by op key, so repeated layers
and repeated captures (buckets) pay meta execution once. :mod:`.plan` builds on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError
from ..capture_common.frames import user_frame
from ..capture_common.pytree import tree_flatten, tree_map
from . import validate

__all__ = ["CACHE_MAX", "MetaResult", "op_key", "run_meta"]

_Tensor = torch.Tensor
_LIST_TYPES = (list, tuple)
_T = "T"

#: Bound of the process-wide caches (output metadata, plans); a full cache starts afresh.
CACHE_MAX = 1 << 16


# -- the op key ------------------------------------------------------------------------------
def _key_of(x: Any) -> Any:
    """Hashable metadata of an op argument (module level: a nested recursive function
    would be a reference cycle per op)."""
    if isinstance(x, _Tensor):
        return (_T, x.shape, x.stride(), x.dtype, x.device, x.storage_offset())
    if isinstance(x, _LIST_TYPES):
        return tuple([_key_of(y) for y in x])
    if isinstance(x, torch.Generator):
        return "G"
    # The type matters: x * 2 and x * 2.0 give different dtypes, yet 2 == 2.0.
    return (x.__class__, x)


def op_key(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The key of an op's metadata caches: the op, its arguments' metadata, the default dtype
    (factories and Python numbers take it) and grad mode (a few kernels read it, see
    :attr:`.plan.Plan.grad`). May be unhashable (callers catch TypeError)."""
    if kwargs:
        kw: Any = tuple(sorted([(n, _key_of(v)) for n, v in kwargs.items()]))
    else:
        kw = ()
    return (func, tuple([_key_of(a) for a in args]), kw, torch.get_default_dtype(),
            torch.is_grad_enabled())


# -- output metadata -------------------------------------------------------------------------
@dataclass
class MetaResult:
    """What an op returns, as metadata: its outputs on the meta device, and which input each
    output aliases."""

    out: Any  # meta outputs (pytree), or a non-tensor value
    aliases: tuple[int | None, ...] = field(default_factory=tuple)  # per flat output
    real: bool = False  # from a real run on zero stand-ins (no meta kernel), not a meta kernel


#: Output metadata by op key, shared by every capture in the process, so repeated layers and
#: repeated captures (buckets) do not pay meta execution again.
_META_CACHE: dict[Any, MetaResult] = {}


def run_meta(func: OpOverload, args: tuple, kwargs: dict, key: Any) -> MetaResult:
    """Output metadata of ``func``: meta kernels first, zero stand-ins second, else refuse.

    ``key`` is the op key (None: unhashable arguments, nothing cached)."""
    if key is not None:
        hit = _META_CACHE.get(key)
        if hit is not None:
            return hit
    try:
        result = _run_on(func, args, kwargs, "meta")
    except Exception as meta_exc:  # no meta kernel: one run on zero-filled stand-ins
        try:
            result = _run_on(func, args, kwargs, "zeros")
        except Exception as exc:
            raise CaptureError(
                f"cannot capture {func} (called at {user_frame()}): its output metadata could "
                f"not be inferred (meta kernel: {meta_exc}; stand-in run: {exc}). Move this op "
                f"out of the captured region or file an issue."
            ) from exc
    if key is not None:
        if len(_META_CACHE) >= CACHE_MAX:
            _META_CACHE.clear()
        _META_CACHE[key] = result
    return result


def _run_on(func: OpOverload, args: tuple, kwargs: dict, how: str) -> MetaResult:
    """Run ``func`` on stand-ins of its tensors (``how``: ``"meta"`` tensors, or zero-filled
    ones of the same layout; never pool memory or user tensors) and note output aliasing."""
    def convert(x: Any) -> Any:
        return validate.standin(x, how)

    m_args = tree_map(convert, args)
    m_kwargs = tree_map(convert, kwargs)
    if how == "meta" and "device" in m_kwargs:
        m_kwargs["device"] = "meta"
    with torch.no_grad():
        out = func(*m_args, **m_kwargs)
    in_storages = [
        t.untyped_storage()._cdata for t in tree_flatten((m_args, m_kwargs))[0]
        if isinstance(t, torch.Tensor)
    ]
    aliases = []
    for o in tree_flatten(out)[0]:
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()._cdata
            aliases.append(in_storages.index(s) if s in in_storages else None)
    if how != "meta":  # the real output may hold memory: keep only its metadata
        out = tree_map(lambda x: validate.standin(x, "meta"), out)
    return MetaResult(out, tuple(aliases), real=how != "meta")
