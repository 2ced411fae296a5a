"""The recorder backend: CUDA-faithful capture and replay on the CPU and any device.

It records aten ops at the dispatcher during capture (see :mod:`.capture`) and replays them as
a straight-line program (see :mod:`.program`), with the semantics of a CUDA graph: capture runs
no kernels, inputs are captured by reference, outputs live in the graph's pool, capture-illegal
operations fail at the op.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from ...errors import BackendUnavailable, CaptureError, PoolError
from ...foundation import config
from ...foundation.compile_options import CompileOptions
from ..base import (
    Backend,
    Capabilities,
    DeviceSpec,
    GraphImpl,
    PoolHandle,
    PoolStats,
    next_user_pool_id,
)
from ..capture_common import islands
from . import collective_check, collectives
from .capture import Capture
from .compiled import replay_choice
from .compiled.choice import CompiledChoice
from .compiled.policy import ReplayPolicy
from .dump import describe, write_dump
from .pool import make_pool
from .pool_protocol import GraphPool, PoolEvent, PoolRef
from .program import build_replay, materialize, replayed
from .steps import InputRecord, Step
from .threads import active_capture

log = logging.getLogger("accel_graph")

_CAPABILITIES = Capabilities(native_graphs=False, standalone_bytes=True, compile=True)


def _in_compiled_frame() -> bool:
    compiler = getattr(torch, "compiler", None)
    fn = getattr(compiler, "is_compiling", None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:  # never let a probe of torch.compile break capture
        return False


class RecorderGraphImpl(CompiledChoice, GraphImpl):
    """One recorder graph: a capture, then a compiled straight-line replay program."""

    def __init__(self, backend: RecorderBackend, device: DeviceSpec, *, keep_graph: bool = False,
                 compile: CompileOptions | None = None) -> None:
        super().__init__(device, keep_graph=keep_graph)
        self._backend = backend
        #: Decides which program replays (compiled/policy.py), from the resolved compile=.
        self._policy = ReplayPolicy(compile)
        self._capture: Capture | None = None
        self._pool: GraphPool | None = None
        self._handle: PoolHandle | None = None
        self._steps: list[Step] = []
        self._inputs: list[InputRecord] = []
        self._replay_fn: Any = None
        self._debug = False
        self._release: weakref.finalize | None = None
        self._outputs: list[PoolRef] = []
        self._compiled: dict[str, Any] | None = None
        #: Which program replays and why; a ReplayDecider while the first replays decide.
        self._mode = self._policy.not_instantiated()
        self._decider: replay_choice.ReplayDecider | None = None
        self._frozen_steps: list[Step] = []
        self._memory = 0
        self._standalone: int | None = 0
        self._events: list[PoolEvent] = []
        self._allocations = 0
        #: The graph's collectives, checked across ranks at the first replay (None: none).
        self._signature: collective_check.Signature | None = None
        self.num_ops = 0

    def pool(self) -> PoolHandle:
        assert self._handle is not None
        return self._handle

    def memory_bytes(self) -> int:
        """Bytes this capture added to the pool (reserved growth during the capture)."""
        return self._memory

    def work_count(self) -> int:
        """Ops replay runs (views and ``torch.empty`` run nothing): 0 means an empty graph."""
        return self.num_ops

    def compile_info(self) -> dict[str, Any] | None:
        """A copy of the compile report of ``compile="inductor"`` (``compiled.compile_program``'s
        info, or ``{"backend", "fallback"}``), None until instantiated or when not compiled."""
        return None if self._compiled is None else dict(self._compiled)

    def standalone_bytes(self) -> int:
        """Peak reserved bytes of this capture's own allocation sequence on an empty pool."""
        if self._standalone is None:
            # Pending only while the graph holds its pool (reset() settles it).
            assert self._pool is not None
            self._standalone = self._pool.standalone_bytes(self._events)
        return self._standalone

    # -- capture ------------------------------------------------------------------------
    def capture_begin(self, pool: PoolHandle, capture_error_mode: str) -> None:
        current = active_capture()
        if current is not None:
            raise CaptureError(
                f"a capture is already underway on this thread on {self.device}; end it with "
                f"capture_end() before beginning another (one capture at a time per stream, as on CUDA)"
            )
        if _in_compiled_frame():
            raise CaptureError(
                "capture cannot begin inside a torch.compile frame: compiled code is invisible to "
                "the recorder. Capture outside the compiled function, or use Graph(compile='inductor')"
            )
        if pool is None:
            pool = self._backend.private_pool_handle(self.device)
        gpool = self._backend.pool_for(pool)
        cap = Capture(gpool, self.device.torch_device, poison=self._debug or config.poison_outputs(),
                      generators=tuple(self.generators))
        cap.begin()  # PoolError when another thread is capturing into this pool: nothing changed
        self._pool, self._handle, self._capture = gpool, pool, cap

    def _leave(self, why: str) -> Capture | None:
        """Stop recording (the pool is told separately). On the capturing thread the mode
        leaves the dispatch stack; elsewhere (a collected Graph) it turns into a pass-through
        there until that thread next calls the recorder."""
        cap = self._capture
        if cap is not None:
            cap.stop(why)
            if cap.thread is threading.current_thread():
                # Break the capture <-> mode cycle (freed by refcount). Not from another
                # thread: that thread's mode must still see that its capture is over.
                cap.mode.capture = None
        return cap

    def capture_end(self) -> None:
        cap = self._leave("ended")
        assert cap is not None and self._pool is not None
        if cap.invalidated_by is not None:
            cap.release_pool()  # already released at the op; idempotent
            self._capture = None
            self._pool = self._handle = None
            raise CaptureError(
                f"the capture on {self.device} was invalidated by an illegal op and recorded "
                f"nothing: {cap.invalidated_by.rstrip('.')}. The graph is empty; fix the op and "
                f"capture again"
            )
        created = collectives.known_groups() - cap.groups_at_begin
        if created:
            raise CaptureError(
                f"process group(s) {sorted(created)} were created during the capture on "
                f"{self.device} (new_group inside a capture): group creation talks to the store "
                f"and the other ranks on the host and cannot be replayed. Create process groups "
                f"before capture, on every rank"
            )
        pool = self._pool
        self.num_ops = replayed(cap.steps)
        # Register the graph before the capture ends, so memory freed during the capture but
        # still written by the program is not released in between.
        pool.add_graph()
        cap.release_pool()
        self._inputs = list(cap.inputs.values())
        self._outputs = cap.live_outputs()
        self._memory = pool.reserved_bytes() - cap.reserved_before
        # standalone_bytes() replays the capture's allocation sequence on an empty pool: a
        # pure function of the events, so it runs when first asked, not at every capture.
        self._standalone = None
        self._events = cap.events
        self._allocations = sum(1 for e in cap.events if e[0] == "alloc")
        # The program's tensors are created only now: during capture nothing held pool memory.
        self._frozen_steps = cap.steps
        sig = collective_check.signature_of(cap.steps, self.device.torch_device)
        self._signature = sig if len(sig) else None
        self._steps = materialize(cap.steps, pool)
        self._capture = None
        # Deleting the graph (or reset) tells the pool; memory goes only when nothing uses it.
        self._release = weakref.finalize(self, pool.remove_graph)
        if not self.keep_graph:
            self.instantiate()

    def abort_capture(self) -> None:
        cap = self._leave("aborted")
        if cap is not None:
            cap.release_pool()
        self._capture = None
        self._steps, self._inputs = [], []
        self._pool = None
        self._handle = None

    # -- replay -------------------------------------------------------------------------
    def instantiate(self) -> None:
        if self._replay_fn is not None:
            return
        if self._policy.compiled_requested:
            self._replay_fn = self._choose_program()
        else:
            self._replay_fn = build_replay(self._steps, self._inputs)
        if self._signature is not None:  # every rank checks the others at the first replay
            self._replay_fn = self._checked_first(self._replay_fn, self._signature)

    def _checked_first(self, run: Any, sig: Any) -> Any:
        """``run`` preceded by the cross-rank collective check, on the first replay only: a
        passed check puts ``run`` itself in place, so later replays pay nothing for it (a
        failed one is repeated next time; every rank fails it together). The graph is held
        weakly, so an unreplayed graph is freed by reference counting."""
        graph = weakref.ref(self)

        def first() -> None:
            collective_check.first_replay_check(sig)
            me = graph()
            if me is not None and me._replay_fn is first:
                me._replay_fn = run
            run()

        return first

    def replay(self) -> None:
        if torch._C._len_torch_dispatch_stack():
            # Replay is the captured program, never re-recorded by a mode the caller has open.
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes(), torch._C._InferenceMode(True):
                self._replay_fn()
            return
        with torch._C._InferenceMode(True):
            self._replay_fn()

    def reset(self) -> None:
        self._signature = None
        self._steps, self._inputs, self._outputs = [], [], []
        self._frozen_steps = []
        self._compiled = None
        self._replay_fn = None
        self._decider = None
        self._mode = self._policy.not_instantiated(reset=True)
        if self._release is not None:
            self._release()  # after dropping the program, so its memory can go
            self._release = None
        if self._standalone is None:  # never asked for: not worth a simulation now
            self._standalone = 0
        self._events = []
        self._pool = None
        self._handle = None
        self.num_ops = 0

    # -- debugging ------------------------------------------------------------------------
    def enable_debug_mode(self) -> None:
        self._debug = True

    def describe(self) -> dict[str, Any]:
        """JSON-ready description of the program (see :mod:`.dump`)."""
        stats = self._pool.stats() if self._pool is not None else None
        return describe(self._frozen_steps, self._inputs, self._outputs, {
            "device": str(self.device),
            "pool_id": list(self._handle.id) if self._handle else None,
            "pool": stats.as_dict() if stats else None,
            "memory_bytes": self._memory,
            "standalone_bytes": self.standalone_bytes(),
            "allocations_at_capture": self._allocations,
            "compiled": None if self._compiled is None else {
                **self._compiled, "replay_mode": self.replay_mode().as_dict()},
        })

    def debug_dump(self, path: str) -> None:
        write_dump(path, self.describe())


