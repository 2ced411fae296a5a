"""Backend and GraphImpl contracts.

The front end (:class:`accel_graph.Graph`) owns the policy: the state machine, argument
validation and every user-facing error message. A backend only fills mechanism hooks, in the
manner of tinygrad's ``alloc``/``_alloc`` and RMM's ``allocate``/``do_allocate``. A hook is
called only in a state where it is legal, so backends never re-check the order of calls.

Adding a device is one module with one concrete :class:`Backend` subclass plus one line in the
built-in table of :mod:`accel_graph.backends` (or an ``accel_graph.backends`` entry point).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import CaptureError
from ..foundation.compile_options import CompileOptions

#: The capture error modes of ``torch.cuda.graph`` / ``torch.accelerator.Graph``.
CAPTURE_ERROR_MODES: tuple[str, ...] = ("default", "global", "thread_local", "relaxed")


@dataclass(frozen=True)
class DeviceSpec:
    """Which device a graph or pool lives on. Frozen: used as a cache key and in messages.

    ``backend`` is the backend's registered name (``"hip"``), ``device_type`` the torch device
    type (``"cuda"`` for HIP), ``index`` the device index (None for index-less devices such as
    the CPU), ``arch`` an optional architecture string (``"sm_90"``, ``"gfx942"``).
    """

    backend: str
    device_type: str
    index: int | None = None
    arch: str | None = None

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` this spec denotes."""
        if self.index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, self.index)

    def __str__(self) -> str:
        dev = self.device_type if self.index is None else f"{self.device_type}:{self.index}"
        return f"{dev} ({self.backend} backend)"


@dataclass(frozen=True)
class Capabilities:
    """Static facts about what a backend supports, for routing, doctor and test skips."""

    native_graphs: bool
    """True when replay is a device graph launch (CUDA/HIP/XPU), False for the recorder."""
    capture_error_modes: tuple[str, ...] = CAPTURE_ERROR_MODES
    """Modes honoured as such; others are accepted with a warning (XPU honours only default)."""
    standalone_bytes: bool = False
    """Whether ``GraphImpl.standalone_bytes()`` can return a number."""
    compile: bool = False
    """Whether ``compile=`` changes anything (recorder only)."""
    foreign_pool_handles: bool = False
    """Whether torch's own pool handles and MemPool ids are accepted as ``pool=``."""


@dataclass(frozen=True)
class PoolHandle:
    """An opaque token naming a memory pool. Sharing one across graphs shares their memory.

    Handles are created by :func:`accel_graph.graph_pool_handle` or ``Graph.pool()``; users never
    build them. A handle is valid while something references it (or while its pool has graphs):
    backends may hold them weakly, so handles support weak references (no ``__slots__``). ``id`` follows torch's convention: ``(0, k)`` for user handles, ``(k, 0)`` for a
    graph's own private pool.
    """

    backend: str
    device: DeviceSpec
    id: tuple[int, int]

    def __repr__(self) -> str:
        return f"PoolHandle({self.id[0]}, {self.id[1]}, device={self.device})"

    # A handle is an immutable token that backends may hold weakly (the recorder does, so a
    # dropped handle costs nothing): copying returns the token itself, so a copy keeps the
    # original alive and valid instead of becoming an equal stranger once the original goes.
    def __copy__(self) -> PoolHandle:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> PoolHandle:
        return self


@dataclass
class PoolStats:
    """Memory of one pool, as counted by the pool's own segments. JSON-ready via ``as_dict``."""

    reserved_bytes: int
    allocated_bytes: int
    segments: int
    graphs: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "segments": self.segments,
            "graphs": self.graphs,
            **self.extra,
        }


@dataclass(frozen=True)
class ReplayMode:
    """Which program replays a graph, and why (``Graph.replay_mode()``). JSON-ready via
    ``as_dict``.

    ``mode`` is ``"compiled"`` (the Inductor program), ``"interpreted"`` (the recorded program
    as captured), ``"undecided"`` (not instantiated yet, or still timing both programs on the
    first real replays) or ``"native"`` (the backend's own device graph). ``compiled_s`` and
    ``interpreted_s`` are the measured median seconds per replay of each program (None where
    not measured); ``rounds`` how many timed runs of each the medians are of; ``decided_at``
    ``"instantiate"``, ``"replay"`` (the first real replays) or None (no timing decided it).
    """

    mode: str
    reason: str
    compiled_s: float | None = None
    interpreted_s: float | None = None
    rounds: int = 0
    decided_at: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason, "compiled_s": self.compiled_s,
                "interpreted_s": self.interpreted_s, "rounds": self.rounds,
                "decided_at": self.decided_at}


_user_pool_ids = itertools.count(1)


