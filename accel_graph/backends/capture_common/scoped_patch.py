"""Patches that exist only while some capture is underway, counted across threads.

The recorder intercepts a few Python-level APIs the dispatcher never sees (host reads of
tensors, :mod:`.hostreads`; generator state and ``set_flush_denormal``,
:mod:`accel_graph.backends.recorder.rng`). Eager code
must not pay for that, so each interception is installed when the first capture of the process
begins and removed when the last one ends, whichever threads they run on. :class:`ScopedPatch`
is that reference count; the modules supply only how to install and remove their patches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ScopedPatch"]


class ScopedPatch:
    """``install()`` at the first :meth:`acquire`, ``uninstall()`` at the matching last
    :meth:`release`; both run under one lock, so concurrent captures never see a half-done
    patch. ``release()`` without an ``acquire()`` does nothing."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]) -> None:
        self._install, self._uninstall = install, uninstall
        self._lock = threading.Lock()
        self._count = 0

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                self._install()
            self._count += 1

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                return
            self._count -= 1
            if self._count == 0:
                self._uninstall()

    def installed(self) -> bool:
        """Whether some capture holds the patch (it is in place)."""
        return self._count > 0
