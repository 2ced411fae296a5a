"""The recorder's dispatch mode: the mode that routes a capturing thread's ops to its capture,
and the guard that takes the mode off a thread that exits with its capture open (reading the
stack and taking a mode off it wherever it sits: :mod:`~accel_graph.backends.capture_common.dispatch_stack`)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import CaptureError
from ..capture_common.dispatch_stack import remove_mode

__all__ = ["RecordingMode", "ThreadExitGuard"]


class ThreadExitGuard:
    """Held in the capturing thread's thread-local storage for the length of a capture.

    A thread that exits with its capture still open would leave the recording mode on its torch
    dispatch stack; torch's C++ thread-local destructor then releases that Python object after
    the interpreter let go of the thread, which can abort the process ("terminate called
    without an active exception"). Python clears a dying thread's thread-local storage on that
    thread, with the GIL, before the C++ destructors run: this object's finaliser runs then and
    takes the mode off the stack. The capture is invalidated (it cannot be ended by its thread
    any more): ``capture_end()`` from another thread reports why, and ``reset()`` from any
    thread drops it, after which the graph captures again.
    """

    __slots__ = ("capture",)

    def __init__(self, capture: Any) -> None:
        self.capture = weakref.ref(capture)

    def __del__(self) -> None:
        cap = self.capture()
        # By identifier: at thread exit threading.current_thread() is no longer that thread.
        if cap is None or cap.thread is None or cap.thread.ident != threading.get_ident():
            return  # already gone
        try:
            if cap.over is None:
                cap.invalidate("thread exit", CaptureError(
                    f"thread {cap.thread.name!r} exited with its capture still open (capture_end() "
                    f"was never called on it); the capture recorded nothing usable. Call reset() "
                    f"and capture again, ending the capture on the thread that began it"))
            remove_mode(cap.mode)
        except Exception:  # a finaliser must not raise; the mode is what matters
            pass


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class RecordingMode(TorchDispatchMode):
    """Routes every aten op of the capturing thread to its :class:`Capture`."""

    def __init__(self, capture: Any) -> None:
        super().__init__()
        #: The :class:`~.capture.Capture` (None once its graph let go of it).
        self.capture: Any = capture

    @property
    def finished(self) -> bool:
        """Whether this mode's capture is over (the mode then only passes ops through)."""
        cap = self.capture
        return cap is None or cap.over is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        cap = self.capture
        if cap is None or cap.over is not None:
            # The capture is over but torch keeps the mode on the stack until the recorder
            # next runs on this thread: run the op eagerly, exactly as with no mode.
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if torch.is_inference_mode_enabled() and func.has_kernel_for_dispatch_key(_COMPOSITE):
            # Under inference mode the autograd keys are excluded, so composite ops (linear,
            # adaptive_avg_pool2d) reach the mode whole; eager runs their decomposition, and a
            # whole op's .out kernel may compute differently (adaptive_avg_pool2d.out to 1x1 is
            # not the functional's mean: 9e-8 off). Record the decomposition, as eager runs it.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        with cap.lock:
            if cap.over is not None:  # ended from another thread (relaxed) since the check
                return func(*args, **kwargs)
            try:
                return cap.handle(func, args, kwargs)
            except CaptureError as exc:
                cap.invalidate(func, exc)
                raise


# TorchDispatchMode.__init_subclass__ wraps __torch_dispatch__ in torch._disable_dynamo, whose
# first call imports torch._dynamo (seconds) and which adds a frame to every recorded op.
# Capture refuses to run inside a compiled frame, so the wrapper protects nothing here.
RecordingMode.__torch_dispatch__ = getattr(  # type: ignore[method-assign]
    RecordingMode.__torch_dispatch__, "__wrapped__", RecordingMode.__torch_dispatch__
)
