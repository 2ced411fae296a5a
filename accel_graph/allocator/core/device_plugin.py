"""Our caching allocator behind torch's ``CUDAPluggableAllocator`` (CUDA and ROCm builds).

Two routes, as torch offers them (torch-internals §3):

* **Backing allocator of a MemPool** (:meth:`DeviceAllocator.mem_pool`): torch keeps its own
  caching and its graph-pool logic on top and asks us for whole segments. This is the route
  when graphs are captured, and it works at any time, before or after CUDA initialised.
* **Whole-process allocator** (:func:`install_process_allocator`): every CUDA allocation of the
  process goes through our engine. torch allows the swap only before CUDA initialises, so it is
  refused with :class:`AllocatorStateError` afterwards. torch's graph-pool hooks for pluggable
  allocators (``set_begin_allocate_to_pool`` and friends) are C++-only, so while the swap is
  active a capture on cuda/hip through :class:`accel_graph.Graph` is refused with a
  :class:`~accel_graph.CaptureError` (the cuda and hip backends are re-registered with a guard).
  torch's own ``memory_stats``/``memory_allocated`` raise after such a swap; ours stay available
  (:meth:`DeviceAllocator.memory_stats`, :meth:`DeviceAllocator.snapshot`, :func:`memory_stats`).

The C side is the cffi-built core (``accel_graph.allocator.core._core``); torch loads that same shared
object with ``ctypes.CDLL`` and looks up two exported symbols with the exact ABI of
``CUDAPluggableAllocator``::

    void *ag_pluggable_alloc(size_t size, int device, cudaStream_t stream);
    void  ag_pluggable_free(void *ptr, size_t size, int device, cudaStream_t stream);

plus, through cffi, the control functions in :data:`CONTROL_SYMBOLS` (bind one engine per device,
make an engine thread-safe, read the failures the ABI cannot return). Where the built core lacks
any of them, every entry point here raises :class:`~accel_graph.BackendUnavailable` naming the
library and the missing symbols.

XPU's pluggable ABI takes a ``sycl::queue*`` and is out of scope.

The shared object's checks and torch's pluggable-allocator pieces (feature-detected) are
:mod:`.plugin_runtime`'s; the ones callers use are re-exported here.

On a CPU-only machine none of this can run: the tests drive it against FAKE ``torch.cuda.memory``
pieces (plumbing only); ``tools/device_check.py`` runs it on a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from ...errors import (
    AllocatorStateError,
    BackendUnavailable,
    CaptureError,
    ConfigError,
)
from ..devices import runtime_device_kind
from .device_settings import device_engine_settings
from .engine import Engine
from .loader import load_core
from .plugin_runtime import (
    ALLOC_SYMBOL,
    CONTROL_SYMBOLS,
    FREE_SYMBOL,
    REBUILD,
    check_library,
    control_functions,
    core_path,
    cuda_initialized,
    cuda_memory,
    library_path,
    runtime_kind,
    same_file,
)
from .stats import trace_entries
from .status import check_status

__all__ = [
    "ALLOC_SYMBOL",
    "CONTROL_SYMBOLS",
    "FREE_SYMBOL",
    "AllocatorStateError",
    "DeviceAllocator",
    "check_capture_allowed",
    "check_library",
    "control_functions",
    "install_process_allocator",
    "library_path",
    "memory_stats",
    "process_allocator",
]

log = logging.getLogger("accel_graph")

# ----------------------------------------------------------------------------------------------
# the allocator


class DeviceAllocator:
    """One caching-allocator engine per device, exported to torch as a ``CUDAPluggableAllocator``.

    Args:
        settings: ``None`` (the allocator variables in effect, as torch reads them), a config
            string, :class:`~accel_graph.allocator.alloc_conf.AllocatorSettings` or
            :class:`~accel_graph.allocator.core.settings.EngineSettings`.
        policy: the engine policy (``"native"``: PyTorch's caching allocator, modelled).
        devices: device indices to serve (default: every visible device; counting them does
            not initialise CUDA).
        library: the shared object torch loads; it must be the imported core (the default),
            since the engines are bound inside it. Checked with ctypes before use.
        upstream: ``"device"`` (cudaMalloc/hipMalloc). Other values exist for plumbing tests.

    Creating one loads the library and binds the engines; it does not initialise CUDA.
    Statistics and traces come from our engines, so they keep working after a whole-process
    swap, where torch's ``memory_stats`` raises.
    """

    def __init__(
        self,
        settings: object = None,
        *,
        policy: str = "native",
        devices: list[int] | tuple[int, ...] | None = None,
        library: str | os.PathLike[str] | None = None,
        upstream: str = "device",
    ) -> None:
        self.kind = runtime_kind()
        self.settings = device_engine_settings(settings, self.kind)
        # The core is loaded through this module's load_core (the one the engines are bound
        # in); the path torch loads is that core's file. Same order of checks as ever: a given
        # library is checked before the core loads.
        if library is None:
            core = load_core()
            self.library = check_library(core_path(core))
        else:
            self.library = check_library(os.fspath(library))
            core = load_core()
        if library is not None and not same_file(self.library, core_path(core)):
            raise ConfigError(
                f"library={self.library!r} is not the allocator core this process imported "
                f"({core_path(core)}): torch would call entry points that do not see the engines "
                f"bound here. Omit library= to use the core"
            )
        self._lib = control_functions(core)
        self._ffi = core.ffi
        if devices is None:
            devices = range(int(torch.cuda.device_count()))
        self.devices = tuple(int(d) for d in devices)
        if not self.devices:
            raise BackendUnavailable(
                "no CUDA/ROCm device is visible (torch.cuda.device_count() is 0), so there is "
                "nothing to allocate on; check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES"
            )
        self.engines: dict[int, Engine] = {}
        self._torch_allocator: Any = None
        self._lock = threading.Lock()
        try:
            for d in self.devices:
                eng = Engine(
                    policy, upstream, self.settings,
                    device_name=runtime_device_kind(self.kind).display, device_index=d,
                )  # fmt: skip
                check_status(self._lib.ag_engine_set_threadsafe(eng.c_handle, 1), eng)
                rc = self._lib.ag_pluggable_install(d, eng.c_handle)
                if rc == self._lib.AG_ERR_STATE:
                    eng.close()
                    raise AllocatorStateError(
                        f"{self.kind}:{d} is already served by another DeviceAllocator (one per "
                        f"device per process); reuse that one, or close() it first"
                    )
                check_status(rc, eng)
                self.engines[d] = eng
        except BaseException:
            self._unbind()
            raise
        # Bound engines must outlive every tensor torch allocated from them: keep this object
        # reachable until close(), whatever the caller does with its reference.
        _live.append(self)

    def __repr__(self) -> str:
        return f"DeviceAllocator(kind={self.kind!r}, devices={list(self.devices)}, library={self.library!r})"

    # -- torch side ------------------------------------------------------------------------
    @property
    def torch_allocator(self) -> Any:
        """The ``torch.cuda.memory.CUDAPluggableAllocator`` over our library (built once)."""
        with self._lock:
            if self._torch_allocator is None:
                mem = cuda_memory()
                try:
                    self._torch_allocator = mem.CUDAPluggableAllocator(
                        self.library, ALLOC_SYMBOL, FREE_SYMBOL
                    )
                except OSError as exc:
                    raise BackendUnavailable(
                        f"torch could not load allocator library {self.library!r}: {exc}; {REBUILD}"
                    ) from exc
                except AttributeError as exc:
                    raise BackendUnavailable(
                        f"torch {torch.__version__} cannot use a pluggable allocator here ({exc}); "
                        f"it needs a CUDA or ROCm build of torch"
                    ) from exc
            return self._torch_allocator

    def mem_pool(self, **kwargs: Any) -> Any:
        """A ``torch.cuda.MemPool`` whose segments come from our engine (the capture route).

        ``kwargs`` go to ``MemPool`` (``use_on_oom``, ``no_split`` where this torch has them).
        Use it with ``torch.cuda.use_mem_pool(pool)``, or capture into it with
        ``accel_graph.Graph(pool=pool)`` / ``torch.cuda.graph(g, pool=pool.id)``.
        """
        mempool = getattr(torch.cuda, "MemPool", None)
        if mempool is None:
            raise BackendUnavailable(
                f"torch {torch.__version__} has no torch.cuda.MemPool; upgrade torch (2.6+) or "
                f"use install_process_allocator() before CUDA initialises"
            )
        handle = self.torch_allocator.allocator()
        try:
            return mempool(allocator=handle, **kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"torch.cuda.MemPool on torch {torch.__version__} does not accept "
                f"{', '.join(kwargs) or 'allocator='}: {exc}"
            ) from exc

    # -- our statistics and traces ---------------------------------------------------------
    def engine(self, device: int = 0) -> Engine:
        """The engine serving ``device``."""
        try:
            return self.engines[int(device)]
        except (KeyError, ValueError, TypeError):
            have = ", ".join(map(str, self.devices))
            raise ConfigError(
                f"this allocator serves devices {have}, not {device!r}; pass one of those"
            ) from None

    def memory_stats(self, device: int = 0) -> dict[str, int]:
        """``torch.cuda.memory_stats()``-shaped statistics of our engine on ``device``, plus
        ``accel.pluggable_errors`` (allocations and frees the C entry points refused)."""
        out = self.engine(device).memory_stats()
        out["accel.pluggable_errors"] = int(self._lib.ag_pluggable_errors(int(device)))
        return out

    def last_error(self, device: int = 0) -> str:
        """The last failure of the C entry points on ``device`` ("" when none)."""
        p = self._lib.ag_pluggable_last_error(int(device))
        return "" if p == self._ffi.NULL else self._ffi.string(p).decode(errors="replace")

    def enable_history(self, max_entries: int = 0) -> None:
        """Record allocator events on every device (our ``_record_memory_history``)."""
        for eng in self.engines.values():
            eng.enable_events(max_entries)

    def snapshot(self) -> dict[str, Any]:
        """A ``torch.cuda.memory._snapshot()``-shaped dict from our engines: segments of every
        device, each device's recorded events (drained) as trace entries, and the settings.
        Stream numbers are the engine's per-device stream ids (0: the default stream)."""
        segments: list[dict[str, Any]] = []
        traces: list[list[dict[str, Any]]] = []
        for d in range(max(self.devices) + 1):
            eng = self.engines.get(d)
            if eng is None:
                traces.append([])
                continue
            segments.extend(eng.snapshot())
            traces.append(trace_entries(eng.drain_events(as_list=True)))
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": {"engine_settings": repr(self.settings), "policy": self._policy()},
        }

    def _policy(self) -> str:
        return next(iter(self.engines.values())).policy if self.engines else "native"

    def empty_cache(self, device: int | None = None) -> None:
        """Return our engine's cached free segments to the driver (all devices by default)."""
        for d in self.devices if device is None else (int(device),):
            self.engine(d).empty_cache()

    # -- lifetime ----------------------------------------------------------------------------
    def _unbind(self) -> None:
        for d in list(self.engines):
            try:
                self._lib.ag_pluggable_uninstall(d)
            except Exception:  # pragma: no cover - best effort on a failed construction
                pass
        self.engines.clear()

    def close(self) -> None:
        """Unbind and close the engines. Refused while this is the process allocator, and by
        the C side while any block is still allocated (memory torch may still use)."""
        if _process is self:
            raise AllocatorStateError(
                "this DeviceAllocator is the whole-process CUDA allocator; torch cannot swap it "
                "back, so it lives until the process exits"
            )
        for d, eng in list(self.engines.items()):
            check_status(self._lib.ag_pluggable_uninstall(d), eng)
            eng.close()
            del self.engines[d]
        if self in _live:
            _live.remove(self)


