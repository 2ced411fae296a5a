"""torch's errors around a native capture, as :class:`CaptureError`: the raw stream-capture
refusals of ops inside it, and failures of ``capture_begin`` / ``capture_end`` themselves.

An op that real stream capture forbids (a host sync such as ``.item()``, ``bool(t)``,
``nonzero``, a pageable copy, ``synchronize``) makes the CUDA/HIP runtime refuse it, and torch
raises a bare ``torch.AcceleratorError`` (a ``RuntimeError``) saying "operation not permitted
when stream is capturing"; every later op of that capture then fails with "operation failed due
to a previous error during capture". The recorder raises a :class:`CaptureError` naming the op
for the same code, and the conformance suite holds every backend to that (verified on an H200,
torch 2.11, docs/device-results.md). :class:`.control_flow.ControlFlowMode` sees every
op of a native capture, so it turns these errors into a ``CaptureError`` that names the op and
says what to do, chained to torch's error; errors of any other kind pass through untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ...errors import AccelGraphError, CaptureError

__all__ = [
    "CAPTURE_ERROR_MARKERS", "as_capture_error", "begin_failed", "end_capture_quietly", "end_failed",
]

#: Substrings of the CUDA and HIP runtime errors that mean "refused because a stream captures".
CAPTURE_ERROR_MARKERS = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCapture",
    "hipErrorStreamCapture",
    "operation failed due to a previous error during capture",
    "during CUDA graph capture",
)

_FIX = (
    "device graphs cannot run host syncs (.item(), bool(t), .tolist(), .cpu(), nonzero, "
    "boolean masks, pageable copies, synchronize) or anything else the runtime refuses while a "
    "stream captures. Keep values on the device (torch.where, masks, clamp), branch with "
    "torch.cond, run `accel_graph.check_capturable(fn, *args)` to list every such op with its "
    "source line, or capture with the recorder (device='cpu')"
)


def as_capture_error(func: Any, device: object, exc: BaseException) -> CaptureError | None:
    """The :class:`CaptureError` for ``exc`` raised by ``func`` inside a native capture on
    ``device``, or None when ``exc`` is not a stream-capture refusal (it then propagates as is)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, AccelGraphError):
        return None
    text = str(exc)
    if not any(marker in text for marker in CAPTURE_ERROR_MARKERS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "previous error" in text:
        what = (f"{func} failed because an earlier op of this capture on {device} was refused "
                f"(torch: {first}); the capture is ruined: find the first refused op. ")
    else:
        what = f"{func} is not allowed while {device} captures a graph (torch: {first}): "
    return CaptureError(what + _FIX)


def end_capture_quietly(backend: Any, stream: Any, graph: Any) -> None:
    """End ``graph``'s stream capture while dropping it, never raising.

    torch's ``capture_end`` refuses any stream but the one the capture began on, and a stream
    left capturing makes every later op on the device fail with the refusal above (seen on an
    H200: one dropped capture failed the rest of the conformance run). So the end runs with
    ``stream`` current, which an abort from elsewhere (``reset()`` after the ``with`` block
    left the stream, another thread) would not have; the capture may already have ended."""
    try:
        with backend.stream_context(stream) if stream is not None else contextlib.nullcontext():
            graph.capture_end()
    except Exception:
        pass


def _begin_hint(exc: BaseException) -> str:
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


def begin_failed(device: object, exc: BaseException) -> CaptureError:
    """The error for torch's ``RuntimeError`` ``exc`` from ``capture_begin`` on ``device``, with
    what to do about it."""
    return CaptureError(f"capture_begin on {device} failed: {exc}. {_begin_hint(exc)}")


def end_failed(device: object, exc: BaseException) -> CaptureError:
    """The error for torch's ``RuntimeError`` ``exc`` from ``capture_end`` on ``device``, with
    its typical causes."""
    return CaptureError(
        f"capture_end on {device} failed: {exc}. Typical causes: a host sync, "
        f"data-dependent shapes or unjoined side-stream work inside the capture; "
        f"run it under the recorder backend (device='cpu') to find the op"
    )
