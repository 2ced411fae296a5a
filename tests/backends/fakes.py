"""FAKE ``torch.cuda`` / ``torch.xpu`` / ``torch.accelerator`` pieces for CPU tests.

These fakes test routing and argument plumbing only: which torch API our backends call, with
which arguments, in which order, and what they do with the answers. They are never GPU
verification: no kernel runs, no graph is captured, and the fake allocator is a list of dicts.
The behaviour they imitate (error strings, pool-id conventions, signatures per torch version)
is taken from torch 2.13's sources as summarised in shared/reference/torch-internals.md.

A fake is installed by patching attributes onto the real ``torch.cuda`` / ``torch.xpu`` module
with pytest's ``monkeypatch`` (so every patch is undone after the test).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any

import pytest
import torch

CUDA_NAMES = (
    "is_available", "is_initialized", "device_count", "current_device", "device",
    "get_device_capability", "get_device_properties", "get_arch_list", "Stream", "stream",
    "current_stream", "default_stream", "synchronize", "empty_cache",
    "is_current_stream_capturing", "graph_pool_handle", "CUDAGraph", "memory_snapshot",
)
XPU_NAMES = (
    "is_available", "is_initialized", "device_count", "current_device", "device", "Stream",
    "stream", "current_stream", "synchronize", "empty_cache", "is_current_stream_capturing",
    "graph_pool_handle", "XPUGraph", "memory_snapshot",
)


class FakeStream:
    """A stream id on a device; equality like torch's (same device, same id)."""

    _ids = itertools.count(1)

    def __init__(self, device: int | None = 0, *, stream_id: int | None = None) -> None:
        self.device_index = 0 if device is None else int(device)
        self.stream_id = next(self._ids) if stream_id is None else stream_id

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FakeStream)
            and (self.device_index, self.stream_id) == (other.device_index, other.stream_id)
        )

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"FakeStream(device={self.device_index}, id={self.stream_id})"


class FakeGraphBase:
    """Shared mechanics of the fake graph classes: a call log and the allocator hooks."""

    module: FakeDeviceModule  # set on the per-module subclass

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.calls: list[tuple[str, Any]] = []
        self._pool: tuple[int, int] | None = None
        self._stream: FakeStream | None = None
        self.ended = False
        self.instantiated = False
        #: FAKE kernels captured into this graph (``module.launch``): each replay runs them.
        self.work: list[Any] = []
        self.module.graphs.append(self)

    def _begin(self, pool: tuple[int, int] | None, mode: str) -> None:
        mod = self.module
        stream = mod.current_stream()
        if mod.require_side_stream and stream == mod._default[mod._current]:
            raise RuntimeError(
                "CUDA graphs must be captured on a non-default stream. (However, after capture, "
                "it's ok to replay them on the default stream.)"
            )
        if pool is not None and tuple(pool) != (0, 0):
            if pool[0] and pool[1]:
                raise RuntimeError("INTERNAL ASSERT FAILED: !(pool.first && pool.second)")
            held = any(s["segment_pool_id"] == tuple(pool) for s in mod.segments)
            if mod.pool_use.get(tuple(pool)) == 0 and held:
                # torch's create_or_incref_pool: joining a released pool whose memory is still
                # held by tensors trips TORCH_INTERNAL_ASSERT(use_count > 0)
                raise RuntimeError("INTERNAL ASSERT FAILED: it->second->use_count > 0")
            self._pool = tuple(pool)
        else:
            self._pool = (next(mod._private_ids), 0)
        mod.pool_use[self._pool] = mod.pool_use.get(self._pool, 0) + 1
        self._stream = stream
        mod.capturing = self
        self.calls.append(("capture_begin", {"pool": pool, "mode": mode}))

    def capture_end(self) -> None:
        mod = self.module
        if mod.capturing is not self:
            raise RuntimeError("capture_end() called before capture_begin().")
        if mod.current_stream() != self._stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        mod.capturing = None
        if mod.warn_empty and not self.work:
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was "
                          "attempted to be captured on wrong device or stream.", UserWarning,
                          stacklevel=2)
        if mod.fail_next_capture_end:
            mod.fail_next_capture_end = False
            raise RuntimeError("operation failed due to a previous error during capture")
        self.ended = True
        self.calls.append(("capture_end", None))
        if not self.keep_graph:
            self.instantiate()

    def instantiate(self) -> None:
        self.instantiated = True
        self.calls.append(("instantiate", None))

    def replay(self) -> None:
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self.calls.append(("replay", None))
        self.module.replays += 1
        self.module.log.append(("replay", self))
        for fn in self.work:
            fn()

    def reset(self) -> None:
        mod = self.module
        if mod.capturing is self:
            mod.capturing = None
        if self._pool is not None:
            mod.pool_use[self._pool] -= 1
        self._pool = None
        self.ended = False
        self.work = []
        self.calls.append(("reset", mod.synced_since_last_reset))
        mod.synced_since_last_reset = False

    def pool(self) -> tuple[int, int]:
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        assert self._pool is not None
        return self._pool

    def enable_debug_mode(self) -> None:
        self.calls.append(("enable_debug_mode", None))

    def debug_dump(self, path: str) -> None:
        self.calls.append(("debug_dump", path))
        with open(path, "w", encoding="utf-8") as f:
            f.write("digraph fake {}\n")


