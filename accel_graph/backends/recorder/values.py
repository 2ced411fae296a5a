"""Numbers pre-wrapped for interpreted replay (the poison fill of fresh pool memory is
:mod:`accel_graph.backends.capture_common.poison`)."""

from __future__ import annotations

import torch

__all__ = ["prewrapped"]

_Tensor = torch.Tensor


def prewrapped(args: tuple, fargs: tuple, positions: tuple[int, ...]) -> tuple:
    """``fargs`` (frozen ``args``) with the Python numbers at ``positions`` pre-wrapped as
    0-dim tensors made once, for interpreted replay.

    Eager wraps such a number in a fresh float64/int64 tensor on every call and the kernel
    casts it to the computation dtype (two allocations a call on the CPU). A 0-dim tensor
    already of that dtype (``torch.result_type`` of the tensor operand and the number) gives
    the same value and the same type promotion, and replay allocates nothing for it.
    """
    first = next(a for a in args if isinstance(a, _Tensor))
    out = list(fargs)
    for i in positions:
        value = args[i]
        out[i] = torch.tensor(value, dtype=torch.result_type(first, value))
    return tuple(out)
