"""The recorder's graph pools: which pool serves a device.

Pools give captured ops their output memory with CUDA's private-pool semantics; the contract is
:class:`~.pool_protocol.GraphPool`. On the CPU, :class:`~.engine_pool.EnginePool` (blocks are
tensors that own the allocator engine's host memory, so memory of a tensor that dies during a
capture is reused); on any other device, :class:`~.device_pool.DevicePool` (the engine keeps
the books, device tensors back its segments, blocks are not recycled within a pool's life).
"""

from __future__ import annotations

import torch

from .device_pool import DevicePool
from .engine_pool import EnginePool
from .pool_protocol import GraphPool


def make_pool(device: torch.device, limit: int | None = None) -> GraphPool:
    """A new, empty pool for ``device``; ``limit`` caps its reserved bytes (None: no cap)."""
    if device.type == "cpu":
        return EnginePool(device, limit)
    return DevicePool(device, limit)
