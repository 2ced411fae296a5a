"""Memory plans: a capture's allocations booked on the allocator engine, with no memory and no
kernels.

A recorder capture already computes nothing (:mod:`.capture`): every functional op's outputs
get their layout from the op's plan (:mod:`.plan`, meta execution cached process-wide) and their
memory from the graph's pool. A memory plan runs the same recording machinery
(:class:`~.capture.Capture`, the same op plans, the same refusals, the same island pins) over a
:class:`PlanPool`, whose tensors are ``meta`` tensors and whose books are a fresh allocator
engine on its counting upstream (addresses only) under the target device's allocator settings.
So a plan is the allocation sequence the capture would make, replayed through the C engine as
it is made: segment sizes, rounding, reuse of memory that died in the capture and across
captures into one pool, expandable segments when the settings say so.

Deaths are observed on the meta tensors' storages (``weakref.finalize``: torch keeps a storage's
Python object alive exactly as long as the storage), so a tensor that dies during the planned
capture frees its block there, as the CPU pool's DLPack deleter does.

:class:`MemoryPlanner` plans captures in order into one pool (a runner's ladder, largest
first), keeping what the caller keeps (the outputs), and predicts the eager warm-up's peak from
the same allocation sequences on an ordinary (non-pool) engine.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...allocator.core.engine import Engine
from ...allocator.core.settings import EngineSettings
from ...allocator.traces.files import save_trace
from ...allocator.traces.model import Trace
from ...errors import CaptureError, OutOfMemoryError
from ..capture_common import islands as islands_common
from .capture import Capture
from .engine_pool import EnginePool
from .plan import meta_outputs_allowed
from .plan_islands import make_plan_runner
from .pool_protocol import ADDRESS, GraphPool, PoolEvent, PoolRef, standalone_peak, storage_bytes
from .threads import active_capture

__all__ = ["CapturePlan", "MemoryPlanner", "PlanPool"]


class PlanPool(GraphPool):
    """A graph pool that books allocations on an engine and hands out ``meta`` tensors.

    ``recycle=False`` models the recorder's non-CPU pool (:mod:`.device_pool`), which never
    reuses a block within a pool's life: deaths are then not booked. ``record_events`` turns on
    the engine's event log (for a memory-snapshot trace of the plan).
    """

    def __init__(self, device: torch.device, settings: EngineSettings, policy: str = "native", *,
                 recycle: bool = True, record_events: bool = False) -> None:
        super().__init__(device)
        self.engine = Engine(policy=policy, upstream="counting", settings=settings)
        self.settings = settings
        self.policy = policy
        self.recycle = recycle
        if record_events:
            self.engine.enable_events()
        weakref.finalize(self, self.engine.close)

    def allocate(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = storage_bytes(shape, stride, dtype.itemsize)
        t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta")
        storage = t.untyped_storage()
        with self._lock:
            try:
                addr = self.engine.malloc(max(nbytes, 1))
            except OutOfMemoryError as exc:
                raise self.out_of_memory(exc) from exc
            key = self._log_alloc(nbytes)
            sid = storage._cdata
            self._storages[sid] = (ADDRESS, addr)
        if self.recycle:
            weakref.finalize(storage, self._dead, weakref.ref(self), addr, key, sid)
        return t

    @staticmethod
    def _dead(pool_ref: weakref.ref, addr: int, key: int, sid: int) -> None:
        pool = pool_ref()
        if pool is None:
            return
        with pool._lock:
            if pool._storages.get(sid) == (ADDRESS, addr):
                del pool._storages[sid]
            for log in pool._listeners:
                log.append(("free", key, 0))
            pool.engine.free(addr)

    def materialize(self, ref: PoolRef) -> torch.Tensor:
        raise TypeError("a memory plan's pool holds no memory: its locations cannot be read")

    def _idle_changed(self, idle: bool) -> None:
        return None  # a plan never gives memory back: the runner's graphs hold their pool


class _PlanCapture(Capture):
    """A recording whose eager islands are planned on metadata (:mod:`.plan_islands`)."""

    def __init__(self, pool: GraphPool, device: torch.device, unplanned: list[dict[str, str]]) -> None:
        super().__init__(pool, device)
        self._unplanned = unplanned

    def make_island_runner(self) -> islands_common.Runner:
        return make_plan_runner(self, self._unplanned)


@dataclass
class CapturePlan:
    """One planned capture: what ``fn`` returned (meta tensors standing for the outputs), its
    allocation log, the pool's growth and its standalone peak."""

    outputs: Any
    events: list[PoolEvent]
    incremental_bytes: int
    standalone_bytes: int
    reserved_after_bytes: int
    unplanned: list[dict[str, str]] = field(default_factory=list)


