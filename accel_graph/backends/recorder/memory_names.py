"""Names for memory in log lines and fallback reasons: shape, dtype and place, never values.

A compile-fallback reason is logged and kept in ``compile_info()["fallback"]``; both end up in
users' logs, bug reports and CI output. ``repr(tensor)`` prints the tensor's values (weights,
activations, user data: issue 29 printed ``memory (tensor([-0.6165, ...]))``), so messages name
memory with :func:`describe_memory` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from .pool_protocol import ADDRESS, PoolRef

__all__ = ["describe_memory"]


def describe_memory(x: Any) -> str:
    """``x`` (a :class:`PoolRef` or a tensor) as dtype, shape and offset, without its values.

    A pool location: ``"float32 (8,) at byte 512 of pool segment 0"`` (or ``at address 0x...``
    for pools that hand out addresses). A tensor: ``"float32 (8,) tensor at element 4 of its
    storage"``. Anything else: its type name only (never its ``repr``, which may hold data).
    """
    if x.__class__ is PoolRef:
        where = (f"at address {x.byte_offset:#x}" if x.segment == ADDRESS
                 else f"at byte {x.byte_offset} of pool segment {x.segment}")
        return f"{_dtype(x.dtype)} {tuple(x.shape)} {where}"
    if isinstance(x, torch.Tensor):
        try:
            offset = f"at element {x.storage_offset()} of its storage"
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, ...)
            offset = "without a strided storage"
        return f"{_dtype(x.dtype)} {tuple(x.shape)} tensor {offset}"
    return f"a {type(x).__name__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