class FakeDeviceModule:
    """State shared by the fake modules: devices, streams, a toy allocator, capture state."""

    graph_class_name = "CUDAGraph"
    require_side_stream = True

    def __init__(self, device_count: int = 2) -> None:
        self.count = device_count
        self.available = True
        self.initialized = False
        self._current = 0
        self._default = {i: FakeStream(i, stream_id=0) for i in range(device_count)}
        self._streams = dict(self._default)
        self.capturing: FakeGraphBase | None = None
        self.graphs: list[FakeGraphBase] = []
        self.pool_use: dict[tuple[int, int], int] = {}
        self.segments: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        #: Graph events in order across graphs (``launch``/``replay``), for pieces tests.
        self.log: list[tuple[str, Any]] = []
        self.replays = 0
        #: The pool this thread's allocations are routed to outside capture (FAKE
        #: ``_cuda_beginAllocateCurrentThreadToPool``, see ``install_pool_routing``).
        self.routing: tuple[int, int] | None = None
        self.fail_next_capture_end = False
        #: Warn as torch's capture_end does for a graph without work (``launch``): opt-in, since
        #: most fake captures only ``allocate``.
        self.warn_empty = False
        self.synced_since_last_reset = False
        self._user_ids = itertools.count(1)
        self._private_ids = itertools.count(1)
        self._addr = itertools.count(0x7F0000000000, 0x100000)
        graph_cls = type(f"Fake{self.graph_class_name}", (self.graph_base(),), {"module": self})
        setattr(self, self.graph_class_name, graph_cls)

    def graph_base(self) -> type:
        return FakeGraphBase

    # -- device and stream API ----------------------------------------------------------------
    def is_available(self) -> bool:
        return self.available

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        self.initialized = True
        return self._current

    @contextlib.contextmanager
    def device(self, index: int):  # noqa: ANN201 - mirrors torch.cuda.device
        prev, self._current = self._current, int(index)
        try:
            yield
        finally:
            self._current = prev

    def Stream(self, device: int | None = None) -> FakeStream:  # noqa: N802 - torch's name
        self.calls.append(("Stream", device))
        return FakeStream(self._current if device is None else device)

    @contextlib.contextmanager
    def stream(self, s: FakeStream | None):  # noqa: ANN201 - mirrors torch.cuda.stream
        if s is None:
            yield
            return
        prev_dev, prev_stream = self._current, self._streams[s.device_index]
        self._current = s.device_index
        self._streams[s.device_index] = s
        try:
            yield
        finally:
            self._streams[s.device_index] = prev_stream
            self._current = prev_dev

    def current_stream(self, device: int | None = None) -> FakeStream:
        return self._streams[self._current if device is None else device]

    def default_stream(self, device: int | None = None) -> FakeStream:
        return self._default[self._current if device is None else device]

    def synchronize(self, device: int | None = None) -> None:
        if self.capturing is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.calls.append(("synchronize", device))
        self.synced_since_last_reset = True

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def is_current_stream_capturing(self) -> bool:
        g = self.capturing
        return g is not None and g._stream == self.current_stream()

    def graph_pool_handle(self) -> tuple[int, int]:
        return (0, next(self._user_ids))

    # -- FAKE kernels ---------------------------------------------------------------------------
    def launch(self, fn: Any) -> None:
        """Pretend ``fn`` (a Python function doing tensor work on the CPU) is a kernel launched
        on the current stream: during a capture it is recorded into the capturing graph and runs
        only at that graph's replays (stream capture runs nothing); outside it runs now."""
        if self.capturing is not None:
            self.capturing.work.append(fn)
            self.log.append(("captured", self.capturing))
        else:
            fn()

    # -- toy allocator --------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: int | None = None) -> None:
        """Pretend a tensor was allocated: a new segment in the capturing graph's pool (or the
        pool routed to, or the default pool ``(0, 0)`` outside capture) on the current device."""
        if self.capturing is not None:
            pool = self.capturing._pool
        else:
            pool = self.routing or (0, 0)
        self.segments.append({
            "device": self._current if device is None else device,
            "address": next(self._addr),
            "total_size": nbytes,
            "allocated_size": nbytes,
            "segment_pool_id": pool,
            "blocks": [],
        })

    def memory_snapshot(self, mempool_id: tuple[int, int] | None = None, include_traces: bool = True) -> list:
        self.calls.append(("memory_snapshot", (mempool_id, include_traces)))
        if mempool_id is None:
            return list(self.segments)
        return [s for s in self.segments if s["segment_pool_id"] == tuple(mempool_id)]

    def _snapshot(self, device: int | None = None) -> dict:
        return {"segments": list(self.segments), "device_traces": []}

    def install(self, monkeypatch: pytest.MonkeyPatch, target: Any, names: tuple[str, ...]) -> None:
        for name in names:
            monkeypatch.setattr(target, name, getattr(self, name), raising=False)
        monkeypatch.setattr(target.memory, "_snapshot", self._snapshot, raising=False)


