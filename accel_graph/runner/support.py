"""Pieces of :class:`~accel_graph.runner.GraphRunner` kept apart to keep the core small:
the per-bucket record, input/output matching helpers, the progress bar."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError
from ..frontend import Graph
from .inputs import InputSpec

__all__ = ["Bucket", "broadcast_outputs", "fits", "progress_bar", "reason_of"]


@dataclass(eq=False)
class Bucket:
    """One bucket: its graph, static outputs and counters. ``ready`` gates the hot path."""

    size: int
    status: str = "pending"  # pending|captured|failed|over_budget|disabled
    reason: str | None = None
    graph: Graph | None = None
    replay: Callable[[], None] | None = None
    ready: bool = False  # captured and verified (or verify=False)
    verified: bool = False
    out_leaves: list[torch.Tensor] = field(default_factory=list)
    capture_ms: float | None = None
    incremental_bytes: int | None = None
    standalone_bytes: int | None = None
    pool_after_bytes: int | None = None
    replays: int = 0
    live_rows: int = 0
    verify_diff: str | None = None


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
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def progress_bar(total: int, progress: bool | None) -> Any:
    show = progress if progress is not None else sys.stderr.isatty()
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="accel-graph capture", unit="graph", leave=False)
