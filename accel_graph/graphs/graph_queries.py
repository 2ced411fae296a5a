"""What an :class:`accel_graph.Graph` tells about itself: its backend, device, state, pool,
memory, replay mode and compile report, and its debug dump.

:class:`GraphQueries` is the read-only half of ``Graph`` (its base class): none of these methods
changes the graph's state, and each that needs a capture refuses with the same
``GraphStateError`` the state machine (:mod:`accel_graph.graphs.graph`) uses. The state names
live here because both halves read them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.base import Backend, DeviceSpec, GraphImpl, PoolHandle, ReplayMode
from ..errors import GraphStateError
from . import hooks

__all__ = ["CAPTURED", "CAPTURING", "EMPTY", "INSTANTIATED", "GraphQueries"]

EMPTY, CAPTURING, CAPTURED, INSTANTIATED = "empty", "capturing", "captured", "instantiated"


class GraphQueries:
    """The queries of a graph. The subclass (``Graph``) sets the fields below at construction
    and owns every change to them."""

    _backend: Backend
    _device: DeviceSpec
    _impl: GraphImpl
    _state: str
    _pool: PoolHandle | None
    _events: hooks.GraphEvents

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

    def pool(self) -> PoolHandle:
        """The handle of this graph's pool; pass it as ``pool=`` to share memory with it."""
        if self._pool is None:
            raise self._refuse("pool()", "the pool exists only once capture_begin() has run")
        return self._pool

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
