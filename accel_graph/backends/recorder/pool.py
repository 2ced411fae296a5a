"""The recorder's graph pools.

A pool hands out device memory for the outputs of captured ops and knows which tensors sit on
its memory. Graphs captured with the same pool handle share one pool. This is the interface the
allocator engine backs; the implementation here is a plain Python pool with one buffer per
output.
"""

from __future__ import annotations

import threading

import torch

from ..base import PoolStats


class RecorderPool:
    """Memory for the graphs captured into one pool handle.

    ``allocate`` returns a fresh tensor over pool memory; ``owns`` says whether a tensor's
    storage is pool memory. Buffers are kept by the graphs that use them: a buffer lives while
    a graph's program or a user tensor references it, so memory never goes away under a tensor
    someone still holds.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Strong references: a storage id must not be recycled while the pool may still see it.
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._lock = threading.Lock()
        self.reserved_bytes = 0
        self.segments = 0
        self.graphs = 0

    def allocate(self, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new tensor with exactly this shape/stride/dtype over fresh pool memory."""
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            self._storages[storage._cdata] = storage
            self.reserved_bytes += nbytes
            self.segments += 1
        return t

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) lives in this pool's memory."""
        return t.untyped_storage()._cdata in self._storages

    def stats(self) -> PoolStats:
        return PoolStats(
            reserved_bytes=self.reserved_bytes,
            allocated_bytes=self.reserved_bytes,
            segments=self.segments,
            graphs=self.graphs,
        )
