"""The recorder's dispatch mode: the mode that routes a capturing thread's ops to its capture
(the thread's state, and the guard that takes the mode off a thread that exits with its capture
open: :mod:`.threads`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import CaptureError

__all__ = ["RecordingMode"]


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