class FakeCudaModule(FakeDeviceModule):
    """A FAKE ``torch.cuda`` (CUDA or ROCm build), for plumbing tests only.

    ``capability`` is what every device reports; ``arch_list`` is the build's list;
    ``gcn_arch`` is the ROCm ``gcnArchName``. ``legacy_snapshot=True`` imitates a torch whose
    ``memory_snapshot()`` takes no pool id (the backend must fall back to ``_snapshot()``).
    """

    def __init__(
        self,
        device_count: int = 2,
        *,
        capability: tuple[int, int] = (9, 0),
        arch_list: tuple[str, ...] = ("sm_80", "sm_90", "compute_90"),
        gcn_arch: str = "gfx942:sramecc+:xnack-",
        legacy_snapshot: bool = False,
    ) -> None:
        super().__init__(device_count)
        self.capability = capability
        self.arch_list = list(arch_list)
        self.gcn_arch = gcn_arch
        if legacy_snapshot:
            def memory_snapshot() -> list:  # torch without mempool_id: whole-allocator only
                return list(self.segments)
            self.memory_snapshot = memory_snapshot  # type: ignore[method-assign]

    def graph_base(self) -> type:
        class FakeCUDAGraphBase(FakeGraphBase):
            # torch 2.13's signature (2.11 lacks check_input_liveness; we never pass it)
            def capture_begin(self, pool=None, capture_error_mode="global", check_input_liveness=False):  # noqa: ANN001, ANN202
                if capture_error_mode not in ("global", "thread_local", "relaxed"):
                    raise RuntimeError(
                        "Unknown capture error mode. Expected `global`, `thread_local`, or "
                        f"`relaxed`, got {capture_error_mode}"
                    )
                self._begin(pool, capture_error_mode)

        return FakeCUDAGraphBase

    def get_device_capability(self, device: int | None = None) -> tuple[int, int]:
        self.initialized = True
        return self.capability

    def get_device_properties(self, device: int | None = None) -> Any:
        self.initialized = True
        return type("Props", (), {"gcnArchName": self.gcn_arch, "name": "Fake GPU"})()

    def get_arch_list(self) -> list[str]:
        return list(self.arch_list)

    def install_into_torch(self, monkeypatch: pytest.MonkeyPatch, *, hip: str | None = None) -> None:
        """Patch torch.cuda (and torch.version) so torch looks like a CUDA build, or a ROCm one
        when ``hip`` is a version string; the current accelerator becomes ``cuda``."""
        self.install(monkeypatch, torch.cuda, CUDA_NAMES)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "12.8")
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
        # torch.accelerator.device_count() is Python over torch.cuda.device_count() (the fake's);
        # current_device_index() is C++ and would ask the real runtime: answer from the fake.
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: self._current, raising=False)


