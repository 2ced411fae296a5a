"""``accel_graph.Graph``, the policy front end: one capture/replay state machine on every backend.

The vocabulary is PyTorch's (``torch.cuda.CUDAGraph``, ``torch.accelerator.Graph``), so this
class drops in where those were used. ``Graph`` owns the states and every misuse error; the
backend's :class:`~accel_graph.backends.base.GraphImpl` only does the mechanism.

States: ``empty`` -> ``capturing`` -> ``captured`` -> ``instantiated``; ``reset()`` returns to
``empty`` from any state. With ``keep_graph=False`` (the default) ``capture_end`` instantiates
at once, as in torch.

Every backend fires the graph lifecycle hooks of :mod:`accel_graph.graphs.hooks` (torch 2.14's
``register_graph_*_hook``) from here, with the ``Graph`` as argument: capture start and end,
instantiate, replay start and end, and destroy (``reset()`` or collection) with the exec ids.

A capture belongs to the thread that began it: ``capture_end()`` and ``reset()`` from another
thread are refused with ``GraphStateError``, as CUDA refuses them outside
``capture_error_mode="relaxed"``; a relaxed capture may be ended or reset from any thread (the
capturing thread then runs eagerly), and so may one whose thread exited. A ``Graph`` collected
mid-capture ends its capture.

Two ways to capture a block, as in torch: ``with accel_graph.Graph(...) as g:`` (like
``torch.accelerator.Graph``) captures on the *current* stream with the constructor's ``pool`` and
``capture_error_mode``; ``with accel_graph.graph(g):`` (like ``torch.cuda.graph``) makes the
backend's side stream current first and takes ``pool``/``stream``/``capture_error_mode`` per
capture. Both synchronise and empty the caches first and drop the capture if the body raises.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ..backends import select_backend
from ..backends.base import (
    CAPTURE_ERROR_MODES,
    Backend,
    DeviceSpec,
    GraphImpl,
    PoolHandle,
    ReplayMode,
)
from ..errors import CaptureError, ConfigError, GraphStateError
from ..foundation.compile_options import CompileOptions, resolve_compile
from . import hooks
from .device_queries import graph_pool_handle, is_current_stream_capturing

__all__ = [
    "EmptyGraphWarning",
    "Graph",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
]

EMPTY, CAPTURING, CAPTURED, INSTANTIATED = "empty", "capturing", "captured", "instantiated"

#: torch's words when a capture recorded nothing (``CUDAGraph::capture_end``, a ``TORCH_WARN``,
#: so a ``UserWarning`` in Python); kept verbatim so filters written for torch's warning match.
EMPTY_GRAPH_MESSAGE = (
    "The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
    "on wrong device or stream."
)


class EmptyGraphWarning(UserWarning):
    """A capture recorded no work: ``replay()`` will do nothing. A ``UserWarning``, as torch's."""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line, past this module and the
    ``contextlib`` frames of ``with graph(g):``."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
        level += 1
    return level


def _check_mode(mode: str) -> str:
    if mode not in CAPTURE_ERROR_MODES:
        raise ConfigError(
            f"unknown capture_error_mode {mode!r}; use one of {', '.join(CAPTURE_ERROR_MODES)}"
        )
    return mode


