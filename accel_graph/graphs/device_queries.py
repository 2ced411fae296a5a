"""The module-level functions of the ``Graph`` API that take a device, not a graph:
``graph_pool_handle()`` and ``is_current_stream_capturing()`` (as ``torch.cuda``'s), routed
like ``Graph(device=...)``. Re-exported by :mod:`accel_graph.graphs.graph` and the package face.
"""

from __future__ import annotations

import torch

from ..backends import select_backend
from ..backends.base import PoolHandle

__all__ = ["graph_pool_handle", "is_current_stream_capturing"]


def graph_pool_handle(device: torch.device | str | int | None = None) -> PoolHandle:
    """A new pool handle; graphs captured with ``pool=`` this handle share memory."""
    backend, dev = select_backend(device)
    return backend.graph_pool_handle(backend.device_spec(dev))


def is_current_stream_capturing(device: torch.device | str | int | None = None) -> bool:
    """Whether a capture is underway on the current stream of ``device`` (thread, on the recorder)."""
    backend, dev = select_backend(device)
    return backend.is_capturing(dev)
