"""One graph on a native backend (cuda, hip, xpu): :class:`NativeGraphImpl`, the
:class:`~accel_graph.backends.base.GraphImpl` over torch's graph classes that
:class:`~.backend.NativeGraphBackend` makes. It drives the capture lifecycle (begin, end, abort,
instantiate, replay, reset), the pool bookkeeping of each capture (``backend.pools``), the
control-flow mode (:mod:`.control_flow`) and, once an eager island is called, the pieces
(:mod:`.pieces`: one torch graph per piece, all in one pool, the islands run between them).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch

from ...errors import AccelGraphError, CaptureError
from ..base import DeviceSpec, GraphImpl, PoolHandle
from ..capture_common import islands as island_marks
from . import control_flow, pieces
from .capture_errors import begin_failed, end_capture_quietly, end_failed

__all__ = ["NativeGraphImpl"]

#: torch's warning at the end of a capture that recorded nothing. A piece may be empty (an
#: island first in the capture, two islands in a row, an island last), which is no mistake.
_EMPTY_GRAPH = r".*Graph is empty"


class NativeGraphImpl(GraphImpl):
    """One graph on a torch graph class. Holds torch graph objects only while captured; each
    capture uses fresh ones, so an aborted capture never leaves a half-used object behind.

    A capture is one torch graph until an eager island is called in it; from then on it is one
    torch graph per piece, all in the same pool, with the islands between them (:mod:`.pieces`):
    ``_graph`` is the current (after capture: the last) piece, ``_pieces`` the sequence.

    Calls only the backend's policy methods, its mechanism hooks and ``backend.pools``."""

    def __init__(self, backend: Any, device: DeviceSpec, *, keep_graph: bool) -> None:
        """``backend``: the :class:`~.backend.NativeGraphBackend` making it (typed ``Any``:
        that module imports this one)."""
        super().__init__(device, keep_graph=keep_graph)
        self._backend = backend
        self._graph: Any = None
        self._handle: PoolHandle | None = None
        self._torch_id: tuple[int, int] | None = None
        self._mode = "global"  # the vendor capture mode of the capture underway (every piece)
        self._before: int | None = None
        self._bytes: int | None = None
        self._debug = False
        self._flow: control_flow.ControlFlowMode | None = None  # torch.cond & co during capture
        self._stream: Any = None  # the stream the current piece's capture began on
        self._pieces = pieces.Pieces(self)
        self._runner: Any = None  # the island runner installed while a capture is underway

    def capture_begin(self, pool: PoolHandle | None, capture_error_mode: str) -> None:
        b, pools = self._backend, self._backend.pools
        b.refuse_nested(self.device)
        b.check_current_device(self.device)
        mode = b.vendor_mode(capture_error_mode)
        if pool is None:
            pool = pools.private_handle(self.device)
        torch_id = pools.torch_id(pool)
        try:
            self._before = 0 if torch_id is None else pools.reserved(torch_id, self.device)
            self._torch_id, self._mode = torch_id, mode
            self._graph = self._begin_torch_graph()
        except BaseException as exc:
            pools.unused(pool)  # no graph holds it: forget the bookkeeping entry
            if isinstance(exc, RuntimeError) and not isinstance(exc, AccelGraphError):
                raise begin_failed(self.device, exc) from exc
            raise
        self._handle = pool
        pools.captured(pool)
        b.capture_started(self)
        self._flow = control_flow.start(b.control_flow_support(), self.device)
        self._pieces = pieces.Pieces(self)
        self._runner = island_marks.set_runner(self._pieces.run)

    def _begin_torch_graph(self) -> Any:
        """A fresh torch graph, capturing into this capture's pool with its mode."""
        b = self._backend
        graph = b.new_torch_graph(self.keep_graph, self._torch_id, self._mode)
        if self._debug:
            graph.enable_debug_mode()
        self.register_generators_with(graph)
        b.begin_capture(graph, self._torch_id, self._mode)
        self._stream = b.current_stream(self.device)  # for end_capture_quietly
        return graph

    # -- what .pieces needs (PieceHost) ----------------------------------------------------
    def island_device(self) -> torch.device:
        return self._backend.island_device(self.device)

    def control_flow_mode(self) -> Any:
        return self._flow

    def end_piece(self) -> Any:
        """End the current piece's capture (an island follows): the ended torch graph,
        instantiated (``keep_graph=True`` too: the warm-up replay needs it)."""
        graph = self._graph
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _EMPTY_GRAPH)
                graph.capture_end()
        except RuntimeError as exc:
            raise end_failed(self.device, exc) from exc
        self._graph = None
        self._learn_pool(graph)
        if self.keep_graph:
            graph.instantiate()
        return graph

    def begin_piece(self) -> None:
        """Begin the next piece's capture, in the same pool and mode."""
        try:
            self._graph = self._begin_torch_graph()
        except RuntimeError as exc:
            raise begin_failed(self.device, exc) from exc

    def pool_ranges(self) -> list[tuple[int, int]] | None:
        return self._backend.pools.ranges(self._torch_id, self.device)

    def allocating_to_pool(self) -> AbstractContextManager[bool]:
        return self._backend.pools.allocating_to(self._torch_id, self.device)

    def _learn_pool(self, graph: Any) -> None:
        if self._torch_id is None and self._handle is not None:
            self._torch_id = self._backend.pools.learned(self._handle, graph)

    def _stop_running_islands(self) -> None:
        if self._runner is not None:
            island_marks.clear_runner(self._runner)
            self._runner = None

    def pool(self) -> PoolHandle:
        assert self._handle is not None  # the front end asks only after capture_begin
        return self._handle

    def capture_end(self) -> None:
        self._stop_running_islands()
        control_flow.end(self._flow)  # raises if an error left a conditional body
        self._flow = None
        if self._pieces.broken is not None:
            raise CaptureError(
                f"the capture on {self.device} is invalid: {self._pieces.broken} (raised inside "
                f"the capture, which went on without it); fix that and capture again")
        try:
            with warnings.catch_warnings():
                if self._pieces.graphs:  # the whole graph has islands: an empty last piece is fine
                    warnings.filterwarnings("ignore", _EMPTY_GRAPH)
                self._graph.capture_end()
            self._backend.capture_stopped(self)
        except RuntimeError as exc:
            raise end_failed(self.device, exc) from exc
        self._learn_pool(self._graph)
        after = None
        if self._torch_id is not None:
            after = self._backend.pools.reserved(self._torch_id, self.device)
        self._bytes = None if after is None or self._before is None else after - self._before
        self._pieces.end_capture()
        if not self.keep_graph:
            self._bind_replay()

    def _bind_replay(self) -> None:
        # An instance attribute shadows the method: replay() is then torch's own bound method
        # (one Python frame less on the hot path), or the pieces' sequence with islands.
        if self._pieces:
            self.replay = self._pieces.finish(self._graph)  # type: ignore[method-assign]
        else:
            self.replay = self._graph.replay  # type: ignore[method-assign]

    def abort_capture(self) -> None:
        self._stop_running_islands()
        graph, self._graph = self._graph, None
        self.__dict__.pop("replay", None)
        control_flow.stop(self._flow)
        self._flow = None
        self._backend.capture_stopped(self)
        ended = self._pieces.drop()
        if graph is not None:
            stream, self._stream = self._stream, None
            end_capture_quietly(self._backend, stream, graph)
            ended.append(graph)
        for g in ended:
            try:
                g.reset()
            except Exception:
                pass
        if ended:
            self._release()

    def instantiate(self) -> None:
        self._graph.instantiate()  # earlier pieces were instantiated at their island
        self._bind_replay()

    def replay(self) -> None:
        self._graph.replay()

    def reset(self) -> None:
        graph, self._graph = self._graph, None
        self.__dict__.pop("replay", None)
        graphs = self._pieces.drop()
        if graph is not None and not any(g is graph for g in graphs):
            graphs.append(graph)
        if graphs:
            self._backend.before_reset(self.device)
            for g in graphs:
                g.reset()
            self._release()
        self._bytes = None

    def _release(self) -> None:
        if self._handle is not None:
            self._backend.pools.released(self._handle)
        self._handle = self._torch_id = None

    def __del__(self) -> None:
        # Pool bookkeeping only; torch's destructor frees the executable (and syncs on ROCm).
        if getattr(self, "_handle", None) is not None and not sys.is_finalizing():
            try:
                self._release()
            except Exception:
                pass

    def enable_debug_mode(self) -> None:
        self._debug = True
        if self._graph is not None:
            self._graph.enable_debug_mode()

    def debug_dump(self, path: str) -> None:
        # torch keeps nothing to dump unless debug mode was on before capture (or keep_graph).
        dump = self._backend.dump_graph if self._debug or self.keep_graph else None
        pieces.debug_dump(self._pieces, self._graph, path, dump, f"{self.device}", self._bytes)

    def memory_bytes(self) -> int | None:
        return self._bytes
