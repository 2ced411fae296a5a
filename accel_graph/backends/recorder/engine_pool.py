"""CPU graph pools on the allocator engine: the C caching allocator over host memory.

Blocks come from :class:`accel_graph.allocator.core.engine.Engine` (``native`` policy, host
upstream), so a graph's memory figures are the allocator's own statistics. Each block is a
zero-copy tensor over the engine's memory that owns the block: it is made in one native call
(:class:`~accel_graph.allocator.core.tensor_blocks.TensorBlocks`, a DLPack tensor whose deleter frees the
block in C, from whatever thread drops the last reference), so the block goes back to the
engine exactly when the last tensor over it dies (and can be reused by the rest of the capture,
or by later captures into the same pool). The pool learns of those deaths from a queue of keys
it drains before anything that reads its books (allocate, owns, ref, capture begin/end, ...).
Where the extension is not built, or a dtype has no DLPack code in this torch, the tensor is
built the older way (numpy over the block, with a ``weakref.finalize``), with the same rules.

Safety: segments go back to the system (``empty_cache``) only while no graph uses the pool and
no capture runs (the C engine does it at a death while the pool is idle, as the finalizer did),
so a program never points into released memory; blocks a user tensor holds stay allocated, so
their segments are never released under them. The engine itself is closed when the pool
object is collected, which cannot happen while any block or graph still refers to the pool (a
DLPack block's deleter holds a reference to the pool, a numpy-path block's finalizer too). The
C engine is also reference-counted by the DLPack blocks, so their memory would outlive even an
explicit ``engine.close()``.
"""

from __future__ import annotations

import bisect
import weakref

import numpy as np
import torch

from ...allocator.core.engine import Engine
from ...allocator.core.settings import EngineSettings
from ...errors import OutOfMemoryError
from .pool_protocol import ADDRESS, GraphPool, PoolRef, storage_bytes


def _dlpack_codes() -> dict[torch.dtype, tuple[int, int]]:
    """torch dtype -> (DLPack type code, bits); each entry is checked on first use."""
    # kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6
    table: dict[torch.dtype, tuple[int, int]] = {
        torch.int8: (0, 8),
        torch.int16: (0, 16),
        torch.int32: (0, 32),
        torch.int64: (0, 64),
        torch.uint8: (1, 8),
        torch.float16: (2, 16),
        torch.float32: (2, 32),
        torch.float64: (2, 64),
        torch.bfloat16: (4, 16),
        torch.complex64: (5, 64),
        torch.complex128: (5, 128),
        torch.bool: (6, 8),
    }
    for name, bits in (("uint16", 16), ("uint32", 32), ("uint64", 64)):  # torch >= 2.3
        if hasattr(torch, name):
            table[getattr(torch, name)] = (1, bits)
    return table


class _Codes(dict):
    """dtype -> DLPack code, or None; a dtype is probed once: the tensor torch's importer
    builds must have exactly that dtype, shape and stride, else the numpy path serves it."""

    def __missing__(self, dtype: torch.dtype) -> tuple[int, int] | None:
        code = _CANDIDATES.get(dtype)
        if code is not None and not _probe(dtype, code):
            code = None
        self[dtype] = code
        return code


def _probe(dtype: torch.dtype, code: tuple[int, int]) -> bool:
    engine = Engine(policy="native", upstream="host")
    try:
        blocks = engine.tensor_blocks()
        if blocks is None:
            return False
        try:
            t = blocks.make(-1, code[0], code[1], (2, 3, 1), (1, 2, 0))
        except (RuntimeError, TypeError, ValueError, BufferError):
            return False
        if t.__class__ is int:
            return False
        return (
            t.dtype == dtype
            and t.shape == (2, 3, 1)
            and t.stride() == (1, 2, 0)
            and t.device.type == "cpu"
        )
    finally:
        engine.close()


_CANDIDATES = _dlpack_codes()
#: Outside a capture, deaths of DLPack blocks are booked when this many are pending (or when
#: the books are read): their memory is back in the engine at once either way.
_DRAIN_BATCH = 32
_DL_CODES = _Codes()


