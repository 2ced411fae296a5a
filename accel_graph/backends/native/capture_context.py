"""Where and whether a native capture runs: the policy :class:`NativeCaptureContext` adds to
every native backend (a mix-in of :class:`~.backend.NativeGraphBackend`, not used alone).

- who is capturing: the table of captures by thread, the refusal of a nested capture (checked
  before anything touches the device), ``is_current_stream_capturing`` without starting the
  device runtime;
- where: the current-device check, one capture side stream per device, the stream context;
- before a capture: synchronize, the optional ``gc``, torch's cache release (host too).

Everything vendor-specific goes through ``self.module`` (``torch.cuda`` or ``torch.xpu``, which
the backend looks up per call).
"""

from __future__ import annotations

import gc
import threading
import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch

from ...errors import CaptureError
from ..base import DeviceSpec, GraphImpl

__all__ = ["NativeCaptureContext"]


class NativeCaptureContext:
    """The capture table, streams and pre-capture cleanup of a native backend.

    Needs of the class it is mixed into: ``module`` (the vendor module) and ``module_name``.
    Holds ``_capturing`` (thread id -> the impl capturing there, weak), ``_streams`` (device
    index -> side stream) and ``_lock`` (guards ``_streams``)."""

    module: Any
    module_name: str

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the per-device caches
        self._streams: dict[int, Any] = {}
        # thread id -> the capture it began; weak, so a dropped Graph does not block the thread
        self._capturing: weakref.WeakValueDictionary[int, GraphImpl] = (
            weakref.WeakValueDictionary()
        )

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

    def capture_started(self, impl: GraphImpl) -> None:
        """``impl`` began capturing on this thread."""
        self._capturing[threading.get_ident()] = impl

    def capture_stopped(self, impl: GraphImpl) -> None:
        """``impl``'s capture ended or was aborted."""
        # capture_end may run on another thread than capture_begin: find the entry by impl.
        for tid, active in list(self._capturing.items()):
            if active is impl:
                self._capturing.pop(tid, None)

    def check_current_device(self, spec: DeviceSpec) -> None:
        """Raise ``CaptureError`` unless ``spec`` is the current device (torch captures there)."""
        current = int(self.module.current_device())
        if current != spec.index:
            raise CaptureError(
                f"capture_begin for a graph on {spec}, but the current device is "
                f"{spec.device_type}:{current}; capture with `with accel_graph.graph(g): ...` "
                f"(it switches to the graph's device) or make {spec.device_type}:{spec.index} current"
            )

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
