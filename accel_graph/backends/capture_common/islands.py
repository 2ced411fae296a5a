"""Eager islands: what the island API (:mod:`accel_graph.graphs.islands`) and a capturing
backend both need to know, so neither imports the other.

An island is a callable that runs eagerly between the captured pieces of a graph
(``accel_graph.eager_island``). The API wraps the callable; a backend's capture says how it
runs an island inside that capture by installing a *runner* on the capturing thread for the
length of the capture. The wrapper asks :func:`capture_runner` on every call:

* None (no capture on this thread, or already inside an island): a plain call, nothing else;
* a runner: ``runner(info, fn, args, kwargs)`` runs the island inside the capture and returns
  what the caller gets (the recorder: static pool buffers holding the island's outputs).

While an island runs (at capture or at replay) :func:`running` is true on its thread: nested
islands are plain calls, and the capture's interceptions (host reads, generator state) let the
island's own work through, since it runs eagerly with real values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MARK", "IslandInfo", "Runner", "capture_runner", "clear_runner", "describe_callable",
    "enter_island", "leave_island", "refusal", "refused", "running", "running_island", "set_runner",
]

#: The attribute naming an island: a wrapper function, or the ``forward`` of a marked module,
#: carries the :class:`IslandInfo` under this name.
MARK = "__accel_graph_island__"

_tls = threading.local()


@dataclass(frozen=True)
class IslandInfo:
    """What errors and dumps say about an island: its qualified name and the source line that
    defines it (``file:line``)."""

    name: str
    source: str

    def __str__(self) -> str:
        return f"{self.name} ({self.source})"


#: ``runner(info, fn, args, kwargs)``: run island ``fn(*args, **kwargs)`` inside the capture
#: underway on this thread and return what the caller gets.
Runner = Callable[[IslandInfo, Callable[..., Any], tuple, dict], Any]


def set_runner(runner: Runner) -> Runner:
    """Install ``runner`` for the capture beginning on this thread; returns it as the token for
    :func:`clear_runner`."""
    _tls.runner = runner
    return runner


def clear_runner(token: Runner) -> None:
    """Remove the runner ``token`` from this thread (a no-op if another one is installed, or on
    another thread: a runner checks itself whether its capture is still underway)."""
    if getattr(_tls, "runner", None) is token:
        _tls.runner = None


def capture_runner() -> Runner | None:
    """The runner of the capture underway on this thread; None outside a capture and inside an
    island (a nested island is a plain call)."""
    runner = getattr(_tls, "runner", None)
    if runner is None or getattr(_tls, "depth", 0):
        return None
    return runner


def running() -> bool:
    """Whether an island is running on this thread now (its work is eager, never recorded)."""
    return bool(getattr(_tls, "depth", 0))


@contextmanager
def running_island() -> Iterator[None]:
    """Mark the block as an island's eager run on this thread (nestable)."""
    enter_island()
    try:
        yield
    finally:
        leave_island()


def enter_island() -> None:
    """An island starts running on this thread (pair with :func:`leave_island` in a
    ``finally``; the two calls are what replay pays, cheaper than a context manager)."""
    _tls.depth = getattr(_tls, "depth", 0) + 1


def leave_island() -> None:
    """The island that :func:`enter_island` announced is done."""
    _tls.depth -= 1


@contextmanager
def refused(reason: str) -> Iterator[None]:
    """Within the block, a capture on this thread refuses islands (a runner raises
    ``CaptureError`` with ``reason``): used where replay cannot honour an island
    (``make_graphed_callables``, whose graphs replay inside an ``autograd.Function``)."""
    previous = getattr(_tls, "refusal", None)
    _tls.refusal = reason
    try:
        yield
    finally:
        _tls.refusal = previous


def refusal() -> str | None:
    """Why islands are refused on this thread now (:func:`refused`), or None."""
    return getattr(_tls, "refusal", None)


def check_not_refused(info: object, where: str, during: str) -> None:
    """Raise ``CaptureError`` when islands are refused on this thread (:func:`refused`), in the
    words every backend uses: island ``info`` called at ``where`` ``during`` what (``"a capture
    on cuda:0"``, ``"a memory plan on cpu"``)."""
    reason = refusal()
    if reason is not None:
        from ...errors import CaptureError

        raise CaptureError(f"eager island {info} called (at {where}) during {during} that "
                           f"cannot take islands: {reason}")


def describe_callable(fn: Any, name: str | None = None) -> IslandInfo:
    """The :class:`IslandInfo` of ``fn``: its qualified name and the line of its definition
    (``__wrapped__`` chains are followed; a callable object is described by its ``__call__``)."""
    target = fn
    for _ in range(32):  # a bounded walk: a __wrapped__ cycle must not hang
        inner = getattr(target, "__wrapped__", None)
        if inner is None:
            break
        target = inner
    code = getattr(target, "__code__", None)
    if code is None:
        # A callable object: the __call__ its class defines or inherits.
        call = next((k.__dict__["__call__"] for k in type(target).__mro__ if "__call__" in k.__dict__), None)
        code = getattr(call, "__code__", None)
    source = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "<unknown source>"
    if name is None:
        name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return IslandInfo(name, source)
