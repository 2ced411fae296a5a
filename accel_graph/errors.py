"""One exception hierarchy for accel-graph.

Every class derives from :class:`AccelGraphError` and, where a caller would already catch a
standard exception for the same failure, from that one too (``ValueError`` for bad arguments,
``torch.OutOfMemoryError``/``MemoryError`` for exhausted memory), so existing ``except`` clauses
keep working. Messages name the device, the state and the next step.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

__all__ = [
    "AccelGraphError",
    "AllocatorStateError",
    "BackendUnavailable",
    "CapacityError",
    "CaptureError",
    "ConfigError",
    "GraphStateError",
    "OutOfMemoryError",
    "PoolError",
    "ReplayError",
    "TraceFormatError",
    "UnsupportedTraceError",
]


class AccelGraphError(RuntimeError):
    """Base class of every error raised by accel-graph."""


class GraphStateError(AccelGraphError):
    """A Graph method was called in a state that does not allow it (replay before capture, ...).

    Raised by :class:`accel_graph.Graph` itself, so the type and the words are the same on every
    backend. The graph is left exactly as it was before the refused call.
    """


class CaptureError(AccelGraphError):
    """Something inside a capture is illegal under real device-graph capture.

    The message names the operation, where it was called from, and what to do instead.
    """


class ReplayError(AccelGraphError):
    """Replay cannot proceed safely (for example an input was resized or re-pointed)."""


class BackendUnavailable(AccelGraphError):
    """The requested backend or device cannot be used here; the message says why."""


class ConfigError(AccelGraphError, ValueError):
    """A bad argument or setting: an unknown capture_error_mode, a malformed config string, ..."""


class PoolError(ConfigError):
    """A pool handle that belongs to no pool, to another device or backend, or to a released pool."""


if TYPE_CHECKING:
    import torch

    class OutOfMemoryError(AccelGraphError, torch.OutOfMemoryError, MemoryError):
        """A pool or allocator could not satisfy a request."""


def _define_out_of_memory_error() -> type:
    # Defined on first use so that importing this module (and the allocator tools that only need
    # the other classes, such as ``accel-alloc``) does not import torch, which takes about 1 s.
    import torch

    class OutOfMemoryError(AccelGraphError, torch.OutOfMemoryError, MemoryError):
        """A pool or allocator could not satisfy a request. Catchable as torch's OOM and
        MemoryError."""

    OutOfMemoryError.__module__ = __name__
    OutOfMemoryError.__qualname__ = "OutOfMemoryError"
    return OutOfMemoryError


_define_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    """``OutOfMemoryError`` is created on first access (it derives from torch's OOM class),
    once: concurrent first accesses get the same class, so every ``except`` matches."""
    if name == "OutOfMemoryError":
        with _define_lock:
            cls = globals().get(name)
            if cls is None:
                cls = _define_out_of_memory_error()
                globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TraceFormatError(AccelGraphError, ValueError):
    """A trace file or object is not a well-formed allocator trace (truncated, corrupt, hostile).

    The message says what is wrong, where, and what to do. Raised before anything in the file
    is executed or trusted.
    """


class UnsupportedTraceError(AccelGraphError, ValueError):
    """A trace or request the allocator simulator cannot model (unknown profile or policy, a
    device with no allocator model, no events)."""


class CapacityError(AccelGraphError, ValueError):
    """A device capacity that cannot hold the trace (``cap`` below the largest single
    allocation)."""


class AllocatorStateError(AccelGraphError):
    """The allocator cannot be swapped in (or out) in the process's current state, for example
    after the device runtime has initialised its own allocator."""