class EnginePool(GraphPool):
    """A CPU graph pool whose memory and books are the allocator engine's (host upstream).

    ``limit`` caps the bytes the pool reserves (None: no cap).
    """

    def __init__(self, device: torch.device, limit: int | None = None, *,
                 settings: EngineSettings | None = None) -> None:
        super().__init__(device)
        # ``settings``: a memory plan's target allocator (recorder/memory_plan.py); graph pools
        # use torch's defaults.
        if settings is None:
            settings = EngineSettings(cap=limit)
        self.engine = Engine(policy="native", upstream="host", settings=settings)
        self._segment_index: list[tuple[int, int]] = []
        self._segment_bases: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # key <-> storage id of each DLPack block not yet booked dead (deaths arrive as keys)
        self._key_storage: dict[int, int] = {}
        self._storage_key: dict[int, int] = {}
        self._blocks = self.engine.tensor_blocks()
        if self._blocks is not None:
            self._make = self._blocks.maker
            self._drain_keys = self._blocks.drainer
            self._addr = self._blocks.addr
            self._pending = self._blocks.pending
            self._blocks.set_release_idle(True)  # idle: each death releases, as _release_unused
        weakref.finalize(self, self.engine.close)

    def _buffer(self, addr: int, nbytes: int) -> np.ndarray:
        return self.engine.host_view(addr, nbytes)

    def allocate(self, shape, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        code = _DL_CODES[dtype] if self._blocks is not None else None
        if code is None:
            return self._allocate_numpy(shape, stride, dtype, device)
        with self._lock:
            # Deaths are booked before an allocation is logged (the capture's log keeps the
            # order of events); with no capture listening they are booked in batches.
            pending = self._pending[0]
            if pending and (self._listeners or pending >= _DRAIN_BATCH):
                self._drain()
            key = self._next_key
            self._next_key = key + 1
            t = self._make(self._addr, key, code[0], code[1], shape, stride, self)
            if t.__class__ is int:
                self._oom(t)
            if self._listeners:
                nbytes = storage_bytes(shape, stride, dtype.itemsize)
                for log in self._listeners:
                    log.append(("alloc", key, nbytes))
            sid = t.untyped_storage()._cdata
            self._storages[sid] = (ADDRESS, t.data_ptr())
            self._key_storage[key] = sid
            self._storage_key[sid] = key
        return t

    def _oom(self, rc: int) -> None:
        try:
            self._blocks.check(rc)
        except OutOfMemoryError as exc:
            raise self.out_of_memory(exc) from exc

    def _drain(self) -> None:
        """Book the deaths of DLPack blocks (their memory is already back in the engine)."""
        with self._lock:
            dead = self._drain_keys(self._addr)
            key_storage, storage_key, listeners = (
                self._key_storage,
                self._storage_key,
                self._listeners,
            )
            for key in dead:
                sid = key_storage.pop(key, None)
                if sid is None:  # a tensor whose import failed
                    continue
                # A storage id is the address of torch's StorageImpl: once the dead tensor's
                # is freed, a newer pool tensor may have it, and keeps its entry.
                if storage_key.get(sid) == key:
                    del storage_key[sid]
                    self._storages.pop(sid, None)
                for log in listeners:
                    log.append(("free", key, 0))
            if dead and not self.capturing and not self.graphs:  # idle (inline: hot path)
                self._release_unused()  # the engine released; forget our segment views

    def _sync(self) -> None:
        if self._blocks is not None and self._pending[0]:
            self._drain()

    def _allocate_numpy(
        self, shape, stride, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The path without the extension (or for a dtype DLPack cannot carry here)."""
        itemsize = dtype.itemsize
        nbytes = storage_bytes(shape, stride, itemsize)
        with self._lock:
            self._sync()
            try:
                addr = self.engine.malloc(max(nbytes, 1))
            except OutOfMemoryError as exc:
                raise self.out_of_memory(exc) from exc
            key = self._log_alloc(nbytes)
        arr = self._buffer(addr, max(nbytes, itemsize))
        base = torch.from_numpy(arr)
        weakref.finalize(arr, self._host_block_dead, addr, key, base.untyped_storage()._cdata)
        t = torch.as_strided(base.view(dtype), tuple(shape), tuple(stride), 0)
        with self._lock:
            self._storages[t.untyped_storage()._cdata] = (ADDRESS, addr)
        return t

    def _host_block_dead(self, addr: int, key: int, storage_id: int) -> None:
        with self._lock:
            self._storages.pop(storage_id, None)
            for log in self._listeners:
                log.append(("free", key, 0))
            self.engine.free(addr)
            if self.idle:
                self._release_unused()

    # -- the books: deaths of DLPack blocks are booked before anything reads them -----------
    def _settle(self) -> None:
        self._sync()

    def _idle_changed(self, idle: bool) -> None:
        if idle:
            self._release_unused()
        if self._blocks is not None:
            self._blocks.set_release_idle(idle)

    def materialize(self, ref: PoolRef) -> torch.Tensor:
        self._sync()
        # One typed tensor per engine segment, then a view of it: a program has many
        # locations in few segments, and views are far cheaper than new storages.
        seg = self._segment_of(ref.byte_offset)
        itemsize = ref.dtype.itemsize
        if seg is None or (ref.byte_offset - seg[0]) % itemsize:
            nbytes = max(storage_bytes(ref.shape, ref.stride, itemsize), itemsize)
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
            self._segment_index = sorted(
                (seg["address"], seg["size"]) for seg in self.engine.layout()
            )
        return None

    def _release_unused(self) -> None:
        # Programs keep raw locations, possibly in blocks that are free in the engine: release
        # segments only when no graph can still write into them.
        if not self.graphs:
            self.engine.empty_cache()
            self._segment_index = []
            self._segment_bases.clear()  # our views only: live tensors keep their memory
