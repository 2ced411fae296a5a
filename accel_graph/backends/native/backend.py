"""The native graph backends' shared base: :class:`NativeGraphBackend` and :class:`NativeGraphImpl`,
over torch's own graph classes (``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``,
``torch.accelerator.Graph``). The cuda, hip and xpu backends subclass the backend and state only
their differences.

The split follows tinygrad's ``alloc``/``_alloc`` and RMM's ``allocate``/``do_allocate``: the
base owns the policy (probe order, nested-capture refusal, the current-device check, capture
modes, pool bookkeeping, the impl's lifecycle and its error messages); a subclass fills the
*mechanism hooks* listed under "mechanism hooks" in :class:`NativeGraphBackend`, each with its
contract. Everything vendor-specific is reached through ``self.module`` (``torch.cuda`` or
``torch.xpu``, looked up when called, never at import). Every torch API is feature-detected: GPU
hosts may run torch 2.11.

Pool handles and pool memory live in :mod:`.native_pools` (``backend.pools``).
"""

from __future__ import annotations

import functools
import gc
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from ...errors import AccelGraphError, BackendUnavailable, CaptureError, ConfigError
from .. import presence
from ..base import (
    CAPTURE_ERROR_MODES,
    Backend,
    Capabilities,
    DeviceSpec,
    GraphImpl,
    PoolHandle,
    PoolStats,
)
from . import control_flow as control_flow
from . import control_flow_support as cf_support
from .capture_errors import end_capture_quietly
from .pools import NativePoolTable

#: What torch.cuda.CUDAGraph gives the cuda and hip backends (HIP reuses the CUDA API).
CUDA_GRAPH_CAPABILITIES = Capabilities(
    native_graphs=True,
    capture_error_modes=CAPTURE_ERROR_MODES,
    standalone_bytes=False,
    compile=False,
    foreign_pool_handles=True,
)


def begin_params(graph: Any) -> frozenset[str]:
    """Keyword arguments ``graph.capture_begin`` accepts (torch 2.11 lacks some; XPU takes only
    ``pool``; ``torch.accelerator.Graph`` in 2.13 takes none and reads attributes instead)."""
    return capture_begin_params(type(graph))


@functools.lru_cache(maxsize=32)
def capture_begin_params(cls: type) -> frozenset[str]:
    """Keyword arguments ``cls.capture_begin`` accepts (cached per class)."""
    try:
        return frozenset(inspect.signature(cls.capture_begin).parameters) - {"self"}
    except (TypeError, ValueError):  # a C function without a signature: assume torch's CUDA form
        return frozenset({"pool", "capture_error_mode"})


def _hint(exc: BaseException) -> str:
    """What to do about a torch error from capture_begin."""
    if "use_count" in str(exc):
        # torch's create_or_incref_pool: the pool's graphs were all released while tensors still
        # hold its memory, and torch cannot rejoin such a pool. Our own handles avoid this.
        return (
            "The torch pool was released by all its graphs while "
            "tensors still hold its memory, and torch cannot rejoin it: use a new handle "
            "(accel_graph.graph_pool_handle(), which remaps released pools) or keep a graph of "
            "that pool alive"
        )
    return (
        "Capture with `with accel_graph.graph(g): ...` (it uses a side stream on the graph's "
        "device) or make a non-default stream of that device current first"
    )