# ----------------------------------------------------------------------------------------------
# the whole-process swap

_process: DeviceAllocator | None = None
_live: list[DeviceAllocator] = []
_swap_lock = threading.Lock()


def process_allocator() -> DeviceAllocator | None:
    """The allocator installed by :func:`install_process_allocator`, or None."""
    return _process


def install_process_allocator(allocator: DeviceAllocator | None = None, **kwargs: Any) -> DeviceAllocator:
    """Make our allocator the whole-process CUDA allocator (``change_current_allocator``).

    Must run before CUDA initialises (before the first CUDA tensor, ``torch.cuda.init()`` or any
    library that touches CUDA). Afterwards it raises :class:`AllocatorStateError` saying so; use
    :meth:`DeviceAllocator.mem_pool` instead, which works at any time. ``kwargs`` build the
    allocator when none is given. While installed, :class:`accel_graph.Graph` refuses to capture
    on cuda/hip (see the module docstring); torch's own ``memory_stats`` stops working, ours
    (:func:`memory_stats`) does not. The swap lasts until the process exits.
    """
    global _process
    with _swap_lock:
        if _process is not None:
            if allocator is None or allocator is _process:
                return _process
            raise AllocatorStateError(
                "a DeviceAllocator is already the whole-process allocator and torch cannot swap "
                "it again; use accel_graph.allocator.core.device_plugin.process_allocator() to reach it"
            )
        mem = cuda_memory()
        if cuda_initialized():
            raise AllocatorStateError(_too_late("CUDA is already initialised in this process"))
        if allocator is None:
            allocator = DeviceAllocator(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an allocator or the arguments to build one, not both")
        try:
            mem.change_current_allocator(allocator.torch_allocator)
        except RuntimeError as exc:
            if "initialized" in str(exc) or "initialised" in str(exc):
                raise AllocatorStateError(_too_late(f"torch refused the swap ({exc})")) from exc
            raise
        _process = allocator
        log.info("accel-graph allocator installed as the whole-process CUDA allocator (%s)", allocator)
        return allocator


def _too_late(why: str) -> str:
    return (
        f"cannot make the accel-graph allocator the whole-process CUDA allocator: {why}, and "
        f"torch can swap its allocator only before that. Call "
        f"accel_graph.allocator.core.device_plugin.install_process_allocator() first thing in the process, "
        f"before any CUDA tensor, torch.cuda.init() or import that touches CUDA; or keep torch's "
        f"allocator and use DeviceAllocator().mem_pool() with torch.cuda.use_mem_pool(), which "
        f"works at any time and also supports graph capture"
    )


def check_capture_allowed(device: object) -> None:
    """Raise :class:`CaptureError` when a capture on ``device`` (a cuda/hip device) would run
    under the whole-process swap: torch's graph-pool hooks for pluggable allocators are C++-only,
    so captured memory could be handed to other work after capture."""
    if _process is None:
        return
    dtype = getattr(device, "device_type", None) or getattr(device, "type", None) or str(device)
    if str(dtype).split(":")[0] != "cuda":
        return
    raise CaptureError(
        f"cannot capture a graph on {device}: the accel-graph allocator is the whole-process CUDA "
        f"allocator, and torch's graph-pool hooks for pluggable allocators "
        f"(set_begin_allocate_to_pool / set_end_allocate_to_pool_fn / set_release_pool) are "
        f"C++-only, so memory freed during capture could be reused by other work while the graph "
        f"still uses it. Keep torch's allocator and capture into DeviceAllocator().mem_pool() "
        f"(accel_graph.Graph(pool=pool)) instead"
    )


def memory_stats(device: int = 0) -> dict[str, Any]:
    """Memory statistics that work either way: ours when the whole-process swap is active
    (torch's raise then), else ``torch.cuda.memory_stats(device)``."""
    if _process is not None:
        return _process.memory_stats(device)
    return dict(torch.cuda.memory_stats(device))


def _reset_for_tests() -> None:
    """Forget the process allocator (FAKE-torch tests only: a real swap cannot be undone)."""
    global _process
    _process = None
