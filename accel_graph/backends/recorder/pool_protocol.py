"""The contract of a recorder graph pool, and the part every pool shares.

A pool hands out memory for the outputs of captured ops. Graphs captured with the same pool
handle share one pool and reuse each other's freed memory in capture order; memory of a tensor
that dies during a capture is reused by later allocations of that capture (where the pool can
observe deaths). Lifetime is by reference counting, so it is safe by construction: the pool
dropping memory never frees what a user tensor or a graph program still points into.

Capture, replay and the backend call a pool only through :class:`GraphPool`. Both
implementations keep their books in the allocator engine
(:class:`accel_graph.allocator.core.engine.Engine`, ``native`` policy: PyTorch's caching
allocator), so a graph's memory figures are the allocator's own statistics on every device:

- :class:`~.engine_pool.EnginePool` (CPU): the engine's host upstream is the memory; each block
  is a tensor that owns it, so deaths go back to the engine.
- :class:`~.device_pool.DevicePool` (any other device): the engine runs on its counting
  upstream (books only) and each engine segment is backed by one device tensor.

:func:`~.pool.make_pool` picks one for a device.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ...allocator.core.engine import OP, OP_DTYPE, Engine
from ...allocator.core.settings import EngineSettings
from ...errors import OutOfMemoryError, PoolError
from ..base import PoolStats

#: One entry of a capture's allocation log: ``("alloc", key, bytes)`` or ``("free", key, 0)``.
PoolEvent = tuple[Literal["alloc", "free"], int, int]

#: ``PoolRef.segment`` of a location whose ``byte_offset`` is an address (the CPU pool).
ADDRESS = -1


@dataclass(frozen=True)
class PoolRef:
    """Where a pool tensor lives: a memory region of the pool, a byte offset in it, and the
    tensor's view metadata.

    Captured programs keep these instead of tensors, so capture holds no strong reference to
    pool memory and tensors can die (and their memory be reused) during capture. ``segment``
    and ``byte_offset`` are the pool's own coordinates (``segment == ADDRESS``: the offset is
    an address); only the pool that made a ref turns it back into a tensor
    (:meth:`GraphPool.materialize`), but any reader may rely on this: two refs of one pool
    overlap in memory exactly when their segments are equal and their byte ranges overlap.
    """

    segment: int
    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def storage_bytes(shape: Any, stride: Any, itemsize: int) -> int:
    """Bytes a tensor of this shape, stride and item size spans (0 when it has no element)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


def refs_overlap(a: PoolRef, b: PoolRef) -> bool:
    """Whether two pool locations share any byte."""
    if a.segment != b.segment:
        return False
    a_end = a.byte_offset + storage_bytes(a.shape, a.stride, a.dtype.itemsize)
    b_end = b.byte_offset + storage_bytes(b.shape, b.stride, b.dtype.itemsize)
    return a.byte_offset < b_end and b.byte_offset < a_end


def standalone_peak(events: list[PoolEvent], settings: EngineSettings | None = None,
                    policy: str = "native") -> int:
    """Peak reserved bytes of an allocation log replayed on an empty pool.

    The log runs in one C call on a fresh engine over the counting upstream (books only, no
    memory); by default ``native`` with torch's default settings, the policy both pools allocate
    with, so a first capture into an empty pool reports the same figure as the pool's own
    growth (a memory plan passes its target device's ``settings`` and ``policy``).
    """
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
    with Engine(policy=policy, upstream="counting", settings=settings) as sim:
        sim.replay(ops[:n], n_slots=max(len(slots), 1))
        return sim.memory_stats()["reserved_bytes.all.peak"]