def next_user_pool_id() -> tuple[int, int]:
    """A process-unique ``(0, k)`` id for a user pool handle (torch's convention)."""
    return (0, next(_user_pool_ids))


class GraphImpl(ABC):
    """Mechanism of one graph on one backend. Driven only by :class:`accel_graph.Graph`.

    The front end guarantees the order of calls: ``capture_begin`` only on an empty impl,
    ``capture_end`` only after ``capture_begin``, ``instantiate`` only after a successful
    capture, ``replay`` only once instantiated, ``reset`` in any state. Hooks raise backend
    errors (``CaptureError``, ``ReplayError``, ``OutOfMemoryError``) for what only they can know.
    """

    def __init__(self, device: DeviceSpec, *, keep_graph: bool = False) -> None:
        self.device = device
        self.keep_graph = keep_graph
        #: Generators registered with the graph (besides the device's default one), in order.
        self.generators: list[torch.Generator] = []

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Let captures draw from ``generator``, advancing it on each replay (the front end
        checks the type, the device and that no capture is underway). Kept across reset()."""
        if not any(generator is g for g in self.generators):
            self.generators.append(generator)

    def register_generators_with(self, graph: Any) -> None:
        """Register this graph's generators with a torch graph object (native backends: each
        capture uses a fresh one). Feature-detected, unverified on hardware: a torch graph
        class without ``register_generator_state`` gets ``CaptureError``."""
        if not self.generators:
            return
        register = getattr(graph, "register_generator_state", None)
        if register is None:
            raise CaptureError(
                f"this torch's graph class on {self.device} ({type(graph).__name__}) has no "
                f"register_generator_state, so a registered generator cannot be used in a capture; "
                f"upgrade torch or draw from the default generator"
            )
        for gen in self.generators:
            register(gen)

    @abstractmethod
    def capture_begin(self, pool: PoolHandle | None, capture_error_mode: str) -> None:
        """Start capturing on the current stream into ``pool`` (already resolved and valid), or
        into a new private pool of this graph when ``pool`` is None."""

    @abstractmethod
    def pool(self) -> PoolHandle:
        """The handle of the pool the current capture went into (shareable as ``pool=``)."""

    @abstractmethod
    def capture_end(self) -> None:
        """Finish the capture. With ``keep_graph=False`` also instantiate."""

    @abstractmethod
    def abort_capture(self) -> None:
        """Undo a capture that raised half-way, leaving the impl empty and reusable. Never raises."""

    @abstractmethod
    def instantiate(self) -> None:
        """Build the executable graph from the captured one (idempotent from the caller's view)."""

    @abstractmethod
    def replay(self) -> None:
        """Run the captured work once. Must not allocate or log on the hot path."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the captured graph. Memory still referenced by user tensors must stay valid."""

    def enable_debug_mode(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Keep whatever the backend needs for ``debug_dump``."""

    @abstractmethod
    def debug_dump(self, path: str) -> None:
        """Write a description of the captured graph to ``path``."""

    def memory_bytes(self) -> int | None:
        """Bytes this graph's capture added to its pool, or None where unknown."""
        return None

    def standalone_bytes(self) -> int | None:
        """Bytes this graph would need in a pool of its own, or None where unknown."""
        return None

    def replay_mode(self) -> ReplayMode:
        """Which program replays and why. Native backends replay the device's own graph."""
        return ReplayMode("native", "the backend replays its own device graph")

    def work_count(self) -> int | None:
        """How many operations the last successful capture recorded that replay runs (0: the
        graph is empty), or None where the backend cannot tell or warns about an empty graph
        itself (torch's CUDA/HIP graphs do, in ``capture_end``)."""
        return None

    def compile_info(self) -> dict[str, Any] | None:
        """What compiling the replay program did, once instantiated (JSON-ready; keys are the
        backend's, e.g. the recorder's ``compile_s``, ``cache``, or ``fallback`` with the
        reason), or None when the graph is not compiled (or not instantiated yet)."""
        return None


class Backend(ABC):
    """A device family. Static facts are class attributes; behaviour is a small contract.

    ``probe()`` is cheap, never raises, and returns why the backend is unusable (None when it
    is usable), in the manner of vLLM's platforms.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    #: torch device types this backend serves; "*" means any device (the recorder).
    device_types: ClassVar[tuple[str, ...]]
    #: Routing order among backends that serve the same device type: higher wins.
    priority: ClassVar[int] = 0

    @classmethod
    @abstractmethod
    def probe(cls) -> str | None:
        """None when usable here, else a one-line reason. Never raises, never initialises a device."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """Static capabilities of this backend."""

    def default_device(self) -> torch.device:
        """The device used when a graph names none."""
        return torch.device(self.device_types[0])

    @abstractmethod
    def device_spec(self, device: torch.device) -> DeviceSpec:
        """Validate ``device`` for this backend and describe it; ``BackendUnavailable`` if absent."""

    @abstractmethod
    def new_graph(self, device: DeviceSpec, *, keep_graph: bool,
                  compile: CompileOptions | None) -> GraphImpl:
        """A fresh, empty GraphImpl on ``device``.

        ``compile`` is ``compile=``/``compile_options=`` already resolved by the front end
        (:func:`~accel_graph.foundation.compile_options.resolve_compile`): None asks for no
        compiled replay, a :class:`~accel_graph.foundation.compile_options.CompileOptions` for
        ``compile="inductor"`` with those options. A backend that cannot honour it must say so
        (a warning, as native backends do), never drop it silently. The front end calls this
        two frames below the line that constructs the ``Graph`` (``Graph.__init__`` or
        :func:`accel_graph.graphs.graph.resolved_graph`, then ``Graph._build``), so a
        warning with ``stacklevel=4`` points at that line."""

    @abstractmethod
    def graph_pool_handle(self, device: DeviceSpec) -> PoolHandle:
        """A new pool handle on ``device`` for sharing memory across graphs."""

    @abstractmethod
    def resolve_pool(self, pool: object, device: DeviceSpec) -> PoolHandle:
        """Turn what the user passed as ``pool=`` into a valid handle, or raise ``PoolError``."""

    def pool_stats(self, pool: PoolHandle) -> PoolStats | None:
        """Statistics of one pool, or None where the backend cannot tell."""
        return None

    def synchronize(self, device: DeviceSpec) -> None:  # noqa: B027 - host devices need nothing
        """Wait for all work on ``device``."""

    def current_stream(self, device: DeviceSpec) -> Any:
        """The stream capture would record on (None where the device has no streams)."""
        return None

    def capture_stream(self, device: DeviceSpec) -> Any:
        """The stream ``accel_graph.graph`` captures on when none is given (None: current)."""
        return None

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """A context manager making ``stream`` current; a no-op where streams do not exist."""
        return nullcontext()

    def control_flow_warmup(self, device: DeviceSpec) -> AbstractContextManager[Any]:
        """A context for the eager warm-up before a capture: where the backend captures
        ``torch.cond`` into device-side conditional nodes, both branches get their first-use
        setup here (native backends); a no-op elsewhere (the recorder needs no warm-up)."""
        return nullcontext()

    @abstractmethod
    def is_current_stream_capturing(self, device: DeviceSpec) -> bool:
        """Whether a capture is underway on the current stream (thread, for the recorder)."""

    def is_capturing(self, device: torch.device) -> bool:
        """``is_current_stream_capturing`` from a plain device, without initialising it.

        Native backends override this: building a DeviceSpec reads the device's architecture,
        which starts the runtime, and torch's own query promises not to.
        """
        return self.is_current_stream_capturing(self.device_spec(device))

    def prepare_capture(self, device: DeviceSpec) -> None:  # noqa: B027
        """What ``accel_graph.graph`` does before capture_begin (sync, empty caches)."""

    def describe(self) -> Iterator[tuple[str, str]]:
        """Extra (key, value) facts for ``doctor``'s entry of this (usable) backend. Must not raise."""
        return iter(())

    # -- doctor: a backend's own section of ``accel-graph doctor`` ---------------------------
    # Classmethods: the doctor reports every registered backend, usable or not, and must not
    # initialise a device unless asked (``probe_devices``).

    #: Key of this backend's own section in the doctor's JSON report (None: it has none).
    doctor_key: ClassVar[str | None] = None
    #: Heading of that section in the doctor's table (``"NVIDIA"``).
    doctor_title: ClassVar[str] = ""

    @classmethod
    def doctor_versions(cls) -> dict[str, dict[str, Any]]:
        """Entries for the report's ``versions`` block: name -> ``{"value": str or None,
        "note": str or None}`` (``note`` says where the value came from, or why it is None).
        Report every name on every host (value None where it does not apply), so the block
        keeps its keys. Must not initialise a device."""
        return {}

    @classmethod
    def doctor_section(cls, probe_devices: bool, problems: list[str]) -> dict[str, Any] | None:
        """The JSON-ready section under ``doctor_key`` (None where it does not apply, e.g. not
        this vendor's build). Read per-device facts only when ``probe_devices`` is true or the
        runtime is already initialised; append things that need attention to ``problems``.
        May raise: the doctor reports the error instead of the section."""
        return None

    @classmethod
    def doctor_lines(cls, section: Mapping[str, Any] | None) -> list[str]:
        """``section`` (as returned by :meth:`doctor_section`, possibly read back from JSON) as
        lines of the doctor's table, each indented by two spaces."""
        return []
