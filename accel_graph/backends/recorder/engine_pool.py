"""CPU graph pools on the allocator engine: the C caching allocator over host memory.

Blocks come from :class:`accel_graph.allocator.engine.Engine` (``native`` policy, host
upstream), so a graph's memory figures are the allocator's own statistics. Each block is a
zero-copy tensor over the engine's memory; the numpy array between them carries a finalizer,
so the block goes back to the engine exactly when the last tensor over it dies (and can be
reused by the rest of the capture, or by later captures into the same pool).

Safety: segments go back to the system (``empty_cache``) only while no graph uses the pool, so
a program never points into released memory; blocks a user tensor holds stay allocated, so
their segments are never released under them. The engine itself is closed when the pool
object is collected, which cannot happen while any block or graph still refers to the pool.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

import numpy as np
import torch

from ...allocator.engine import OP, OP_DTYPE, Engine, EngineSettings
from ...errors import OutOfMemoryError
from ..base import PoolStats
from .pool import PoolRef, RecorderPool, _storage_bytes

_HOST_SEGMENT = -1  # PoolRef.segment of engine memory: byte_offset is then the address


class EnginePool(RecorderPool):
    """A recorder pool whose memory and books are the allocator engine's."""

    def __init__(self, device: torch.device, limit: int | None = None) -> None:
        super().__init__(device, limit)
        self.engine = Engine(policy="native", upstream="host", settings=EngineSettings(cap=limit))
        self._ffi = self.engine._ffi
        self._segment_index: list[tuple[int, int]] = []
        self._segment_bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        weakref.finalize(self, self.engine.close)

    def _buffer(self, addr: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self._ffi.buffer(self._ffi.cast("char *", addr), nbytes), dtype=np.uint8)

    def allocate(self, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        itemsize = dtype.itemsize
        nbytes = _storage_bytes(shape, stride, itemsize)
        with self._lock:
            try:
                addr = self.engine.malloc(max(nbytes, 1))
            except OutOfMemoryError as exc:
                raise OutOfMemoryError(
                    f"graph pool on {self.device} is out of memory: {exc} Capture fewer or "
                    f"smaller graphs into this pool, or raise the limit (ACCEL_GRAPH_POOL_LIMIT)"
                ) from exc
            key = self._next_key
            self._next_key += 1
            for log in self._listeners:
                log.append(("alloc", key, nbytes))
        arr = self._buffer(addr, max(nbytes, itemsize))
        base = torch.from_numpy(arr)
        weakref.finalize(arr, self._host_block_dead, addr, key, base.untyped_storage()._cdata)
        t = torch.as_strided(base.view(dtype), tuple(shape), tuple(stride), 0)
        with self._lock:
            self._storages[t.untyped_storage()._cdata] = (_HOST_SEGMENT, addr)
        return t

    def _host_block_dead(self, addr: int, key: int, storage_id: int) -> None:
        with self._lock:
            self._storages.pop(storage_id, None)
            for log in self._listeners:
                log.append(("free", key, 0))
            self.engine.free(addr)
            if not self.capturing:
                self._release_unused()

    def materialize(self, ref: PoolRef) -> torch.Tensor:
        if ref.segment != _HOST_SEGMENT:
            return super().materialize(ref)
        # One typed tensor per engine segment, then a view of it: a program has many
        # locations in few segments, and views are far cheaper than new storages.
        seg = self._segment_of(ref.byte_offset)
        itemsize = ref.dtype.itemsize
        if seg is None or (ref.byte_offset - seg[0]) % itemsize:
            nbytes = max(_storage_bytes(ref.shape, ref.stride, itemsize), itemsize)
            base = torch.from_numpy(self._buffer(ref.byte_offset, nbytes)).view(ref.dtype)
            return torch.as_strided(base, ref.shape, ref.stride, 0)
        key = (seg[0], ref.dtype)
        base = self._segment_bases.get(key)
        if base is None:
            raw = torch.from_numpy(self._buffer(seg[0], seg[1] - seg[1] % itemsize))
            base = self._segment_bases[key] = raw.view(ref.dtype)
        return torch.as_strided(base, ref.shape, ref.stride, (ref.byte_offset - seg[0]) // itemsize)

    def _segment_of(self, addr: int) -> tuple[int, int] | None:
        """(address, size) of the engine segment holding ``addr``, from a cached index."""
        for _ in range(2):
            i = bisect.bisect_right(self._segment_index, (addr, float("inf"))) - 1
            if i >= 0 and addr < self._segment_index[i][0] + self._segment_index[i][1]:
                return self._segment_index[i]
            self._segment_index = sorted((seg["address"], seg["size"]) for seg in self.engine.layout())
        return None

    def _release_unused(self) -> None:
        # Programs keep raw locations, possibly in blocks that are free in the engine: release
        # segments only when no graph can still write into them.
        if not self.graphs:
            self.engine.empty_cache()
            self._segment_index = []
            self._segment_bases.clear()  # our views only: live tensors keep their memory

    def reserved_bytes(self) -> int:
        return self.engine.memory_stats()["reserved_bytes.all.current"]

    def standalone_bytes(self, events: list[tuple[str, int, int]]) -> int:
        """Peak reserved of the capture's own sequence, replayed in one C call on a fresh engine."""
        ops = np.zeros(len(events), dtype=OP_DTYPE)
        slots: dict[int, int] = {}
        n = 0
        for action, key, nbytes in events:
            if action == "alloc":
                slots[key] = len(slots)
                ops[n] = (OP["malloc"], 0, max(nbytes, 1), slots[key], 0)
                n += 1
            elif key in slots:
                ops[n] = (OP["free"], 0, 0, slots[key], 0)
                n += 1
        with Engine(policy="native", upstream="counting") as sim:
            sim.replay(ops[:n], n_slots=max(len(slots), 1))
            return sim.memory_stats()["reserved_bytes.all.peak"]

    def stats(self) -> PoolStats:
        with self._lock:
            st: dict[str, Any] = self.engine.memory_stats()
            return PoolStats(
                reserved_bytes=st["reserved_bytes.all.current"],
                allocated_bytes=st["allocated_bytes.all.current"],
                segments=st["segment.all.current"],
                graphs=self.graphs,
                extra={
                    "peak_reserved_bytes": st["reserved_bytes.all.peak"],
                    "segment_bytes": sum(seg["size"] for seg in self.engine.layout()),
                    "allocator": "engine/native",
                },
            )