class GraphPool(ABC):
    """Memory for the graphs captured into one pool handle.

    Contract for callers (capture, replay, the backend):

    - :meth:`allocate` gives a tensor over pool memory and appends ``("alloc", key, nbytes)``
      to every log a capture registered with :meth:`begin_capture` *before it returns*, so the
      caller finds the new block's key as ``log[-1][1]``. When the pool learns that a block
      died, it appends ``("free", key, 0)``; it books deaths before it logs a later allocation,
      so a log is the capture's allocation sequence in order.
    - :meth:`owns` / :meth:`ref` / :meth:`materialize` translate between tensors and
      :class:`PoolRef` locations.
    - Between :meth:`begin_capture` and :meth:`end_capture`, and while any graph added with
      :meth:`add_graph` is not yet removed, no memory a program may write is released. When the
      pool is idle (no capture, no graph) it gives unused memory back.
    - Every method is thread-safe; ``capturing`` and ``graphs`` count captures underway (0 or
      1: :meth:`begin_capture` refuses a second concurrent one with ``PoolError``) and graphs
      holding the pool; neither ever goes negative.

    Subclasses supply the memory (:meth:`allocate`, :meth:`materialize`) and say what idleness
    means for them (:meth:`_idle_changed`); the books of captures and graphs, the tensor
    classification and the accounting on the allocator engine (``self.engine``) live here.
    """

    engine: Engine

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.RLock()
        # storage id -> (segment, byte offset of the storage's first byte). Only live storages
        # are present, so an id recycled by torch is never mistaken for pool memory.
        self._storages: dict[int, tuple[int, int]] = {}
        self._listeners: list[list[PoolEvent]] = []  # logs of the captures underway
        self._owners: dict[int, str] = {}  # id(log) -> the capturing thread, for messages
        self._next_key = 0
        self.graphs = 0
        self.capturing = 0

    # -- memory (the implementations) ------------------------------------------------------
    @abstractmethod
    def allocate(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor with exactly this shape, stride and dtype over pool memory (contents
        undefined), logged to every listening capture (see the class docstring).

        Raises :class:`~accel_graph.errors.OutOfMemoryError` when the pool's limit or the
        device refuses; nothing is logged then and the pool is unchanged.
        """

    @abstractmethod
    def materialize(self, ref: PoolRef) -> torch.Tensor:
        """A tensor over the memory ``ref`` names (a ref this pool made). It keeps that memory
        alive for as long as it lives."""

    @abstractmethod
    def _idle_changed(self, idle: bool) -> None:
        """Called with the lock held after every change of ``capturing`` or ``graphs``:
        ``idle`` is true when neither a capture nor a graph uses the pool."""

    def _settle(self) -> None:
        """Book pending deaths of blocks before the books are read (lock held or not). By
        default there is nothing pending: a pool that learns of deaths late overrides this."""
        return None

    def _log_alloc(self, nbytes: int) -> int:
        """A new block key, logged to every listening capture (call with the lock held)."""
        key = self._next_key
        self._next_key += 1
        for log in self._listeners:
            log.append(("alloc", key, nbytes))
        return key

    # -- classification --------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or a view of it) lives in this pool's memory."""
        self._settle()
        return t.untyped_storage()._cdata in self._storages

    def ref(self, t: torch.Tensor) -> PoolRef:
        """The location of a pool tensor (``owns(t)`` must be true)."""
        self._settle()
        segment, start = self._storages[t.untyped_storage()._cdata]
        return PoolRef(segment, start + t.storage_offset() * t.element_size(), tuple(t.shape),
                       tuple(t.stride()), t.dtype)

    # -- captures and graphs ---------------------------------------------------------------
    def begin_capture(self, log: list[PoolEvent]) -> None:
        """A capture starts: it listens on ``log`` until :meth:`end_capture`.

        Captures into one pool run one at a time: a capture's log must hold its own
        allocations in order and its blocks' keys are read back as ``log[-1]``, which a
        second thread allocating in between would break, and graphs sharing a pool reuse each
        other's memory in capture order, which concurrent captures do not have. Raises
        :class:`~accel_graph.errors.PoolError` while another capture is underway (nothing
        changes then)."""
        with self._lock:
            if self._listeners:
                owner = self._owners.get(id(self._listeners[0]), "another thread")
                raise PoolError(
                    f"a capture into this graph pool on {self.device} is already underway on "
                    f"{owner}; captures into one pool must run one at a time. End that capture "
                    f"first, or give this graph its own pool (pool=None or a new "
                    f"accel_graph.graph_pool_handle())"
                )
            self._settle()
            self.capturing += 1
            self._listeners.append(log)
            t = threading.current_thread()
            self._owners[id(log)] = f"thread {t.name!r} (ident {t.ident})"
            self._idle_changed(False)

    def end_capture(self, log: list[PoolEvent]) -> None:
        """The capture listening on ``log`` (this very list) is over (ended or aborted). A log
        that is not listening (ended already, or never begun) changes nothing."""
        with self._lock:
            # By identity: two captures' logs may be equal lists.
            index = next((i for i, listening in enumerate(self._listeners) if listening is log), None)
            if index is None:
                return
            self._settle()
            del self._listeners[index]
            self._owners.pop(id(log), None)
            self.capturing -= 1
            self._idle_changed(self.idle)

    def add_graph(self) -> None:
        """A captured program now points into this pool: keep its memory until
        :meth:`remove_graph`. Call before :meth:`end_capture`, so nothing is released between."""
        with self._lock:
            self._settle()
            self.graphs += 1
            self._idle_changed(False)

    def remove_graph(self) -> None:
        """A graph was reset or deleted; its memory goes once nothing else uses it."""
        with self._lock:
            self._settle()
            self.graphs -= 1
            self._idle_changed(self.idle)

    @property
    def idle(self) -> bool:
        """No capture underway and no graph holding the pool."""
        return not self.capturing and not self.graphs

    # -- accounting --------------------------------------------------------------------------
    def out_of_memory(self, exc: BaseException) -> OutOfMemoryError:
        """The error for a request the pool's memory cannot serve (the caller chains ``exc``)."""
        cause = str(exc).rstrip(".")
        return OutOfMemoryError(
            f"graph pool on {self.device} is out of memory: {cause}. Capture fewer or smaller "
            "graphs into this pool, or raise the limit (ACCEL_GRAPH_POOL_LIMIT)"
        )

    def reserved_bytes(self) -> int:
        """Bytes the pool holds (the engine's reserved bytes)."""
        self._settle()
        return self.engine.memory_stats()["reserved_bytes.all.current"]

    def standalone_bytes(self, events: list[PoolEvent]) -> int:
        """Peak reserved bytes of one capture's allocation log on an empty pool."""
        return standalone_peak(events)

    def stats(self) -> PoolStats:
        """The pool's memory, as the engine counts it."""
        with self._lock:
            self._settle()
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
