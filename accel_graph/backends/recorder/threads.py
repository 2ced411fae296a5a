"""The capturing thread's recorder state: which capture is underway on it, and the guard that
ends that capture if the thread exits with it still open.

Kept per thread (``threading.local``) because a capture records only the thread that began it
(its :class:`~.modes.RecordingMode` is a thread-local torch dispatch mode). A recording mode
whose capture is over stays on its thread's dispatch stack until the next recorder call there
(torch pushes a mode back after its handler returns): :func:`active_capture` takes such modes
off first.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ...errors import CaptureError
from ..capture_common.dispatch_stack import mode_stack, remove_mode
from .modes import RecordingMode

__all__ = [
    "ThreadExitGuard", "active_capture", "clear_active_capture", "discard_finished_modes",
    "drop_exit_guard", "hold_exit_guard", "set_active_capture",
]

_tls = threading.local()


def active_capture() -> Any:
    """The capture underway on this thread, if any. Recording modes left on this thread's
    dispatch stack by captures that are over are taken off it first."""
    cap = getattr(_tls, "capture", None)
    if cap is not None and cap.over is not None:
        _tls.capture = cap = None
    if torch._C._len_torch_dispatch_stack():
        discard_finished_modes()
    return cap


def discard_finished_modes() -> None:
    """Take every recording mode whose capture is over off this thread's dispatch stack
    (modes above it keep their order). Such modes only pass ops through; this makes them go."""
    stale = [m for m in mode_stack() if isinstance(m, RecordingMode) and m.finished]
    for mode in stale:
        remove_mode(mode)


def set_active_capture(capture: Any) -> None:
    """Make ``capture`` the one underway on this thread (None: no capture). The caller enters
    or leaves ``capture.mode`` itself."""
    _tls.capture = capture


def clear_active_capture(capture: Any) -> None:
    """``capture`` is no longer underway on this thread (a no-op if another one is)."""
    if getattr(_tls, "capture", None) is capture:
        _tls.capture = None


def hold_exit_guard(capture: Any) -> None:
    """Hold a :class:`ThreadExitGuard` for ``capture`` in this thread's storage."""
    _tls.exit_guard = ThreadExitGuard(capture)


def drop_exit_guard(capture: Any) -> None:
    """Let go of this thread's :class:`ThreadExitGuard` if it is ``capture``'s."""
    guard = getattr(_tls, "exit_guard", None)
    if guard is not None and guard.capture() is capture:
        _tls.exit_guard = None


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
