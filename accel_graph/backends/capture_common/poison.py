"""The poison fill: a value no computation gives by chance, written into memory nothing has
written yet, so reading it shows (a recorder capture's ``poison=True`` outputs, and the
runner's debug mode, which fills the outputs it hands back once they are stale)."""

from __future__ import annotations

import torch

__all__ = ["poison"]


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
