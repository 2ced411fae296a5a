"""The recorder's graph pools: private memory with CUDA's semantics.

A pool hands out memory for the outputs of captured ops. Graphs captured with the same pool
handle share one pool and reuse each other's freed memory in capture order; memory of a tensor
that dies during a capture is reused by later allocations of that capture.

Lifetime is by reference counting, so it is safe by construction: on the CPU every block is a
zero-copy tensor over a slice of a segment (a numpy buffer), and the slice object carries a
finalizer, so the pool learns that a block is free exactly when the last tensor over it dies.
A segment's memory is owned by the tensors over it: the pool dropping a segment never frees
memory a user tensor or a graph program still points into. On other devices a segment is one
device tensor and blocks are views of it; their deaths cannot be observed, so blocks there are
not recycled (memory-safe, less compact).

The bookkeeping is :class:`~.arena.Arena`; the allocator engine can take its place.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import OutOfMemoryError
from ..base import PoolStats
from .arena import Arena, simulate_peak


@dataclass(frozen=True)
class PoolRef:
    """Where a pool tensor lives: segment, byte offset, and its view metadata.

    Captured programs keep these instead of tensors, so capture holds no strong reference to
    pool memory and tensors can die (and their memory be reused) during capture.
    """

    segment: int
    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _storage_bytes(shape, stride, itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


def make_pool(device: torch.device, limit: int | None = None) -> RecorderPool:
    """The pool for ``device``: on the allocator engine for the CPU, an arena elsewhere."""
    if device.type == "cpu":
        from .engine_pool import EnginePool

        return EnginePool(device, limit)
    return RecorderPool(device, limit)


class RecorderPool:
    """Memory for the graphs captured into one pool handle; see the module docstring.

    This class keeps its books in an :class:`~.arena.Arena` over segment buffers (the path for
    devices without a host upstream); :class:`~.engine_pool.EnginePool` puts CPU pools on the
    allocator engine.
    """

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        self.device = device
        self.arena = Arena(limit)
        self._host = device.type == "cpu"
        self._lock = threading.RLock()
        self._memory: dict[int, Any] = {}  # segment -> numpy buffer (CPU) or uint8 tensor
        self._bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # storage id -> (segment, byte offset of the storage's first byte). Only live storages
        # are present, so an id recycled by the allocator is never mistaken for pool memory.
        self._storages: dict[int, tuple[int, int]] = {}
        self._graph_uses: Counter[int] = Counter()
        self.graphs = 0
        self.capturing = 0
        self._listeners: list[Any] = []  # active captures that log (alloc|free, key, bytes)
        self._next_key = 0

    # -- allocation -----------------------------------------------------------------------
    def _out_of_memory(self, exc: BaseException) -> OutOfMemoryError:
        """The error for a request the pool's memory cannot serve (the cause chained by the
        caller)."""
        cause = str(exc).rstrip(".")
        return OutOfMemoryError(
            f"graph pool on {self.device} is out of memory: {cause}. Capture fewer or smaller "
            "graphs into this pool, or raise the limit (ACCEL_GRAPH_POOL_LIMIT)"
        )

    def _log_alloc(self, nbytes: int) -> int:
        """A new block key, logged to every listening capture (call with the lock held)."""
        key = self._next_key
        self._next_key += 1
        for log in self._listeners:
            log.append(("alloc", key, nbytes))
        return key

    def allocate(self, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor with exactly this shape/stride/dtype over pool memory (contents undefined)."""
        itemsize = dtype.itemsize
        nbytes = _storage_bytes(shape, stride, itemsize)
        with self._lock:
            try:
                sidx, off, size, new = self.arena.alloc(nbytes)
            except MemoryError as exc:
                raise self._out_of_memory(exc) from exc
            if new:
                try:
                    self._memory[sidx] = self._new_segment(self.arena.segments[sidx].size)
                except (MemoryError, RuntimeError) as exc:
                    self.arena.free(sidx, off)
                    self.arena.release_free_segments(keep=set(self._memory))
                    raise OutOfMemoryError(
                        f"graph pool on {self.device} could not get a segment of "
                        f"{self.arena.segments.get(sidx).size if sidx in self.arena.segments else nbytes} "
                        f"bytes from the device: {exc}"
                    ) from exc
            key = self._log_alloc(nbytes)
        if self._host:
            view = self._memory[sidx][off:off + size]
            base = torch.from_numpy(view)
            storage_start = off
            # The finalizer runs when the last tensor over this block dies: the block is free.
            weakref.finalize(view, self._block_dead, sidx, off, key, base.untyped_storage()._cdata)
        else:
            base = self._memory[sidx]
            storage_start = 0
        if base.dtype != dtype:
            base = base.view(dtype)
        start = (off - storage_start) // itemsize
        t = torch.as_strided(base, tuple(shape), tuple(stride), start)
        with self._lock:
            self._storages[t.untyped_storage()._cdata] = (sidx, storage_start)
        return t

    def _new_segment(self, size: int) -> Any:
        if self._host:
            return np.empty(size, dtype=np.uint8)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _block_dead(self, sidx: int, off: int, key: int, storage_id: int) -> None:
        with self._lock:
            self._storages.pop(storage_id, None)
            for log in self._listeners:
                log.append(("free", key, 0))
            self.arena.free(sidx, off)
            if not self.capturing:
                self._release_unused()

    # -- classification and materialisation -------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or a view of it) lives in this pool's memory."""
        return t.untyped_storage()._cdata in self._storages

    def ref(self, t: torch.Tensor) -> PoolRef:
        """The location of a pool tensor (``owns(t)`` must be true)."""
        sidx, start = self._storages[t.untyped_storage()._cdata]
        return PoolRef(sidx, start + t.storage_offset() * t.element_size(), tuple(t.shape),
                       tuple(t.stride()), t.dtype)

    def materialize(self, ref: PoolRef) -> torch.Tensor:
        """A tensor over the memory ``ref`` names. It keeps the segment's memory alive."""
        with self._lock:
            base = self._bases.get((ref.segment, ref.dtype))
            if base is None:
                mem = self._memory[ref.segment]
                raw = torch.from_numpy(mem) if self._host else mem
                base = raw.view(ref.dtype)
                self._bases[(ref.segment, ref.dtype)] = base
        itemsize = base.element_size()
        if ref.byte_offset % itemsize:
            raise ValueError(f"misaligned {ref.dtype} view at byte {ref.byte_offset}")
        return torch.as_strided(base, ref.shape, ref.stride, ref.byte_offset // itemsize)

    # -- graphs and release ---------------------------------------------------------------
    def begin_capture(self, log: list) -> None:
        with self._lock:
            self.capturing += 1
            self._listeners.append(log)

    def end_capture(self, log: list) -> None:
        with self._lock:
            self.capturing -= 1
            self._listeners.remove(log)
            if not self.capturing:
                self._release_unused()

    def add_graph(self, segments: set[int]) -> None:
        """A graph's program now uses these segments: they stay reserved until it goes."""
        with self._lock:
            self.graphs += 1
            self._graph_uses.update(segments)

    def remove_graph(self, segments: set[int]) -> None:
        """The graph using ``segments`` was reset or deleted; free what nothing uses any more."""
        with self._lock:
            self.graphs -= 1
            self._graph_uses.subtract(segments)
            self._graph_uses += Counter()  # drop zero counts
            if not self.capturing:
                self._release_unused()

    def _release_unused(self) -> None:
        if not self._host and not self.graphs:
            # Device blocks are views of one segment tensor, so their deaths are invisible:
            # once no graph uses the pool, forget the books and drop our references; tensors
            # still over that memory keep it alive through torch's own reference counting.
            self.arena = Arena(self.arena.limit)
            self._memory.clear()
            self._bases.clear()
            self._storages.clear()
            return
        keep = set(self._graph_uses)
        for sidx in self.arena.release_free_segments(keep=keep):
            # Dropping our references only: a tensor still over this memory keeps it alive.
            self._memory.pop(sidx, None)
            for key in [k for k in self._bases if k[0] == sidx]:
                del self._bases[key]

    def reserved_bytes(self) -> int:
        """Bytes the pool holds, counted by its own segments."""
        return self.arena.reserved_bytes

    def standalone_bytes(self, events: list[tuple[str, int, int]]) -> int:
        """Peak reserved bytes of one capture's allocation sequence on an empty pool."""
        return simulate_peak(events)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                reserved_bytes=self.arena.reserved_bytes,
                allocated_bytes=self.arena.allocated_bytes,
                segments=len(self.arena.segments),
                graphs=self.graphs,
                extra={"peak_reserved_bytes": self.arena.peak_reserved,
                       "segment_bytes": sum(s.size for s in self.arena.segments.values())},
            )
