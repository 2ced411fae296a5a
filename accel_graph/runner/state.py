"""Per-bucket user state of a :class:`~accel_graph.runner.GraphRunner`.

A server keeps state sized for the batch a graph serves: a static KV cache, attention-metadata
buffers. ``GraphRunner(..., state=factory)`` builds one object per bucket with
``factory(bucket_size)`` and passes it to the function as the keyword argument ``state``, in the
warm-up, the capture, the first-replay verification and every eager fallback at that bucket,
so a graph and its fallback read and write the same object. The graph captures the object's
tensors by reference: writes into them between replays (a prefill) are seen by the next replay.

Batches served eagerly at a size that is not a bucket (above the largest bucket, or with
``fallback="live"``) get ``factory(n)`` for their own size ``n``, built on first use and kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError

__all__ = ["StateTable", "state_tensors"]

#: How deep :func:`state_tensors` looks into plain objects' attributes (a StaticCache keeps its
#: tensors two levels down: cache.layers[i].keys).
_MAX_DEPTH = 4


def state_tensors(obj: Any, depth: int = _MAX_DEPTH) -> list[torch.Tensor]:
    """The tensors an object holds: pytree leaves, then public attributes of plain objects,
    ``depth`` levels down. Used to check a state factory's device; not a full object walk."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(x: Any, d: int) -> None:
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x)
            return
        if isinstance(x, (list, tuple, dict)):
            for leaf in pytree.tree_leaves(x):
                walk(leaf, d - 1)
            return
        if isinstance(x, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            return  # a module's parameters are not per-bucket state
        attrs = getattr(x, "__dict__", None)
        if isinstance(attrs, dict):
            for name, value in attrs.items():
                if not name.startswith("__"):
                    walk(value, d - 1)

    walk(obj, depth)
    return found


class StateTable:
    """``factory(size)`` per size, built on first use and kept; sizes are buckets or the live
    sizes of batches run eagerly at their own size."""

    def __init__(self, factory: Callable[[int], Any] | None, device: torch.device) -> None:
        if factory is not None and not callable(factory):
            raise ConfigError(
                f"state must be a callable that builds the state of one bucket from its size "
                f"(state=lambda bucket: StaticCache(...)), got {type(factory).__name__}"
            )
        self.factory = factory
        self.device = device
        self.built: dict[int, Any] = {}

    @property
    def enabled(self) -> bool:
        return self.factory is not None

    def get(self, size: int) -> Any:
        """The state for ``size``, building it on first use. ConfigError when the factory's
        object holds tensors on another device than the runner's."""
        if size in self.built:
            return self.built[size]
        assert self.factory is not None
        obj = self.factory(size)
        for t in state_tensors(obj):
            if not _same_device(t.device, self.device):
                raise ConfigError(
                    f"state(bucket={size}) returned tensors on {t.device}, but the runner runs "
                    f"on {self.device}; build the state on {self.device} (the graph reads it by "
                    f"reference, it is never copied)"
                )
        self.built[size] = obj
        return obj

    def kwargs(self, size: int) -> dict[str, Any]:
        """``{"state": ...}`` for a call at ``size``, or ``{}`` without a factory."""
        return {"state": self.get(size)} if self.factory is not None else {}


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