class NativeGraphImpl(GraphImpl):
    """One graph on a torch graph class. Holds a torch graph object only while captured; each
    capture uses a fresh one, so an aborted capture never leaves a half-used object behind.

    Calls only the backend's policy methods, its mechanism hooks and ``backend.pools``."""

    def __init__(self, backend: NativeGraphBackend, device: DeviceSpec, *, keep_graph: bool) -> None:
        super().__init__(device, keep_graph=keep_graph)
        self._backend = backend
        self._graph: Any = None
        self._handle: PoolHandle | None = None
        self._torch_id: tuple[int, int] | None = None
        self._before: int | None = None
        self._bytes: int | None = None
        self._debug = False
        self._flow: control_flow.ControlFlowMode | None = None  # torch.cond & co during capture
        self._stream: Any = None  # the stream the capture underway began on

    def capture_begin(self, pool: PoolHandle | None, capture_error_mode: str) -> None:
        b, pools = self._backend, self._backend.pools
        b.refuse_nested(self.device)
        b.check_current_device(self.device)
        mode = b.vendor_mode(capture_error_mode)
        if pool is None:
            pool = pools.private_handle(self.device)
        torch_id = pools.torch_id(pool)
        try:
            self._before = 0 if torch_id is None else pools.reserved(torch_id, self.device)
            graph = b.new_torch_graph(self.keep_graph, torch_id, mode)
            if self._debug:
                graph.enable_debug_mode()
            self.register_generators_with(graph)
            b.begin_capture(graph, torch_id, mode)
            self._stream = b.current_stream(self.device)  # for end_capture_quietly
        except BaseException as exc:
            pools.unused(pool)  # no graph holds it: forget the bookkeeping entry
            if isinstance(exc, RuntimeError) and not isinstance(exc, AccelGraphError):
                raise CaptureError(f"capture_begin on {self.device} failed: {exc}. {_hint(exc)}") from exc
            raise
        self._graph, self._handle, self._torch_id = graph, pool, torch_id
        pools.captured(pool)
        b.capture_started(self)
        self._flow = control_flow.start(b.control_flow_support(), self.device)

    def pool(self) -> PoolHandle:
        assert self._handle is not None  # the front end asks only after capture_begin
        return self._handle

    def capture_end(self) -> None:
        control_flow.end(self._flow)  # raises if an error left a conditional body
        self._flow = None
        try:
            self._graph.capture_end()
            self._backend.capture_stopped(self)
        except RuntimeError as exc:
            raise CaptureError(
                f"capture_end on {self.device} failed: {exc}. Typical causes: a host sync, "
                f"data-dependent shapes or unjoined side-stream work inside the capture; "
                f"run it under the recorder backend (device='cpu') to find the op"
            ) from exc
        if self._torch_id is None and self._handle is not None:
            self._torch_id = self._backend.pools.learned(self._handle, self._graph)
        after = None
        if self._torch_id is not None:
            after = self._backend.pools.reserved(self._torch_id, self.device)
        self._bytes = None if after is None or self._before is None else after - self._before
        if not self.keep_graph:
            self._bind_replay()

    def _bind_replay(self) -> None:
        # An instance attribute shadows the method: replay() is then torch's own bound method,
        # one Python frame less on the hot path.
        self.replay = self._graph.replay  # type: ignore[method-assign]

    def abort_capture(self) -> None:
        graph, self._graph = self._graph, None
        self.__dict__.pop("replay", None)
        control_flow.stop(self._flow)
        self._flow = None
        self._backend.capture_stopped(self)
        if graph is None:
            return
        stream, self._stream = self._stream, None
        end_capture_quietly(self._backend, stream, graph)
        try:
            graph.reset()
        except Exception:
            pass
        self._release()

    def instantiate(self) -> None:
        self._graph.instantiate()
        self._bind_replay()

    def replay(self) -> None:
        self._graph.replay()

    def reset(self) -> None:
        graph, self._graph = self._graph, None
        self.__dict__.pop("replay", None)
        if graph is not None:
            self._backend.before_reset(self.device)
            graph.reset()
            self._release()
        self._bytes = None

    def _release(self) -> None:
        if self._handle is not None:
            self._backend.pools.released(self._handle)
        self._handle = self._torch_id = None

    def __del__(self) -> None:
        # Pool bookkeeping only; torch's destructor frees the executable (and syncs on ROCm).
        if self._graph is not None and not sys.is_finalizing():
            try:
                self._release()
            except Exception:
                pass

    def enable_debug_mode(self) -> None:
        self._debug = True
        if self._graph is not None:
            self._graph.enable_debug_mode()

    def debug_dump(self, path: str) -> None:
        if self._debug or self.keep_graph:
            self._backend.dump_graph(self._graph, path)
            return
        # torch keeps nothing to dump unless debug mode was on before capture: say so in a DOT
        # file rather than leave a missing file behind torch's warning.
        warnings.warn(
            f"debug_dump on {self.device}: call enable_debug_mode() before capture to get the "
            f"kernel graph; wrote a placeholder to {path}",
            stacklevel=3,
        )
        with open(path, "w", encoding="utf-8") as f:
            f.write(
                f'digraph accel_graph {{\n  label="{self.device}: captured, debug mode was off; '
                f'memory_bytes={self._bytes}";\n}}\n'
            )

    def memory_bytes(self) -> int | None:
        return self._bytes


