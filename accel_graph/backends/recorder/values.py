"""Small value helpers of a capture: numbers pre-wrapped for interpreted replay, and the
poison fill of fresh pool memory (debug captures)."""

from __future__ import annotations

import torch

__all__ = ["poison", "prewrapped"]

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


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with a value no computation gives by chance (NaN, True, 0x5A...): a capture's
    ``poison=True`` shows reads of pool memory nothing wrote."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)
