"""Graph lifecycle hooks: torch 2.14's ``torch.cuda.graphs.register_graph_*_hook``, on every backend.

Six registration functions with torch's names and contract, each returning a
``torch.utils.hooks.RemovableHandle`` (``handle.remove()`` unregisters; the handle is also a
context manager). :class:`accel_graph.Graph` fires them on every backend, the recorder included:

========================================  ==================================================
``register_graph_capture_start_hook(fn)`` ``fn(graph)`` once the capture is underway (inside
                                          it: work the hook issues is captured or recorded)
``register_graph_capture_end_hook(fn)``   ``fn(graph)`` when a capture ends successfully
``register_graph_instantiate_hook(fn)``   ``fn(graph)`` right after each instantiation
                                          (``keep_graph=False``: right after capture end)
``register_graph_replay_start_hook(fn)``  ``fn(graph)`` before every replay is launched (after
                                          an on-demand instantiation)
``register_graph_replay_end_hook(fn)``    ``fn(graph)`` after every replay is launched, also
                                          when the launch raised
``register_graph_destroy_hook(fn)``       ``fn(exec_ids)`` once per capture cycle, when the
                                          graph is ``reset()`` or collected
========================================  ==================================================

``graph`` is the :class:`accel_graph.Graph` (where torch passes its ``CUDAGraph``);
``exec_ids`` is a ``set[int]`` of the :attr:`accel_graph.Graph.exec_id` values the cycle's
instantiations minted (empty when it never instantiated). Hooks of one event run in
registration order; an ``Exception`` a hook raises is swallowed (logged at DEBUG on the
``accel_graph.hooks`` logger) so one consumer cannot break a graph step or another consumer,
as torch's module-level hooks do; ``BaseException`` (``KeyboardInterrupt``) propagates.

One registry, fired once per event: ``accel_graph``'s registrations are never forwarded to
torch's registry. On native CUDA with torch 2.14 torch also fires *its own* hooks (those
registered through ``torch.cuda.graphs``) for the ``CUDAGraph`` objects the backend drives, with
torch's argument; a hook registered here is not among them, so it runs exactly once per event on
every backend, always with the ``accel_graph.Graph``. docs/backends.md "Graph lifecycle hooks"
explains the decision.

Importing this module imports nothing from torch; registering a hook imports
``torch.utils.hooks``.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = [
    "DestroyNotice",
    "GraphEvents",
    "register_graph_capture_end_hook",
    "register_graph_capture_start_hook",
    "register_graph_destroy_hook",
    "register_graph_instantiate_hook",
    "register_graph_replay_end_hook",
    "register_graph_replay_start_hook",
]

# The logger keeps the name it had before the module moved into graphs/ (issue 25): users
# filter on it (docs/backends.md).
_log = logging.getLogger("accel_graph.hooks")

# The graph argument is the accel_graph.Graph firing the event. Typed ``Any`` here: this module
# sits below graphs/graph.py (which imports it to fire the hooks) and must not import it back.
GraphHook = Callable[[Any], None]
DestroyHook = Callable[[set[int]], None]

# The registries, keyed by RemovableHandle id (an OrderedDict: the handle holds it weakly and
# removal must keep the order of the rest). The front end reads them directly and fires only
# when one is non-empty, so an unused hook costs replay one truthiness check.
capture_start_hooks: OrderedDict[int, GraphHook] = OrderedDict()
capture_end_hooks: OrderedDict[int, GraphHook] = OrderedDict()
instantiate_hooks: OrderedDict[int, GraphHook] = OrderedDict()
replay_start_hooks: OrderedDict[int, GraphHook] = OrderedDict()
replay_end_hooks: OrderedDict[int, GraphHook] = OrderedDict()
destroy_hooks: OrderedDict[int, DestroyHook] = OrderedDict()

_exec_ids = itertools.count(1)


def next_exec_id() -> int:
    """A process-unique id for one instantiation of one graph (``Graph.exec_id``)."""
    return next(_exec_ids)


def _register(registry: OrderedDict[int, Any], fn: Any, name: str) -> RemovableHandle:
    if not callable(fn):
        raise TypeError(
            f"{name}(fn) takes a callable, got {type(fn).__name__}; pass a function such as "
            f"`lambda graph: ...`"
        )
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle(registry)
    registry[handle.id] = fn
    return handle


def fire(registry: OrderedDict[int, Any], arg: Any) -> None:
    """Call every hook of ``registry`` with ``arg``, in registration order, swallowing (and
    logging at DEBUG) an ``Exception`` from any of them. A snapshot is iterated, so a hook may
    remove itself or register another (which runs from the next event on)."""
    for fn in list(registry.values()):
        try:
            fn(arg)
        except Exception:
            _log.debug("graph lifecycle hook %r raised; ignored, as torch does", fn, exc_info=True)


class DestroyNotice:
    """One capture cycle of one graph (from construction or ``reset()`` to the next ``reset()``
    or collection): the exec ids its instantiations minted, and the destroy event, fired at most
    once by :meth:`fire`.

    Holds no reference to the graph, so a ``weakref.finalize`` bound to :meth:`fire` does not
    keep the graph alive (torch's ``_RetainedCallbacks`` does the same)."""

    __slots__ = ("exec_ids", "fired")

    def __init__(self) -> None:
        self.exec_ids: set[int] = set()
        self.fired = False

    def fire(self) -> None:
        """Run the destroy hooks with a copy of this cycle's exec ids (the first call only)."""
        if self.fired:
            return
        self.fired = True
        if destroy_hooks:
            fire(destroy_hooks, set(self.exec_ids))


class GraphEvents:
    """The lifecycle-hook state of one :class:`accel_graph.Graph`: the current exec id and the
    capture cycle whose destroy event fires at the next ``reset()`` or when the graph is
    collected (a ``weakref.finalize`` bound to the cycle's :class:`DestroyNotice`, as torch
    arms one per cycle). The graph is passed in, never stored: this object is the graph's own.

    Unlike torch, which arms a graph's destroy callback only if a destroy hook is registered
    when the graph is created or reset, every cycle is armed (one finalizer per graph and
    cycle), so a hook registered later still hears of graphs that already existed."""

    __slots__ = ("exec_id", "cycle", "_finalizer")

    def __init__(self, graph: object) -> None:
        self.exec_id: int | None = None
        self._arm(graph)

    def _arm(self, graph: object) -> None:
        self.cycle = DestroyNotice()
        self._finalizer = weakref.finalize(graph, self.cycle.fire)

    def instantiated(self, graph: object) -> None:
        """``graph`` was just instantiated: mint its exec id, fire the instantiate hooks."""
        self.exec_id = next_exec_id()
        self.cycle.exec_ids.add(self.exec_id)
        if instantiate_hooks:
            fire(instantiate_hooks, graph)

    def reset(self, graph: object) -> None:
        """``graph.reset()`` ran: fire this cycle's destroy event, start the next cycle."""
        self._finalizer.detach()
        self.cycle.fire()
        self.exec_id = None
        self._arm(graph)


def register_graph_capture_start_hook(fn: GraphHook) -> RemovableHandle:
    """Run ``fn(graph)`` with each graph as its capture begins, once it is underway.

    The hook runs inside the capture: device work it issues is captured on native backends, and
    tensor ops it runs are recorded on the recorder. Query state only; prepare before the
    capture. Returns a ``RemovableHandle``; ``.remove()`` unregisters."""
    return _register(capture_start_hooks, fn, "register_graph_capture_start_hook")


def register_graph_capture_end_hook(fn: GraphHook) -> RemovableHandle:
    """Run ``fn(graph)`` with each graph whose capture ended successfully (before the
    instantiate hooks of a ``keep_graph=False`` graph). Returns a ``RemovableHandle``."""
    return _register(capture_end_hooks, fn, "register_graph_capture_end_hook")


def register_graph_instantiate_hook(fn: GraphHook) -> RemovableHandle:
    """Run ``fn(graph)`` right after each instantiation (``graph.exec_id`` is the new
    executable's id). Returns a ``RemovableHandle``."""
    return _register(instantiate_hooks, fn, "register_graph_instantiate_hook")


def register_graph_replay_start_hook(fn: GraphHook) -> RemovableHandle:
    """Run ``fn(graph)`` at the start of every replay, just before it is launched (after an
    on-demand instantiation). Replay is the hot path: keep it cheap. Returns a
    ``RemovableHandle``."""
    return _register(replay_start_hooks, fn, "register_graph_replay_start_hook")


def register_graph_replay_end_hook(fn: GraphHook) -> RemovableHandle:
    """Run ``fn(graph)`` at the end of every replay, once it is launched (native backends:
    enqueued, not finished). Fires even if the launch raised, so every start is balanced by an
    end. Returns a ``RemovableHandle``."""
    return _register(replay_end_hooks, fn, "register_graph_replay_end_hook")


def register_graph_destroy_hook(fn: DestroyHook) -> RemovableHandle:
    """Run ``fn(exec_ids)`` when a graph's capture cycle ends (``reset()``, or the graph is
    collected), with the ``set[int]`` of exec ids that cycle instantiated, so a consumer can
    purge per-graph state. Returns a ``RemovableHandle``."""
    return _register(destroy_hooks, fn, "register_graph_destroy_hook")
