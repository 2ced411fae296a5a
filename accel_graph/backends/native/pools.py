"""Pool handles and pool memory of the native backends: :class:`NativePoolTable`, held by each
:class:`~accel_graph.backends.native.backend.NativeGraphBackend` as ``backend.pools``.

Our handles use *negative* ids, ``(0, -n)`` for user handles and ``(-n, 0)`` for a graph's
private pool, because torch's own ids are positive and come from two independent counters (user
``(0, k)`` and private ``(k, 0)``): a positive id of ours could name a pool torch gave to someone
else. Each of our handles maps to a fresh torch user id
(``graph_pool_handle()``) on its first capture; torch ids (tuples, ``MemPool`` objects, their
``.id``) pass through unchanged. One pool lives on one device.

Memory comes from torch's per-pool snapshot (``memory_snapshot(mempool_id=...)``), or from the
whole ``memory._snapshot()`` filtered by ``segment_pool_id`` on torch versions without it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import PoolError
from ..base import DeviceSpec, PoolHandle, PoolStats

_our_ids = itertools.count(1)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class _Pool:
    """Our bookkeeping for one of our handles: its torch id and how many graphs hold it."""

    device: DeviceSpec
    torch_id: tuple[int, int] | None = None
    live: int = 0  # captured graphs currently holding this pool


class NativePoolTable:
    """The pools of one native backend: our handles, the torch pool id each maps to, and how many
    captured graphs hold each pool. Composed into the backend (``backend.pools``), which keeps
    the :class:`~accel_graph.backends.base.Backend` pool methods and delegates here.

    ``module`` returns ``torch.cuda`` or ``torch.xpu`` when called (looked up per call so tests
    can substitute fakes). Thread-safe.
    """

    def __init__(self, backend_name: str, module: Callable[[], Any], module_name: str = "cuda") -> None:
        self.backend_name = backend_name
        self._module = module
        #: ``torch._C._<module_name>_beginAllocateCurrentThreadToPool`` & co route allocations
        #: into a pool outside capture (:meth:`allocating_to`).
        self._module_name = module_name
        # Reentrant: a graph's __del__ releases its pool and may run from a garbage collection
        # triggered while this thread already holds the lock.
        self._lock = threading.RLock()
        self._pools: dict[tuple[int, int], _Pool] = {}
        # torch's own ids we captured into, with their device (kept: torch owns their lifetime)
        self._foreign: dict[tuple[int, int], _Pool] = {}

    def held(self) -> dict[tuple[int, int], int]:
        """Our handles' ids that have a bookkeeping entry -> how many captured graphs hold them.

        An entry exists only while a graph holds the pool (or a capture into it is beginning),
        so an empty dict means nothing leaked."""
        with self._lock:
            return {k: v.live for k, v in self._pools.items()}

    # -- handles ---------------------------------------------------------------------------
    def new_handle(self, device: DeviceSpec) -> PoolHandle:
        """A new user pool handle (``Backend.graph_pool_handle``). Nothing is registered until
        a capture uses it."""
        return PoolHandle(self.backend_name, device, (0, -next(_our_ids)))

    def private_handle(self, device: DeviceSpec) -> PoolHandle:
        """A new private pool for one graph's capture (torch's ``(k, 0)`` shape, our sign)."""
        return PoolHandle(self.backend_name, device, (-next(_our_ids), 0))

    def resolve(self, pool: object, device: DeviceSpec) -> PoolHandle:
        """``Backend.resolve_pool``: our handle, or torch's id / ``MemPool``, as a valid handle
        on ``device``; ``PoolError`` otherwise."""
        if isinstance(pool, PoolHandle):
            if pool.backend != self.backend_name:
                raise PoolError(
                    f"pool handle {pool!r} belongs to the {pool.backend} backend, but this graph "
                    f"is on {device}; create one with accel_graph.graph_pool_handle(device="
                    f"'{device.device_type}:{device.index}')"
                )
            self._same_device(pool.device, device, pool)
            return pool
        raw = getattr(pool, "id", pool)  # torch.cuda.MemPool / torch.xpu.MemPool expose .id
        if isinstance(raw, list):
            raw = tuple(raw)
        if not (isinstance(raw, tuple) and len(raw) == 2 and all(map(_is_int, raw))):
            raise PoolError(
                f"pool={pool!r} is not a pool handle; pass accel_graph.graph_pool_handle(), "
                f"another Graph's pool(), torch's graph_pool_handle() / graph.pool() tuple, or "
                f"a MemPool (or its .id)"
            )
        if raw[0] < 0 or raw[1] < 0:
            entry = self._pools.get(raw)
            if entry is None:
                raise PoolError(
                    f"pool id {raw} names no live pool of the {self.backend_name} backend; pass the "
                    f"PoolHandle object itself (accel_graph.graph_pool_handle() or Graph.pool())"
                )
            self._same_device(entry.device, device, pool)
            return PoolHandle(self.backend_name, entry.device, raw)
        if (raw[0] == 0) == (raw[1] == 0):
            raise PoolError(
                f"pool id {raw} is not a torch pool id: exactly one element must be non-zero "
                f"((0, k) from graph_pool_handle/MemPool, (k, 0) from a graph); pass pool=None "
                f"for a private pool"
            )
        seen = self._foreign.get(raw)
        if seen is not None:
            self._same_device(seen.device, device, pool)
        return PoolHandle(self.backend_name, device, raw)

    @staticmethod
    def _same_device(have: DeviceSpec, want: DeviceSpec, pool: object) -> None:
        if (have.device_type, have.index) != (want.device_type, want.index):
            raise PoolError(
                f"pool {pool!r} lives on {have.device_type}:{have.index}, but this graph is on "
                f"{want.device_type}:{want.index}; pools are per device: create one on "
                f"{want.device_type}:{want.index} with accel_graph.graph_pool_handle(device="
                f"'{want.device_type}:{want.index}')"
            )

    @staticmethod
    def _ours(handle: PoolHandle) -> bool:
        return handle.id[0] < 0 or handle.id[1] < 0

    # -- capture lifecycle (called by NativeGraphImpl) ---------------------------------------
    def torch_id(self, handle: PoolHandle) -> tuple[int, int] | None:
        """The torch pool id a capture into ``handle`` uses (None: let torch pick, learn later).

        An entry exists only while a graph holds the pool; when the last one is released the
        entry goes, and the next capture gets a fresh torch id. That is deliberate: torch
        asserts (``use_count > 0``) when a capture joins a pool whose graphs were all released
        while tensors still hold its memory (the vLLM "throwaway pool" workaround).
        """
        if not self._ours(handle):
            seen = self._foreign.get(handle.id)
            if seen is not None:
                self._same_device(seen.device, handle.device, handle)
            return handle.id
        with self._lock:
            entry = self._pools.get(handle.id)
            if entry is None:
                entry = self._pools[handle.id] = _Pool(handle.device, self._fresh_torch_id())
            return entry.torch_id

    def _fresh_torch_id(self) -> tuple[int, int] | None:
        make = getattr(self._module(), "graph_pool_handle", None)
        return None if make is None else tuple(make())  # type: ignore[return-value]

    def learned(self, handle: PoolHandle, graph: Any) -> tuple[int, int] | None:
        """Record the id torch picked for a capture that had none (stacks without
        ``graph_pool_handle``)."""
        try:
            tid: tuple[int, int] = tuple(graph.pool())  # type: ignore[assignment]
        except Exception:
            return None
        with self._lock:
            entry = self._pools.get(handle.id)
            if entry is not None and entry.torch_id is None:
                entry.torch_id = tid
        return tid

    def captured(self, handle: PoolHandle) -> None:
        """A capture into ``handle`` has begun (the graph now holds the pool)."""
        with self._lock:
            if self._ours(handle):
                self._pools[handle.id].live += 1
            else:
                self._foreign.setdefault(handle.id, _Pool(handle.device, handle.id)).live += 1

    def unused(self, handle: PoolHandle) -> None:
        """A capture into ``handle`` failed to begin: forget an entry no graph holds."""
        with self._lock:
            entry = self._pools.get(handle.id)
            if entry is not None and entry.live <= 0:
                del self._pools[handle.id]

    def released(self, handle: PoolHandle) -> None:
        """A graph holding ``handle`` was reset, aborted or collected."""
        with self._lock:
            book = self._pools if self._ours(handle) else self._foreign
            entry = book.get(handle.id)
            if entry is not None:
                entry.live -= 1
                if entry.live <= 0 and book is self._pools:
                    del self._pools[handle.id]

    def _segments(self, torch_id: tuple[int, int], index: int | None) -> list[dict] | None:
        """Segments of one torch pool on one device from torch's snapshot; None if unavailable."""
        mod = self._module()
        segs = None
        snap = getattr(mod, "memory_snapshot", None)
        if snap is not None:
            for kwargs in ({"mempool_id": torch_id, "include_traces": False}, {"mempool_id": torch_id}):
                try:
                    segs = snap(**kwargs)
                    break
                except TypeError:
                    continue
                except Exception:
                    return None
        whole = segs is None
        if whole:  # older torch: the whole snapshot, filtered by pool below
            try:
                segs = mod.memory._snapshot()["segments"]
            except Exception:
                return None
        out = []
        for s in segs:
            pid = s.get("segment_pool_id")
            # A per-pool snapshot already holds only that pool; the whole one must say so.
            if (pid is None and whole) or (pid is not None and tuple(pid) != torch_id):
                continue
            if index is not None and s.get("device", index) != index:
                continue
            out.append(s)
        return out

    @contextlib.contextmanager
    def allocating_to(self, torch_id: tuple[int, int] | None, device: DeviceSpec) -> Iterator[bool]:
        """Route this thread's allocations on ``device`` into torch pool ``torch_id`` for the
        block, outside any capture; yields whether it does.

        torch's own mechanism, as ``torch.cuda.use_mem_pool`` and the cudagraph trees use it:
        ``torch._C._<cuda|xpu>_beginAllocateCurrentThreadToPool(device, id)`` (which joins the
        pool: increments its use count), then ``_endAllocateToPool`` and ``_releasePool``.
        Feature-detected by calling it: missing functions, CPU-build stand-ins (they raise
        ``RuntimeError``) or ``torch_id`` None yield False, and nothing was routed."""
        names = (f"_{self._module_name}_beginAllocateCurrentThreadToPool",
                 f"_{self._module_name}_endAllocateToPool", f"_{self._module_name}_releasePool")
        begin, end, release = (getattr(torch._C, n, None) for n in names)
        if torch_id is None or not (callable(begin) and callable(end) and callable(release)):
            yield False
            return
        try:
            begin(device.index, torch_id)
        except (RuntimeError, TypeError):  # a dummy of a build without the device, an old torch
            yield False
            return
        try:
            yield True
        finally:
            end(device.index, torch_id)
            release(device.index, torch_id)

    def ranges(self, torch_id: tuple[int, int] | None, device: DeviceSpec) -> list[tuple[int, int]] | None:
        """``[start, end)`` address ranges of torch pool ``torch_id``'s segments on ``device``
        (None if unknown): whether a tensor lives in a graph's pool."""
        segs = None if torch_id is None else self._segments(torch_id, device.index)
        if segs is None:
            return None
        out = []
        for s in segs:
            try:
                start = int(s["address"])
            except (KeyError, TypeError, ValueError):
                continue
            out.append((start, start + int(s.get("total_size", 0))))
        return out

    # -- memory ----------------------------------------------------------------------------
    def reserved(self, torch_id: tuple[int, int], device: DeviceSpec) -> int | None:
        """Bytes of segments torch's pool ``torch_id`` holds on ``device``; None if unknown."""
        segs = self._segments(torch_id, device.index)
        return None if segs is None else sum(int(s.get("total_size", 0)) for s in segs)

    def stats(self, pool: PoolHandle) -> PoolStats | None:
        """``Backend.pool_stats``: the pool's segments as torch's snapshot reports them."""
        with self._lock:
            entry = (self._pools if self._ours(pool) else self._foreign).get(pool.id)
        if self._ours(pool) and (entry is None or entry.torch_id is None):
            return PoolStats(0, 0, 0, 0, {"torch_pool_id": None})  # no graph holds it (any more)
        tid = entry.torch_id if entry is not None and entry.torch_id else pool.id
        graphs = 0 if entry is None else entry.live
        segs = self._segments(tid, pool.device.index)
        if segs is None:
            return None
        return PoolStats(
            sum(int(s.get("total_size", 0)) for s in segs),
            sum(int(s.get("allocated_size", 0)) for s in segs),
            len(segs),
            graphs,
            {"torch_pool_id": tid},
        )