class NativeGraphBackend(Backend):
    """Base of the backends built on a torch graph class (cuda, hip, xpu).

    A subclass sets the class attributes below and overrides the mechanism hooks where its
    vendor differs; the base's defaults are ``torch.cuda.CUDAGraph``'s behaviour. Everything
    else here is policy, which subclasses do not override: it is what makes the three backends
    behave the same (refusals, messages, bookkeeping).

    ``pools`` (a :class:`~.native_pools.NativePoolTable`) holds the pool bookkeeping; the
    :class:`Backend` pool methods delegate to it.
    """

    #: ``torch.<module_name>`` is the vendor module: ``"cuda"`` (also on ROCm) or ``"xpu"``.
    module_name: ClassVar[str] = "cuda"
    #: The vendor's own default capture mode, used for ``capture_error_mode="default"``.
    vendor_default_mode: ClassVar[str] = "global"
    #: Why ``torch.<module_name>.is_available()`` may be False here, for the probe's reason.
    no_device_reason: ClassVar[str] = "no visible device"

    def __init__(self) -> None:
        self.pools = NativePoolTable(self.name, lambda: self.module)
        self._lock = threading.Lock()  # guards the per-device caches below
        self._specs: dict[int, DeviceSpec] = {}
        self._streams: dict[int, Any] = {}
        # thread id -> the capture it began; weak, so a dropped Graph does not block the thread
        self._capturing: weakref.WeakValueDictionary[int, NativeGraphImpl] = (
            weakref.WeakValueDictionary()
        )

    @property
    def module(self) -> Any:
        """``torch.cuda`` or ``torch.xpu`` (looked up per call so tests can substitute fakes)."""
        return getattr(torch, self.module_name)

    # -- policy: probe ---------------------------------------------------------------------
    @classmethod
    def probe(cls) -> str | None:
        """The build check (:meth:`probe_build`), then the vendor module, ``is_available()``
        and ``device_count()`` (:func:`.presence.module_reason`: a raising driver is a reason),
        then the graph class (:meth:`probe_graph_class`). Never initialises a device."""
        reason = cls.probe_build()
        if reason is not None:
            return reason
        mod = getattr(torch, cls.module_name, None)
        reason = presence.module_reason(cls.module_name, mod, cls.no_device_reason)
        if reason is not None:
            return reason
        return cls.probe_graph_class(mod)

    # -- mechanism hooks: a subclass overrides these where its vendor differs ---------------
    @classmethod
    def probe_build(cls) -> str | None:
        """Why this torch build is not one this backend serves (None: it is). Called first by
        :meth:`probe`; must be cheap and must not raise (cuda refuses ROCm builds here)."""
        return None

    @classmethod
    def probe_graph_class(cls, module: Any) -> str | None:
        """Why ``module`` (the vendor module, available) offers no graph class (None: it does).
        Must not construct a graph or touch a device."""
        if hasattr(module, "CUDAGraph"):
            return None
        return f"torch.{cls.module_name}.CUDAGraph is missing from this torch build"

    def capabilities(self) -> Capabilities:
        """Static capabilities; torch.cuda.CUDAGraph's by default."""
        return CUDA_GRAPH_CAPABILITIES

    def device_arch(self, index: int) -> str | None:
        """The arch string for ``DeviceSpec.arch`` of device ``index`` (``"sm_90"``,
        ``"gfx942"``), None when unknown. Called once per device; may start the runtime."""
        return None

    def check_device_usable(self, spec: DeviceSpec) -> None:
        """Called by ``new_graph`` before a graph is made on ``spec``: raise
        ``BackendUnavailable`` if graphs cannot run there (cuda: arch verdict), or warn."""

    def new_torch_graph(self, keep_graph: bool, torch_id: tuple[int, int] | None, mode: str) -> Any:
        """A fresh torch graph object for one capture. ``torch_id`` is the torch pool id the
        capture goes into (None: torch picks), ``mode`` the vendor capture mode. A
        ``RuntimeError`` becomes ``CaptureError``."""
        return self.module.CUDAGraph(keep_graph)

    def begin_capture(self, graph: Any, torch_id: tuple[int, int] | None, mode: str) -> None:
        """Start capture on ``graph`` (from :meth:`new_torch_graph`) into ``torch_id`` with
        ``mode``, passing whichever keywords this torch accepts. A ``RuntimeError`` becomes
        ``CaptureError`` with a hint; the pool entry is forgotten either way."""
        params = begin_params(graph)
        kwargs: dict[str, Any] = {}
        if "pool" in params:
            kwargs["pool"] = torch_id
        if "capture_error_mode" in params:
            kwargs["capture_error_mode"] = mode
        graph.capture_begin(**kwargs)

    def control_flow_support(self) -> cf_support.ControlFlowSupport:
        """What this backend captures of torch.cond / torch.while_loop / torch.switch
        (feature-detected by API on each call; :mod:`.native_cf_support`). Must not raise."""
        return cf_support.detect_support(self.name, self.module_name, self.module)

    def control_flow_warmup(self, device: DeviceSpec) -> AbstractContextManager[Any]:
        """A context for the eager warm-up before a capture with torch.cond: both branches
        are captured once into a throwaway graph, so the branch not taken by the warm-up has
        its first-use setup outside the real capture. A no-op where nothing is captured natively."""
        return control_flow.warmup(self.control_flow_support(), self.module, device)

    def before_reset(self, device: DeviceSpec) -> None:  # noqa: B027 - hip overrides
        """Called just before ``reset()`` drops a graph executable on ``device`` (hip
        synchronizes here). May run inside another capture: must not synchronize then."""

    def dump_graph(self, graph: Any, path: str) -> None:
        """Write torch's DOT dump of ``graph`` to ``path``."""
        graph.debug_dump(path)

    def describe(self) -> Iterator[tuple[str, str]]:
        """Doctor facts: torch, the vendor module, the device count. Subclasses add theirs
        after ``yield from super().describe()``. Must not raise."""
        facts = [("torch", torch.__version__), ("torch module", f"torch.{self.module_name}")]
        try:
            facts.append(("device_count", str(self.module.device_count())))
        except Exception as exc:
            facts.append(("device_count", f"unknown ({exc})"))
        facts.append(("control flow", cf_support.summary(self.control_flow_support())))
        return iter(facts)

    # -- policy: capture (called by NativeGraphImpl) ------------------------------------------
    def refuse_nested(self, device: DeviceSpec) -> None:
        """Raise ``CaptureError`` when this thread or the current stream is already capturing.

        Checked before anything touches the device: the synchronize of ``prepare_capture``
        inside a capture would invalidate the outer capture, and torch's own error comes only
        after that damage."""
        outer = self._capturing.get(threading.get_ident())
        if outer is None and not self.is_current_stream_capturing(device):
            return
        where = f"a graph on {outer.device}" if outer is not None else "the current stream"
        raise CaptureError(
            f"cannot begin a capture on {device}: a capture is already underway ({where}); "
            f"device graphs do not nest, so end the outer capture first (capture_end() or leave "
            f"its `with accel_graph.graph(...)` block)"
        )

    def capture_started(self, impl: NativeGraphImpl) -> None:
        """``impl`` began capturing on this thread."""
        self._capturing[threading.get_ident()] = impl

    def capture_stopped(self, impl: NativeGraphImpl) -> None:
        """``impl``'s capture ended or was aborted."""
        # capture_end may run on another thread than capture_begin: find the entry by impl.
        for tid, active in list(self._capturing.items()):
            if active is impl:
                self._capturing.pop(tid, None)

    def vendor_mode(self, mode: str) -> str:
        """Map our ``capture_error_mode`` onto the vendor's, warning where it is ignored."""
        honoured = self.capabilities().capture_error_modes
        if mode not in honoured:
            warnings.warn(
                f"the {self.name} backend honours only capture_error_mode "
                f"{', '.join(map(repr, honoured))}; {mode!r} is ignored",
                stacklevel=4,
            )
            mode = "default"
        return self.vendor_default_mode if mode == "default" else mode

    def check_current_device(self, spec: DeviceSpec) -> None:
        """Raise ``CaptureError`` unless ``spec`` is the current device (torch captures there)."""
        current = int(self.module.current_device())
        if current != spec.index:
            raise CaptureError(
                f"capture_begin for a graph on {spec}, but the current device is "
                f"{spec.device_type}:{current}; capture with `with accel_graph.graph(g): ...` "
                f"(it switches to the graph's device) or make {spec.device_type}:{spec.index} current"
            )

    # -- the Backend contract ----------------------------------------------------------------
    def device_spec(self, device: torch.device) -> DeviceSpec:
        mod = self.module
        if device.type not in self.device_types:
            raise BackendUnavailable(
                f"the {self.name} backend serves {', '.join(self.device_types)} devices, not {device}"
            )
        # Reading the arch starts the device runtime (torch's get_device_capability does);
        # a Graph on this device would start it anyway.
        index = device.index if device.index is not None else int(mod.current_device())
        spec = self._specs.get(index)
        if spec is not None:
            return spec
        count = int(mod.device_count())
        if not 0 <= index < count:
            have = ", ".join(f"{device.type}:{i}" for i in range(count)) or "none"
            raise BackendUnavailable(
                f"device {device.type}:{index} does not exist: this host has {count} "
                f"{device.type} device(s) ({have}); pass one of those"
            )
        spec = self._specs[index] = DeviceSpec(self.name, device.type, index, self.device_arch(index))
        return spec

    def new_graph(self, device: DeviceSpec, *, keep_graph: bool, **options: Any) -> GraphImpl:
        compile_ = options.pop("compile", None)
        options.pop("compile_options", None)  # only with compile=, which is ignored here (below)
        if options:
            raise ConfigError(f"unknown options for the {self.name} backend: {', '.join(options)}")
        if compile_ is not None:
            warnings.warn(
                f"compile={compile_!r} is ignored on the {self.name} backend: its graphs are "
                f"already launch-free",
                stacklevel=3,
            )
        self.check_device_usable(device)
        return NativeGraphImpl(self, device, keep_graph=keep_graph)

    def graph_pool_handle(self, device: DeviceSpec) -> PoolHandle:
        return self.pools.new_handle(device)

    def resolve_pool(self, pool: object, device: DeviceSpec) -> PoolHandle:
        return self.pools.resolve(pool, device)

    def pool_stats(self, pool: PoolHandle) -> PoolStats | None:
        return self.pools.stats(pool)

    def synchronize(self, device: DeviceSpec) -> None:
        self.module.synchronize(device.index)

    def current_stream(self, device: DeviceSpec) -> Any:
        return self.module.current_stream(device.index)

    def capture_stream(self, device: DeviceSpec) -> Any:
        # One side stream per device, like torch.cuda.graph's class-level stream: capture on the
        # default stream is illegal on CUDA, and sharing a pool across captures wants one stream.
        with self._lock:
            s = self._streams.get(device.index)  # type: ignore[arg-type]
            if s is None:
                s = self._streams[device.index] = self.module.Stream(device=device.index)  # type: ignore[index]
            return s

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return self.module.stream(stream)

    def is_current_stream_capturing(self, device: DeviceSpec) -> bool:
        return self._capturing_on(device.index)

    def is_capturing(self, device: torch.device) -> bool:
        # No DeviceSpec: building one reads the arch, which would start the runtime.
        return self._capturing_on(device.index)

    def _capturing_on(self, index: int | None) -> bool:
        mod = self.module
        if hasattr(mod, "is_initialized") and not mod.is_initialized():
            return False  # nothing can be capturing before the runtime starts; don't start it
        if index is not None and int(mod.current_device()) != index:
            with mod.device(index):
                return bool(mod.is_current_stream_capturing())
        return bool(mod.is_current_stream_capturing())

    def prepare_capture(self, device: DeviceSpec) -> None:
        self.refuse_nested(device)
        mod = self.module
        mod.synchronize(device.index)
        config = getattr(getattr(torch, "compiler", None), "config", None)
        if getattr(config, "force_cudagraph_gc", False):
            gc.collect()  # torch does this only on request: it is expensive per capture
        mod.empty_cache()
        host = getattr(torch._C, "_host_emptyCache", None) if self.module_name == "cuda" else None
        if host is not None:
            host()  # as torch.cuda.graph does: pinned host blocks cached before capture