class Graph:
    """A device graph: capture a region of work once, replay it many times.

    Args:
        keep_graph: keep the captured graph after ``capture_end`` and instantiate on demand
            (``instantiate()`` or the first ``replay()``), as in torch.
        pool: a pool handle (``graph_pool_handle()`` or another graph's ``pool()``) to share
            memory with; None gives the graph a private pool.
        capture_error_mode: ``"default"``, ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        device: the device to capture on; None follows the routing rules (``ACCEL_GRAPH_BACKEND``,
            then the current accelerator, then the CPU recorder).
        compile: ``None`` replays the recorded program as captured; ``"inductor"`` compiles it
            once at instantiation (recorder only; native backends ignore it with a warning).
            Unset, ``ACCEL_GRAPH_COMPILE`` supplies the default.
        compile_options: options of compiled replay (:class:`~accel_graph.foundation.compile_options.
            CompileOptions`: ``replay``, ``freeze``, ``cpp_wrapper``); only with ``compile="inductor"``.

    ``graph_pool`` and ``capture_error_mode`` are attributes, as on ``torch.accelerator.Graph``:
    ``capture_begin()`` without arguments and ``with g:`` use them, so setting them (before a
    capture, or after ``reset()``) changes the next capture.
    """

    def __init__(
        self,
        keep_graph: bool = False,
        *,
        pool: object | None = None,
        capture_error_mode: str = "default",
        device: torch.device | str | int | None = None,
        compile: str | None = None,
        compile_options: Mapping[str, Any] | CompileOptions | None = None,
    ) -> None:
        self._backend, dev = select_backend(device)
        self._device: DeviceSpec = self._backend.device_spec(dev)
        self.keep_graph = bool(keep_graph)
        self.capture_error_mode = _check_mode(capture_error_mode)
        self.graph_pool = None if pool is None else self._backend.resolve_pool(pool, self._device)
        compile, opts = resolve_compile(compile, compile_options)
        self._compile = compile
        options: dict[str, Any] = {"compile": compile}
        if opts is not None:
            options["compile_options"] = opts
        self._impl: GraphImpl = self._backend.new_graph(self._device, keep_graph=self.keep_graph, **options)
        self._state = EMPTY
        self._pool: PoolHandle | None = None
        self._debug = False
        #: The thread that began the capture underway (None unless capturing).
        self._capture_thread: threading.Thread | None = None
        #: Exec id and destroy-event cycle for the lifecycle hooks (accel_graph.graphs.hooks).
        self._events = hooks.GraphEvents(self)
        #: The capture_error_mode of the capture underway.
        self._capture_mode = self.capture_error_mode

    def __del__(self) -> None:
        # Collected mid-capture (the user dropped it, or its cycle was collected, possibly on
        # another thread): end the capture, so its thread does not go on recording.
        if getattr(self, "_state", None) == CAPTURING:
            try:
                self._impl.abort_capture()
            except Exception:  # never raise from a finaliser; abort_capture should not either
                pass

    # -- introspection ------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The backend this graph runs on."""
        return self._backend

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` this graph captures on and replays on: pass it where torch
        expects a device (``torch.zeros(2, device=g.device)``)."""
        return self._device.torch_device

    @property
    def device_spec(self) -> DeviceSpec:
        """The backend's :class:`~accel_graph.backends.base.DeviceSpec` of :attr:`device` (the
        backend name and arch too): what ``g.backend``'s methods take."""
        return self._device

    @property
    def state(self) -> str:
        """One of ``"empty"``, ``"capturing"``, ``"captured"``, ``"instantiated"``."""
        return self._state

    @property
    def exec_id(self) -> int | None:
        """A process-unique id of the current instantiation (None before it, and after
        ``reset()``); the destroy hooks receive the ids of a cycle (:mod:`accel_graph.graphs.hooks`)."""
        return self._events.exec_id

    def __repr__(self) -> str:
        return f"Graph(device={self._device}, state={self._state})"

    def _refuse(self, what: str, fix: str) -> GraphStateError:
        return GraphStateError(
            f"Graph.{what} is not allowed while the graph is {self._state} on {self._device}: {fix}"
        )

    # -- capture ------------------------------------------------------------------------
    def capture_begin(self, pool: object | None = None, capture_error_mode: str | None = None) -> None:
        """Begin capturing on the current stream. Arguments override the constructor's."""
        self._check_can_begin()
        self._check_process_allows_capture()
        mode = _check_mode(capture_error_mode if capture_error_mode is not None else self.capture_error_mode)
        if pool is not None:
            handle = self._backend.resolve_pool(pool, self._device)
        elif self.graph_pool is not None:
            # Resolved again: like torch.accelerator.Graph, graph_pool is a plain attribute the
            # caller may set between captures (a handle, or torch's id on native backends).
            handle = self._backend.resolve_pool(self.graph_pool, self._device)
        else:
            handle = None
        # The impl raises CaptureError itself for what only it can know (nested capture on this
        # thread, capture inside torch.compile); the state changes only once it succeeded.
        # handle=None asks for a private pool, which the impl creates (as torch's graphs do).
        self._impl.capture_begin(handle, mode)
        self._pool = self._impl.pool()
        self._capture_thread = threading.current_thread()
        self._capture_mode = mode
        self._state = CAPTURING
        if hooks.capture_start_hooks:  # inside the capture, as torch's: see accel_graph.graphs.hooks
            hooks.fire(hooks.capture_start_hooks, self)

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Let captures of this graph draw from ``generator`` (a generator of the graph's
        device other than its default one, which is always registered); each replay advances
        it by the draws of the graph, as ``torch.cuda.CUDAGraph.register_generator_state``.
        Not allowed during a capture, as in torch. Registrations persist across ``reset()``."""
        if self._state == CAPTURING:
            raise self._refuse(
                "register_generator_state()",
                "register generators before capture_begin() (torch: \"Cannot register the state "
                "during capturing stage\")",
            )
        if not isinstance(generator, torch.Generator):
            raise ConfigError(
                f"register_generator_state(generator) takes a torch.Generator, got "
                f"{type(generator).__name__}"
            )
        want = self._device.torch_device.type
        if generator.device.type != want:
            raise ConfigError(
                f"register_generator_state: the generator is on {generator.device}, the graph on "
                f"{self._device}; pass a generator of the graph's device "
                f"(torch.Generator(device={want!r}))"
            )
        self._impl.register_generator_state(generator)

    def _check_capturing_thread(self, what: str) -> None:
        """Refuse ending a capture from a thread other than the one that began it, as CUDA
        does (``cudaErrorStreamCaptureWrongThread``) unless the capture is ``"relaxed"``. Allowed:
        a ``relaxed`` capture (the capturing thread then runs eagerly), and a capture whose
        thread has exited (nobody else can end it; the recorder invalidated it at the exit)."""
        owner = self._capture_thread
        here = threading.current_thread()
        if owner is None or owner is here or not owner.is_alive() or self._capture_mode == "relaxed":
            return
        raise GraphStateError(
            f"Graph.{what} was called from thread {here.name!r} (ident {here.ident}), but the "
            f"capture on {self._device} is underway on thread {owner.name!r} (ident "
            f"{owner.ident}) in capture_error_mode={self._capture_mode!r}: as on CUDA, only a "
            f"'relaxed' capture may be ended or reset from another thread. Call {what} from "
            f"thread {owner.name!r}, or capture with capture_error_mode='relaxed'"
        )

    def _check_can_begin(self) -> None:
        if self._state == CAPTURING:
            raise self._refuse(
                "capture_begin()", "a capture is already underway; call capture_end() first"
            )
        if self._state != EMPTY:
            raise self._refuse(
                "capture_begin()",
                "it already holds a captured graph; call reset() to capture again, or create a new Graph",
            )

    def _check_process_allows_capture(self) -> None:
        """Raise ``CaptureError`` when a process-wide state forbids device-graph capture here:
        the allocator plug-in installed as the whole-process CUDA allocator (torch keeps the
        graph-pool hooks of pluggable allocators C++-only). Only native graphs are affected; the
        recorder does not use torch's graph pools."""
        if not self._backend.capabilities().native_graphs:
            return
        # Imported here: the plug-in module pulls in the allocator engine, which a process that
        # never captures (or never uses the plug-in) should not pay for at `import accel_graph`.
        from ..allocator.core.device_plugin import check_capture_allowed

        check_capture_allowed(self._device)

    def capture_end(self) -> None:
        """End the capture begun by ``capture_begin``; instantiate unless ``keep_graph``."""
        if self._state != CAPTURING:
            raise self._refuse("capture_end()", "call capture_begin() first")
        self._check_capturing_thread("capture_end()")
        try:
            self._impl.capture_end()
        except BaseException:
            self._abort()
            raise
        self._capture_thread = None
        self._state = CAPTURED if self.keep_graph else INSTANTIATED
        # torch's order: capture end, then (keep_graph=False) instantiate. The backends do both
        # in one impl call, so both events fire once it returned.
        if hooks.capture_end_hooks:
            hooks.fire(hooks.capture_end_hooks, self)
        if not self.keep_graph:
            self._events.instantiated(self)
        if self._impl.work_count() == 0:
            warnings.warn(EmptyGraphWarning(
                f"{EMPTY_GRAPH_MESSAGE} (accel-graph on {self._device}: the capture recorded "
                f"no operation that replay would run, so replay() does nothing. Ops of other "
                f"threads are not captured; views and torch.empty run nothing at replay)"
            ), stacklevel=_caller_stacklevel())

    def _abort(self) -> None:
        """Drop a capture that failed half-way: the graph is empty and reusable afterwards."""
        self._impl.abort_capture()
        self._state = EMPTY
        self._pool = None
        self._capture_thread = None

    # -- replay -------------------------------------------------------------------------
    def instantiate(self) -> None:
        """Build the executable graph of a ``keep_graph=True`` capture (``replay()`` does it too).

        Calling it again on an instantiated ``keep_graph=True`` graph is harmless. With
        ``keep_graph=False`` (the default) ``capture_end()`` has instantiated the graph already and
        this raises ``GraphStateError``, as torch's ``CUDAGraph.instantiate`` does.
        """
        if self._state not in (CAPTURED, INSTANTIATED):
            raise self._refuse("instantiate()", "capture a graph first")
        if self._state == INSTANTIATED and not self.keep_graph:
            # torch: TORCH_CHECK(keep_graph_, "instantiate() is intended to be called by the
            # user only when keep_graph=true"); the words are kept so code matching them works.
            raise GraphStateError(
                f"Graph.instantiate() on {self._device}: instantiate() is intended to be called "
                f"by the user only when keep_graph=true. This graph was made with "
                f"keep_graph=False, so capture_end() instantiated it already: call replay(), or "
                f"create it with Graph(keep_graph=True) to instantiate it yourself"
            )
        if self._state == CAPTURED:
            self._impl.instantiate()
            self._state = INSTANTIATED
            self._events.instantiated(self)

    def replay(self) -> None:
        """Replay the captured work."""
        if self._state is not INSTANTIATED:
            if self._state == CAPTURED:
                self.instantiate()
            else:
                raise self._refuse(
                    "replay()",
                    "there is no successful capture to replay; capture first with "
                    "capture_begin()/capture_end() or `with accel_graph.graph(g): ...`",
                )
        if hooks.replay_start_hooks:
            hooks.fire(hooks.replay_start_hooks, self)
        try:
            self._impl.replay()
        finally:  # as torch: the end hooks fire even when the launch raised
            if hooks.replay_end_hooks:
                hooks.fire(hooks.replay_end_hooks, self)

    def reset(self) -> None:
        """Drop the captured graph so this object can capture again. Memory that tensors you
        still hold point into stays valid."""
        if self._state == CAPTURING:
            self._check_capturing_thread("reset()")
            self._abort()
        else:
            self._impl.reset()
            self._state = EMPTY
            self._pool = None
        self._events.reset(self)  # as torch: every reset() ends a cycle, even of an empty graph

    def pool(self) -> PoolHandle:
        """The handle of this graph's pool; pass it as ``pool=`` to share memory with it."""
        if self._pool is None:
            raise self._refuse("pool()", "the pool exists only once capture_begin() has run")
        return self._pool

    # -- debugging and memory -----------------------------------------------------------
    def enable_debug_mode(self) -> None:
        """Keep what ``debug_dump`` needs (and, on the recorder, poison capture outputs)."""
        self._debug = True
        self._impl.enable_debug_mode()

    def debug_dump(self, path: str) -> None:
        """Write the captured graph to ``path`` (DOT; the recorder adds ``path + ".json"``)."""
        if self._state not in (CAPTURED, INSTANTIATED):
            raise self._refuse("debug_dump()", "capture a graph first")
        self._impl.debug_dump(str(path))

    def memory_bytes(self) -> int | None:
        """Bytes this graph's capture added to its pool (None where the backend cannot tell)."""
        if self._state not in (CAPTURED, INSTANTIATED):
            raise self._refuse("memory_bytes()", "capture a graph first")
        return self._impl.memory_bytes()

    def standalone_bytes(self) -> int | None:
        """Bytes this graph would need in a pool of its own (None where unknown)."""
        if self._state not in (CAPTURED, INSTANTIATED):
            raise self._refuse("standalone_bytes()", "capture a graph first")
        return self._impl.standalone_bytes()

    def replay_mode(self) -> ReplayMode:
        """Which program replays this graph and why (:class:`~accel_graph.backends.base.
        ReplayMode`: ``mode`` ``"compiled"``, ``"interpreted"``, ``"undecided"`` or
        ``"native"``, a ``reason``, and the measured median seconds of each program where
        ``compile_options={"replay": "auto"}`` timed them). Allowed in every state: before
        instantiation (and after ``reset()``) a compiled graph is ``"undecided"``."""
        return self._impl.replay_mode()

    def compile_info(self) -> dict[str, Any] | None:
        """What compiling the replay program did (``compile="inductor"``), once instantiated.

        On the recorder: ``{"backend": "inductor", "compile_s", "cache": "hit" | "miss", ...}``
        (``compile_s`` is the seconds instantiation spent building and compiling the program, or
        fetching it from the process-wide cache on a hit), or ``{"backend", "fallback": reason}``
        when compilation failed and replay is interpreted. None when the graph is not compiled or
        not instantiated yet, and on backends that do not compile.
        """
        return self._impl.compile_info()

    # -- context manager (torch.accelerator.Graph) --------------------------------------
    def _prepare_block_capture(self) -> None:
        """What both block forms do before ``capture_begin``: refuse misuse before touching the
        device (a sync or ``empty_cache`` inside a capture already underway would break that
        capture with a raw device error), then synchronise and empty the caches, as torch does."""
        self._check_can_begin()
        self._check_process_allows_capture()
        if self._backend.is_current_stream_capturing(self._device):
            raise CaptureError(
                f"a capture is already underway on the current stream of {self._device}; end it "
                f"before beginning another (one capture at a time per stream)"
            )
        self._backend.prepare_capture(self._device)

    def __enter__(self) -> Graph:
        """Begin capturing on the current stream, like ``torch.accelerator.Graph.__enter__``:
        synchronise, empty the caches, then ``capture_begin()`` with the constructor's ``pool``
        and ``capture_error_mode``. Returns the graph (torch's returns None), so both
        ``with g:`` and ``with Graph() as g:`` work.

        The stream is the caller's: on CUDA/HIP make a side stream current first (``with s, g:``
        for a ``torch.Stream`` ``s``), since they refuse to capture on the default stream;
        :func:`graph` picks one for you.
        """
        self._prepare_block_capture()
        self.capture_begin()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """End the capture (``capture_end()``). If the body raised, drop the capture instead and
        let the exception propagate: the graph is left empty and reusable, and nothing it held
        before was lost (``__enter__`` refuses a graph that holds a capture). torch's ``__exit__``
        calls ``capture_end()`` either way."""
        if exc_info and exc_info[0] is not None:
            if self._state == CAPTURING and self._capture_thread is threading.current_thread():
                self._abort()
            return
        self.capture_end()



@contextmanager
def graph(
    g: Graph,
    pool: object | None = None,
    stream: Any = None,
    capture_error_mode: str | None = None,
) -> Iterator[None]:
    """Capture the body of the ``with`` block into ``g``, like ``torch.cuda.graph``.

    Synchronises the device and empties caches first (as torch does), makes ``stream`` (or the
    backend's capture stream: one side stream per device on native backends) current, and calls
    ``capture_begin``/``capture_end`` with ``pool``/``capture_error_mode`` overriding the
    graph's own. If the body raises, the capture is dropped and ``g`` is left empty and
    reusable. ``with g:`` (:meth:`Graph.__enter__`) is the other form: it captures on the
    current stream, with the graph's own settings.
    """
    backend = g.backend
    g._prepare_block_capture()
    if stream is None:
        stream = backend.capture_stream(g.device_spec)
    with backend.stream_context(stream):
        g.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            yield
        except BaseException:
            g._abort()
            raise
        g.capture_end()