class FakeAcceleratorGraphBase(FakeGraphBase):
    """FAKE ``torch.accelerator.Graph`` as in torch 2.12/2.13: pool and mode are constructor
    keywords stored as attributes, and ``capture_begin()`` takes no arguments."""

    registered = True

    def __init__(self, keep_graph: bool = False, *, pool=None, capture_error_mode="default") -> None:  # noqa: ANN001
        if not self.registered:
            raise RuntimeError("Graph is not supported on device type: xpu")
        super().__init__(keep_graph)
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode

    def capture_begin(self) -> None:
        self._begin(self.graph_pool, self.capture_error_mode)


class FakeAcceleratorGraphMainBase(FakeGraphBase):
    """FAKE ``torch.accelerator.Graph`` as on current upstream main: the mode moved back to
    ``capture_begin(capture_error_mode=...)``; the pool stays a constructor keyword."""

    def __init__(self, keep_graph: bool = False, *, pool=None) -> None:  # noqa: ANN001
        super().__init__(keep_graph)
        self.graph_pool = pool

    def capture_begin(self, capture_error_mode: str = "default") -> None:
        self._begin(self.graph_pool, capture_error_mode)


class FakeXpuModule(FakeDeviceModule):
    """A FAKE ``torch.xpu`` (and optionally ``torch.accelerator.Graph``), plumbing only.

    ``xpu_graph=False`` removes ``XPUGraph`` (torch before 2.11); ``accelerator_graph`` is
    ``"registered"``, ``"unregistered"`` (the class exists but XPU has no implementation
    behind it), ``"main"`` (registered, upstream main's signature) or ``None`` (before 2.12).
    """

    graph_class_name = "XPUGraph"
    require_side_stream = False  # XPU has no non-default-stream check

    def __init__(self, device_count: int = 1, *, xpu_graph: bool = True, accelerator_graph: str | None = None) -> None:
        super().__init__(device_count)
        self.xpu_graph = xpu_graph
        self.accelerator_graph = accelerator_graph
        module = self
        if accelerator_graph == "main":
            self.AcceleratorGraph = type(
                "FakeAcceleratorGraph", (FakeAcceleratorGraphMainBase,), {"module": module}
            )
        else:
            self.AcceleratorGraph = type(
                "FakeAcceleratorGraph",
                (FakeAcceleratorGraphBase,),
                {"module": module, "registered": accelerator_graph == "registered"},
            )

    def graph_base(self) -> type:
        class FakeXPUGraphBase(FakeGraphBase):
            def capture_begin(self, pool=None) -> None:  # noqa: ANN001 - torch.xpu.XPUGraph's signature
                self._begin(pool, "default")

        return FakeXPUGraphBase

    def memory_snapshot(self, mempool_id: tuple[int, int] | None = None) -> list:  # type: ignore[override]
        # torch.xpu.memory_snapshot has no include_traces: the backend must retry without it
        return super().memory_snapshot(mempool_id, include_traces=False)

    def install_into_torch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        names = XPU_NAMES if self.xpu_graph else tuple(n for n in XPU_NAMES if n != "XPUGraph")
        self.install(monkeypatch, torch.xpu, names)
        if not self.xpu_graph:
            monkeypatch.delattr(torch.xpu, "XPUGraph", raising=False)
        if self.accelerator_graph is None:
            monkeypatch.delattr(torch.accelerator, "Graph", raising=False)
        else:
            monkeypatch.setattr(torch.accelerator, "Graph", self.AcceleratorGraph, raising=False)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: self._current, raising=False)


# -- FAKE conditional-node capture (issue 18): plumbing only ----------------------------------
CONDITIONAL_NODES = "torch._higher_order_ops.cudagraph_conditional_nodes"


def conditional_nodes_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch's conditional-node capture module where this torch ships it (2.13+); on a torch
    without it (2.11) an empty FAKE stand-in, put into ``sys.modules`` for the test only, so the
    fakes below can give it their ``if_else_node`` / ``while_loop_node``. Plumbing only: the
    stand-in has nothing of torch's code."""
    import importlib
    import sys
    import types

    try:
        return importlib.import_module(CONDITIONAL_NODES)
    except ImportError:
        fake = types.ModuleType(CONDITIONAL_NODES, "FAKE stand-in (tests/backends/fakes.py)")
        monkeypatch.setitem(sys.modules, CONDITIONAL_NODES, fake)
        return fake


