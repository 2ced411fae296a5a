"""Small helpers of :class:`~accel_graph.runner.GraphRunner`: input/output matching, exception
summaries, the capture progress bar."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError
from .inputs import InputSpec

__all__ = ["broadcast_outputs", "fits", "progress_bar", "reason_of"]


def fits(s: InputSpec, x: Any) -> bool:
    """Whether ``x`` matches input ``s`` in everything but the batch size."""
    if not isinstance(x, torch.Tensor) or x.dtype != s.dtype or x.device != s.device:
        return False
    if s.batch_dim is None:
        return x.shape == s.static.shape
    d = s.batch_dim
    return x.dim() == s.static.dim() and x.shape[:d] + x.shape[d + 1:] == s.static.shape[:d] + s.static.shape[d + 1:]


def broadcast_outputs(value: Any, spec: pytree.TreeSpec) -> list[int | None]:
    """Per-output batch dimension from ``output_batch_dim`` (a scalar or a matching tree)."""
    if not isinstance(value, (tuple, list, dict)):
        return [value] * spec.num_leaves
    out = pytree._broadcast_to_and_flatten(value, spec)
    if out is None:
        raise ConfigError(f"output_batch_dim={value!r} does not match the outputs' structure {spec}")
    return out


def reason_of(exc: BaseException) -> str:
    """``"ErrorType: first line of the message"``, for a bucket's reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def progress_bar(total: int, progress: bool | None) -> Any:
    """A tqdm bar over ``total`` graphs, or None when ``progress`` (None: stderr is a
    terminal) says not to show one."""
    show = progress if progress is not None else sys.stderr.isatty()
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="accel-graph capture", unit="graph", leave=False)