class RecorderBackend(Backend):
    """Dispatcher-level record and replay; usable on every machine with torch."""

    name = "recorder"
    aliases = ("cpu", "record")
    device_types = ("*",)
    priority = -100

    def __init__(self) -> None:
        self._pools: weakref.WeakValueDictionary[tuple, GraphPool] = weakref.WeakValueDictionary()
        # User handles by id, held weakly: a handle is valid while the user holds it (or while
        # a pool created from it has graphs, via _pools); a dropped handle costs nothing.
        self._handles: weakref.WeakValueDictionary[tuple[int, int], PoolHandle] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        return None if hasattr(torch.utils, "_python_dispatch") else "torch lacks TorchDispatchMode"

    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def default_device(self) -> torch.device:
        return torch.device("cpu")

    def device_spec(self, device: torch.device) -> DeviceSpec:
        dev = torch.device(device)
        if dev.type == "meta":
            raise BackendUnavailable("the recorder cannot capture on the meta device: it has no memory to replay into")
        if dev.type != "cpu" and dev.index is None:
            dev = torch.device(dev.type, _current_index(dev.type))
        if dev.type != "cpu":
            count = _device_count(dev.type)
            if count is not None and (dev.index is None or dev.index >= count):
                raise BackendUnavailable(
                    f"device {dev} does not exist: this host has {count} {dev.type} device(s)"
                )
        return DeviceSpec("recorder", dev.type, None if dev.type == "cpu" else dev.index)

    def new_graph(self, device: DeviceSpec, *, keep_graph: bool,
                  compile: CompileOptions | None) -> GraphImpl:
        return RecorderGraphImpl(self, device, keep_graph=keep_graph, compile=compile)

    def graph_pool_handle(self, device: DeviceSpec) -> PoolHandle:
        handle = PoolHandle("recorder", device, next_user_pool_id())
        with self._lock:
            self._handles[handle.id] = handle
        return handle

    def tracked_handles(self) -> int:
        """How many user pool handles the backend knows of: those still referenced somewhere
        (for leak checks; handles are held weakly)."""
        with self._lock:
            return len(self._handles)

    def private_pool_handle(self, device: DeviceSpec) -> PoolHandle:
        """A graph's own pool: ``(k, 0)`` like torch, known to the backend only while it lives."""
        return PoolHandle("recorder", device, (next_user_pool_id()[1], 0))

    def resolve_pool(self, pool: object, device: DeviceSpec) -> PoolHandle:
        if isinstance(pool, PoolHandle):
            if pool.backend != "recorder":
                raise PoolError(
                    f"pool handle {pool} belongs to the {pool.backend} backend, not the recorder; "
                    f"create one with accel_graph.graph_pool_handle(device={device.torch_device!s})"
                )
            if pool.device != device:
                raise PoolError(
                    f"pool handle {pool} belongs to {pool.device}, but this graph captures on "
                    f"{device}; pools are per device, create one for this device"
                )
            if pool.id not in self._handles and pool.id not in self._pools:
                raise PoolError(f"pool handle {pool} belongs to no pool of this process")
            return pool
        raise PoolError(
            f"pool={pool!r} is not an accel_graph pool handle; the recorder accepts only handles "
            f"from accel_graph.graph_pool_handle() or Graph.pool() (torch's handles and MemPool "
            f"ids belong to native backends)"
        )

    def pool_for(self, handle: PoolHandle) -> GraphPool:
        """The pool object behind ``handle``, created on first use and kept alive by its graphs."""
        with self._lock:
            pool = self._pools.get(handle.id)
            if pool is None:
                pool = make_pool(handle.device.torch_device, limit=config.pool_limit())
                self._pools[handle.id] = pool
            return pool

    def pool_stats(self, pool: PoolHandle) -> PoolStats | None:
        p = self._pools.get(pool.id)
        return p.stats() if p is not None else None

    def is_current_stream_capturing(self, device: DeviceSpec) -> bool:
        cap = active_capture()
        # An eager island runs outside the capture (capture_common.islands): as in eager.
        return cap is not None and not islands.running()

    def current_stream(self, device: DeviceSpec) -> Any:
        return None


def _current_index(device_type: str) -> int:
    mod = getattr(torch, device_type, None)
    fn = getattr(mod, "current_device", None)
    try:
        return int(fn()) if fn is not None else 0
    except Exception:
        return 0


def _device_count(device_type: str) -> int | None:
    mod = getattr(torch, device_type, None)
    fn = getattr(mod, "device_count", None)
    try:
        return int(fn()) if fn is not None else None
    except Exception:
        return None