def install_conditional_nodes(fake: FakeCudaModule, monkeypatch: pytest.MonkeyPatch, *,
                              while_nodes: bool = False) -> list[tuple[str, Any]]:
    """Give the FAKE ``torch.cuda.CUDAGraph`` torch 2.13's conditional-node methods (and, with
    ``while_nodes``, torch 2.14.1's while-node ones), and replace torch's ``if_else_node`` /
    ``while_loop_node`` with imitations that drive them without the ``pred.is_cuda`` check (the
    fakes' tensors live on the CPU). Returns the shared call log. Nothing is captured: branch
    ops run eagerly on the CPU, in the order the real builders issue them."""
    from torch.utils import _pytree as pytree

    log: list[tuple[str, Any]] = []
    cls = fake.CUDAGraph

    def get_currently_capturing_graph() -> Any:
        if fake.capturing is None:
            raise RuntimeError("The current stream is not currently capturing.")
        return fake.capturing

    def begin_capture_to_if_node(self: Any, pred: torch.Tensor) -> None:
        log.append(("begin_capture_to_if_node", bool(pred)))

    def begin_capture_to_while_node(self: Any, pred: torch.Tensor) -> None:
        log.append(("begin_capture_to_while_node", bool(pred)))

    def set_conditional_handle_for_current_node(self: Any, pred: torch.Tensor) -> None:
        log.append(("set_conditional_handle_for_current_node", bool(pred)))

    def end_capture_to_conditional_node(self: Any) -> None:
        log.append(("end_capture_to_conditional_node", None))

    monkeypatch.setattr(cls, "get_currently_capturing_graph", staticmethod(get_currently_capturing_graph), raising=False)
    monkeypatch.setattr(cls, "begin_capture_to_if_node", begin_capture_to_if_node, raising=False)
    monkeypatch.setattr(cls, "end_capture_to_conditional_node", end_capture_to_conditional_node, raising=False)

    def if_else_node(pred: torch.Tensor, true_fn: Any, false_fn: Any, operands: tuple) -> Any:
        # torch 2.13's shape: two IF nodes (pred, then not pred); the false branch's results are
        # copied into the true branch's, which are what the caller holds.
        outs = []
        for p, fn in ((pred, true_fn), (torch.logical_not(pred), false_fn)):
            g = get_currently_capturing_graph()
            g.begin_capture_to_if_node(p)
            try:
                outs.append(fn(*operands))
                if len(outs) == 2:
                    for a, b in zip(pytree.tree_leaves(outs[0]), pytree.tree_leaves(outs[1])):
                        a.copy_(b)
            finally:
                g.end_capture_to_conditional_node()
        return outs[0]

    api = conditional_nodes_module(monkeypatch)
    monkeypatch.setattr(api, "if_else_node", if_else_node, raising=False)
    if while_nodes:
        monkeypatch.setattr(cls, "begin_capture_to_while_node", begin_capture_to_while_node, raising=False)
        monkeypatch.setattr(cls, "set_conditional_handle_for_current_node",
                            set_conditional_handle_for_current_node, raising=False)

        def while_loop_node(cond_fn: Any, body_fn: Any, carried: tuple, additional: tuple) -> Any:
            # torch 2.14.1's shape: clone the carries, one WHILE node whose body copies the
            # results back (skipping a result that is its carry) and re-evaluates the condition
            # (run once here: nothing loops).
            state = tuple(c.clone() for c in carried)
            g = get_currently_capturing_graph()
            g.begin_capture_to_while_node(cond_fn(*state, *additional))
            try:
                for dst, src in zip(state, body_fn(*state, *additional)):
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
                g.set_conditional_handle_for_current_node(cond_fn(*state, *additional))
            finally:
                g.end_capture_to_conditional_node()
            return state

        monkeypatch.setattr(api, "while_loop_node", while_loop_node, raising=False)
    return log


# -- FAKE torch 2.14 graph lifecycle hooks (issue 24 item 6): plumbing only -------------------
HOOK_EVENTS = ("capture_start", "capture_end", "instantiate", "replay_start", "replay_end")


