"""Checks shared by every backend that captures ``torch.cond`` / ``torch.while_loop``."""

from __future__ import annotations

import torch

from ..errors import CaptureError

__all__ = ["same_meta"]


def same_meta(a: list[torch.Tensor], b: list[torch.Tensor], what: str, why: str = "") -> None:
    """Raise :class:`CaptureError` naming both sides unless ``a`` and ``b`` (a branch's and the
    other branch's outputs, or a loop's carries and its body's results) match in number, shape,
    dtype and device. ``why`` adds what a mismatch would do on this backend."""
    if len(a) != len(b):
        raise CaptureError(f"{what}: {len(a)} outputs against {len(b)}; they must match")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise CaptureError(
                f"{what}: output {i} is {x.dtype}{list(x.shape)} on {x.device} against "
                f"{y.dtype}{list(y.shape)} on {y.device}; torch.cond and torch.while_loop require "
                f"the same shape, dtype and device{why}"
            )
