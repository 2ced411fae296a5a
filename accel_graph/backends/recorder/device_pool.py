"""Graph pools on devices other than the CPU: the engine keeps the books, device tensors the memory.

The allocator engine runs on its counting upstream (fake addresses, no memory) with the
``native`` policy, so placement, rounding, segment sizes, the limit and every figure are the
caching allocator's, as on the CPU pool. Each engine segment is backed by one ``uint8`` device
tensor made when the segment appears; a block is a view of its segment's tensor at the block's
offset. (A device upstream in the engine exists only for CUDA and HIP; this pool serves any
device torch has, MPS and PrivateUse1 included.)

Deaths of blocks cannot be observed here: every block of a segment shares the segment tensor's
storage, so no finalizer can tell when one block's last tensor died. Blocks are therefore never
freed within a pool's life (memory-safe, less compact than the CPU pool), and once no capture
and no graph uses the pool it forgets its books: a fresh engine, our segment tensors dropped.
Tensors the user still holds keep their memory alive through torch's own reference counting.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from ...allocator.core.engine import Engine
from ...allocator.core.settings import EngineSettings
from ...errors import OutOfMemoryError
from .pool_protocol import GraphPool, PoolRef, storage_bytes


class DevicePool(GraphPool):
    """A graph pool on any torch device: engine books, one device tensor per engine segment.

    ``limit`` caps the bytes the pool reserves (None: no cap).
    """

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        super().__init__(device)
        self._limit = limit
        self.engine = Engine(policy="native", upstream="counting", settings=EngineSettings(cap=limit))
        # Segments by fake base address: (size, uint8 device tensor), and a sorted index of
        # (address, size) to find the segment of a block.
        self._segments: dict[int, tuple[int, torch.Tensor]] = {}
        self._index: list[tuple[int, int]] = []
        self._bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    # -- memory ----------------------------------------------------------------------------
    def allocate(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = storage_bytes(shape, stride, dtype.itemsize)
        with self._lock:
            try:
                addr = self.engine.malloc(max(nbytes, 1))
            except OutOfMemoryError as exc:
                raise self.out_of_memory(exc) from exc
            try:
                seg_addr = self._segment_of(addr)
            except (MemoryError, RuntimeError) as exc:  # the device refused the segment
                self.engine.free(addr)
                self.engine.empty_cache()  # blocks are never freed here: only that one is free
                raise OutOfMemoryError(
                    f"graph pool on {self.device} could not get a segment for a block of "
                    f"{nbytes} bytes from the device: {exc}"
                ) from exc
            base = self._base(seg_addr, dtype)
            t = torch.as_strided(base, tuple(shape), tuple(stride), (addr - seg_addr) // dtype.itemsize)
            self._storages[t.untyped_storage()._cdata] = (seg_addr, 0)
            self._log_alloc(nbytes)
        return t

    def _segment_of(self, addr: int) -> int:
        """Base address of the engine segment holding ``addr``; backs new segments with device
        tensors (may raise the device's out-of-memory error)."""
        i = bisect.bisect_right(self._index, (addr, float("inf"))) - 1
        if i >= 0 and addr < self._index[i][0] + self._index[i][1]:
            return self._index[i][0]
        for seg in self.engine.layout():
            start, size = seg["address"], seg["size"]
            if start not in self._segments:
                memory = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._segments[start] = (size, memory)
                bisect.insort(self._index, (start, size))
        i = bisect.bisect_right(self._index, (addr, float("inf"))) - 1
        return self._index[i][0]

    def _base(self, seg_addr: int, dtype: torch.dtype) -> torch.Tensor:
        """The segment's memory as a flat tensor of ``dtype`` (cached per segment and dtype)."""
        base = self._bases.get((seg_addr, dtype))
        if base is None:
            size, memory = self._segments[seg_addr]
            base = self._bases[(seg_addr, dtype)] = memory[: size - size % dtype.itemsize].view(dtype)
        return base

    def materialize(self, ref: PoolRef) -> torch.Tensor:
        itemsize = ref.dtype.itemsize
        if ref.byte_offset % itemsize:
            raise ValueError(f"misaligned {ref.dtype} view at byte {ref.byte_offset}")
        with self._lock:
            base = self._base(ref.segment, ref.dtype)
        return torch.as_strided(base, ref.shape, ref.stride, ref.byte_offset // itemsize)

    # -- idleness ----------------------------------------------------------------------------
    def _idle_changed(self, idle: bool) -> None:
        if idle and self._segments:
            # Block deaths are invisible, so the books only grow: forget them and drop our
            # references; tensors still over that memory keep it alive.
            self.engine.close()
            self.engine = Engine(
                policy="native", upstream="counting", settings=EngineSettings(cap=self._limit)
            )
            self._segments.clear()
            self._index.clear()
            self._bases.clear()
            self._storages.clear()