def install_torch_graph_hooks(fake: FakeDeviceModule, monkeypatch: pytest.MonkeyPatch
                              ) -> dict[str, Any]:
    """Make the FAKE ``CUDAGraph`` fire FAKE module-level hooks the way torch 2.14's does
    (``torch.cuda.graphs.register_graph_<event>_hook``, patched onto the real module for the
    test): capture start once capture is live, capture end then (``keep_graph=False``)
    instantiate, replay start/end around each replay, destroy at ``reset()``. Returns the FAKE
    registries, event -> ``OrderedDict`` of hooks (all empty at first)."""
    from collections import OrderedDict

    from torch.utils.hooks import RemovableHandle

    registries: dict[str, OrderedDict[int, Any]] = {e: OrderedDict() for e in HOOK_EVENTS}
    registries["destroy"] = OrderedDict()

    def registrar(event: str) -> Any:
        def register(fn: Any) -> RemovableHandle:
            handle = RemovableHandle(registries[event])
            registries[event][handle.id] = fn
            return handle
        return register

    for event in registries:
        monkeypatch.setattr(torch.cuda.graphs, f"register_graph_{event}_hook", registrar(event),
                            raising=False)

    def run(event: str, arg: Any) -> None:
        for fn in list(registries[event].values()):
            fn(arg)

    cls = getattr(fake, fake.graph_class_name)
    begin, end, inst, replay, reset = (cls.capture_begin, cls.capture_end, cls.instantiate,
                                       cls.replay, cls.reset)

    def capture_begin(self: Any, *a: Any, **k: Any) -> None:
        begin(self, *a, **k)
        run("capture_start", self)

    def capture_end(self: Any) -> None:
        keep, self.keep_graph = self.keep_graph, True  # torch: end hooks before instantiate
        try:
            end(self)
        finally:
            self.keep_graph = keep
        run("capture_end", self)
        if not keep:
            self.instantiate()

    def instantiate(self: Any) -> None:
        inst(self)
        run("instantiate", self)

    def replay_(self: Any) -> None:
        run("replay_start", self)
        try:
            replay(self)
        finally:
            run("replay_end", self)

    def reset_(self: Any) -> None:
        reset(self)
        run("destroy", set())

    for name, fn in (("capture_begin", capture_begin), ("capture_end", capture_end),
                     ("instantiate", instantiate), ("replay", replay_), ("reset", reset_)):
        monkeypatch.setattr(cls, name, fn)
    return registries


# -- FAKE allocate-to-pool routing (issue 26: island buffers in the graph's pool) --------------
def install_pool_routing(fake: FakeDeviceModule, monkeypatch: pytest.MonkeyPatch, prefix: str = "cuda"
                         ) -> list[tuple[str, Any]]:
    """Give ``torch._C`` FAKE ``_<prefix>_beginAllocateCurrentThreadToPool`` /
    ``_<prefix>_endAllocateToPool`` / ``_<prefix>_releasePool`` (torch 2.13's names; a CPU
    build has raising stand-ins) that route ``fake.allocate`` into the pool and count its uses
    as torch's ``create_or_incref_pool`` / ``releasePool`` do. Returns the call log. Plumbing
    only: the CPU tensors the backend makes are not in any device pool."""
    log: list[tuple[str, Any]] = []

    def begin(device: int, pool: tuple[int, int]) -> None:
        assert fake.capturing is None or fake.capturing._pool != tuple(pool), (
            "beginAllocateToPool: already recording to mempool_id")
        fake.routing = tuple(pool)
        fake.pool_use[tuple(pool)] = fake.pool_use.get(tuple(pool), 0) + 1
        log.append(("begin", (device, tuple(pool))))
        fake.log.append(("begin_allocate_to_pool", tuple(pool)))

    def end(device: int, pool: tuple[int, int]) -> None:
        fake.routing = None
        log.append(("end", (device, tuple(pool))))

    def release(device: int, pool: tuple[int, int]) -> None:
        fake.pool_use[tuple(pool)] -= 1
        log.append(("release", (device, tuple(pool))))

    for name, fn in (("beginAllocateCurrentThreadToPool", begin), ("endAllocateToPool", end),
                     ("releasePool", release)):
        monkeypatch.setattr(torch._C, f"_{prefix}_{name}", fn, raising=False)
    return log