class MemoryPlanner:
    """Captures planned in order into one pool on ``device`` under ``settings``/``policy``.

    ``plan(fn, args, kwargs)`` records ``fn`` as a capture into the pool would (the recording
    mode, the op plans and refusals of the recorder) and books it; the caller keeps the returned
    outputs alive for as long as the real graph's outputs would live. Raises the
    :class:`~accel_graph.errors.CaptureError` capture would raise, at the same op.
    """

    def __init__(self, device: torch.device, settings: EngineSettings, policy: str = "native", *,
                 recycle: bool = True, record_events: bool = False, meta: bool = False) -> None:
        self.device = device
        self.settings = settings
        self.policy = policy
        #: On the CPU with the native policy the plan records into the recorder's own CPU pool
        #: class (host memory reserved, never touched: its blocks are tensors whose deaths the
        #: C engine sees, exactly as in capture); elsewhere into a pool of meta tensors.
        #: (``meta=True`` forces the meta pool: tests check it against the host pool.)
        self.on_host = device.type == "cpu" and policy == "native" and recycle and not meta
        self.pool: GraphPool
        if self.on_host:
            self.pool = EnginePool(device, settings=settings)
            if record_events:
                self.pool.engine.enable_events()
        else:
            self.pool = PlanPool(device, settings, policy, recycle=recycle,
                                 record_events=record_events)
        self.captures: list[CapturePlan] = []
        self.unplanned: list[dict[str, str]] = []

    def plan(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
             after: Callable[[Any], None] | None = None) -> CapturePlan:
        """Plan one capture of ``fn(*args, **kwargs)``; ``after(outputs)`` runs inside it (the
        runner's copy into a shared output region)."""
        if active_capture() is not None:
            raise CaptureError("plan_memory() cannot run inside a capture on this thread; end "
                               "the capture first")
        unplanned: list[dict[str, str]] = []
        cap = _PlanCapture(self.pool, self.device, unplanned)
        before = self.pool.reserved_bytes()
        cap.begin()
        try:
            with contextlib.nullcontext() if self.on_host else meta_outputs_allowed():
                out = fn(*args, **kwargs)
                if after is not None:
                    after(out)
        except BaseException:
            cap.stop("aborted")
            cap.mode.capture = None
            cap.release_pool()
            raise
        cap.stop("ended")
        cap.mode.capture = None  # break the capture <-> mode cycle, as capture_end does
        # As capture_end: the "graph" holds the pool from here on, so nothing it reserved is
        # given back between the planned captures (the runner's graphs hold theirs).
        self.pool.add_graph()
        cap.release_pool()
        if cap.invalidated_by is not None:  # an op refused and the code caught the error
            raise CaptureError(
                f"the capture on {self.device} was invalidated by an illegal op: "
                f"{cap.invalidated_by.rstrip('.')}. Fix the op; plan_memory() plans what "
                f"capture() would record")
        reserved = self.pool.reserved_bytes()
        result = CapturePlan(out, cap.events, reserved - before,
                             standalone_peak(cap.events, self.settings, self.policy), reserved,
                             unplanned)
        for entry in unplanned:
            if entry not in self.unplanned:
                self.unplanned.append(entry)
        self.captures.append(result)
        return result

    def pool_stats(self) -> dict[str, int]:
        """The planned pool's reserved bytes now and at its peak."""
        st = self.pool.engine.memory_stats()
        return {"reserved": st["reserved_bytes.all.current"],
                "peak_reserved": st["reserved_bytes.all.peak"]}

    def warmup_peak(self) -> int:
        """Peak reserved bytes of the eager warm-ups, predicted: every planned capture's
        allocation sequence replayed in order on one ordinary engine (the device's general
        allocator, empty at the start), each warm-up's outputs dropped at its end (the runner
        drops them before it captures)."""
        events: list[PoolEvent] = []
        for cap in self.captures:
            live: set[int] = set()
            for event in cap.events:
                action, key, _nbytes = event
                if action == "alloc":
                    live.add(key)
                elif key not in live:
                    continue  # a block of an earlier capture: its warm-up freed it already
                else:
                    live.discard(key)
                events.append(event)
            events += [("free", key, 0) for key in live]
        return int(standalone_peak(events, self.settings, self.policy)) if events else 0

    def write_trace(self, path: str, allocator_settings: dict[str, Any], what: str) -> None:
        """Write the planned pool's allocations so far (``record_events``) as a memory-snapshot
        trace at ``path`` (format by suffix, as ``accel-alloc generate``), for ``accel-alloc
        tune``/``simulate``/``inspect``. ``allocator_settings`` (torch's snapshot fields) and
        ``what`` are recorded in the trace."""
        engine = self.pool.engine
        events = engine.drain_events()
        events = events[np.argsort(events["seq"], kind="stable")]
        # A synthetic clock (5 us per event), as accel-alloc generate: deterministic traces.
        events["time_us"] = np.arange(len(events), dtype=np.int64) * 5
        settings = dict(allocator_settings)
        settings["accel_graph_memory_plan"] = {"what": what, "policy": self.policy}
        device_type = str(settings.get("device_type", "cuda"))
        trace = Trace.from_events(events, device_type=device_type, segments=engine.snapshot(),
                                  allocator_settings=settings)
        save_trace(trace, path)
