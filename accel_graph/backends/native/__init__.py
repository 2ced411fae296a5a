"""The native family: backends that drive a torch graph class (CUDA, HIP, XPU).

:class:`~.backend.NativeGraphBackend` owns the policy (probe order, nested-capture refusal, the
current-device check) and the vendor modules (``backends/cuda.py``, ``hip.py``, ``xpu.py``) fill
its mechanism hooks. Beside it: pool bookkeeping (:mod:`.pools`), torch's capture errors told as
``CaptureError`` (:mod:`.capture_errors`), and ``torch.cond`` as conditional nodes
(:mod:`.control_flow`, feature detection and refusals in :mod:`.control_flow_support`).

A third-party device subclasses ``accel_graph.backends.native.NativeGraphBackend``; the names are
resolved on first access so importing this package imports no torch graph machinery.
"""

from ...foundation.lazy import lazy_exports

_LAZY: dict[str, str] = {
    "NativeGraphBackend": ".backend",
    "NativeGraphImpl": ".graph_impl",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["NativeGraphBackend", "NativeGraphImpl"]
