"""One caller at a time: how ``GraphRunner`` stays correct when threads share it.

A runner's call copies the batch into static inputs, replays a graph that writes static
outputs, and (by default) returns views of those outputs. Two calls running at once overwrite
each other's inputs and outputs; a lazy capture racing a call sees half-built state. Left
alone, that is a silent wrong result (another call's outputs) or a raw exception.

:class:`CallGuard` makes the rule enforceable:

- Every call (and ``capture()``) holds one lock for its whole length, so calls never overlap:
  a second thread waits for the first to finish.
- With ``copy_outputs=True`` each caller gets a copy made inside the lock, so no later call can
  overwrite what a caller holds: threads may share the runner freely (serialised).
- With ``copy_outputs=False`` (views of static memory, valid until the next call) a runner
  serves one thread: the first thread that calls it. A call from another thread, while that one
  is alive, raises :class:`~accel_graph.errors.AccelGraphError` saying what to do, because the
  first thread's views would be overwritten behind its back however the calls are ordered.
- A call from inside a call on the same thread (``fn`` calling its own runner) raises too,
  instead of deadlocking.

Cost: one uncontended lock acquire and release and a thread lookup per call
(``tools/bench_runner_threads.py`` measures it at batch 1).
"""

from __future__ import annotations

import threading

from ..errors import AccelGraphError

__all__ = ["CallGuard"]


class CallGuard:
    """The lock and thread bookkeeping of one runner (see the module docstring)."""

    __slots__ = ("_bound", "_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Ident of the thread inside a call now (None between calls).
        self._owner: int | None = None
        #: The thread a ``copy_outputs=False`` runner serves (its first caller).
        self._bound: threading.Thread | None = None

    def enter(self, shared_outputs: bool, what: str = "a call") -> None:
        """Start ``what`` on this thread: wait for a call of another thread to finish, then
        check the thread may use the runner. ``shared_outputs``: outputs are views of static
        memory (``copy_outputs=False``). Raises AccelGraphError (nothing held then)."""
        me = threading.get_ident()
        if self._owner == me:
            raise AccelGraphError(
                f"GraphRunner: {what} from inside a call of the same runner on this thread (does "
                f"fn call its own runner?). A runner's call replays into static memory its outer "
                f"call is using: call fn directly there"
            )
        self._lock.acquire()
        if shared_outputs:
            # By Thread object, not ident: a dead thread's ident is reused by the next thread
            # the OS starts, which would then be taken for the served one (found by the fuzz
            # test: two threads served at once, one reading the other's outputs).
            bound = self._bound
            here = threading.current_thread()
            if bound is not None and bound is not here and bound.is_alive():
                self._lock.release()
                raise AccelGraphError(
                    f"GraphRunner called from thread {here.name!r} while it serves thread "
                    f"{bound.name!r}: with copy_outputs=False each call returns views of static "
                    f"memory that the next call overwrites, so a second thread would overwrite "
                    f"the first one's results. Pass copy_outputs=True (or set runner.copy_outputs "
                    f"= True) to share the runner between threads (calls are then serialised and "
                    f"each caller gets its own copy), or call it from one thread only"
                )
            self._bound = here
        self._owner = me

    def exit(self) -> None:
        """End the call begun by :meth:`enter` on this thread."""
        self._owner = None
        self._lock.release()
