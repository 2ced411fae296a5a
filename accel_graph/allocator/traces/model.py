"""Allocator traces in memory: the :class:`Trace` model and PyTorch memory snapshots in and out.

:class:`Trace` holds what a memory snapshot holds, in a form the simulator can use directly:
per device, one numpy array of events (:data:`TRACE_DTYPE`), plus interned stack frames, the
final ``segments``, ``allocator_settings`` and the device type. It converts to and from
PyTorch's snapshot dict (the ``_dump_snapshot`` pickle that ``torch.cuda._memory_viz`` and
pytorch.org/memory_viz read). Files (pickle, JSON, compact, RMM CSV) are read and written by
:mod:`.files` (``load_trace``/``save_trace``, exported by the package); the data checks and the
segment derivation behind :meth:`Trace.validate` and :meth:`Trace.derive_segments` are in
:mod:`.segments`. Problems in the *data* (a free of an address never allocated, ...) do not
fail a load: see :meth:`Trace.validate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .actions import ACTIONS
from .record import (
    DEFAULT_LIMITS,
    DEVICE_TYPES,
    META_KEY,
    NO_FRAMES,
    NO_TIME,
    TRACE_DTYPE,
    TraceLimits,
    bulk_objects,
)
from .segments import TraceReport, derive_device_segments, validate_device
from .snapshot_entries import events_to_entries
from .torch_snapshot import Stack, read_snapshot

__all__ = [
    "FOREIGN_EXTENSIONS",
    "Trace",
    "TraceReport",
    "foreign_device",
    "infer_device_type",
    "strip_frames",
]


@dataclass(eq=False)
class Trace:
    """An allocator trace: events per device index plus the state the snapshot ends in.

    ``device_traces[i]`` is an array of :data:`TRACE_DTYPE` for device index ``i`` (arrays loaded
    from the compact format are read-only views). An event's ``frames`` field indexes
    ``stacks`` (-1: none). ``segments`` are the final segments in PyTorch's snapshot form (plain
    dicts). ``device_type`` is one of :data:`DEVICE_TYPES` or None when unknown.
    """

    device_traces: list[np.ndarray] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    allocator_settings: dict[str, Any] | None = None
    device_type: str | None = None
    stacks: list[Stack] = field(default_factory=list)
    external_annotations: list[Any] | None = None
    #: Unknown per-event keys (``compile_context``, ``user_metadata``, ...) by (device, index).
    event_extras: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    #: Unknown top-level snapshot keys, kept so that a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)
    #: A device the file names (our metadata) or implies (``torch_mlu`` frames, ...) that has
    #: no allocator model here; ``device_type`` is then None. Not written back.
    unsupported_device: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.device_type is not None and self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES} or None")
        for i, a in enumerate(self.device_traces):
            if not isinstance(a, np.ndarray) or a.dtype != TRACE_DTYPE:
                raise TypeError(f"device_traces[{i}] must be a numpy array of TRACE_DTYPE")
            if len(a) and int(a["frames"].max()) >= len(self.stacks):
                raise ValueError(f"device_traces[{i}] refers to a stack that is not in stacks")

    # -- basic views -------------------------------------------------------------------------
    @property
    def num_events(self) -> int:
        return sum(len(a) for a in self.device_traces)

    @property
    def devices(self) -> list[int]:
        """Device indices that have events or segments."""
        used = {i for i, a in enumerate(self.device_traces) if len(a)}
        used.update(int(s.get("device", 0)) for s in self.segments)
        return sorted(used)

    @property
    def has_time(self) -> bool:
        return any(len(a) and bool((a["time_us"] != NO_TIME).any()) for a in self.device_traces)

    def events(self, device: int = 0) -> np.ndarray:
        """The events of ``device`` (an empty array when it has none)."""
        if device < len(self.device_traces):
            return self.device_traces[device]
        return np.empty(0, TRACE_DTYPE)

    def action_counts(self, device: int | None = None) -> dict[str, int]:
        arrays = self.device_traces if device is None else [self.events(device)]
        counts = np.zeros(len(ACTIONS), np.int64)
        for a in arrays:
            counts += np.bincount(a["action"], minlength=len(ACTIONS))[: len(ACTIONS)]
        return {name: int(n) for name, n in zip(ACTIONS, counts, strict=True) if n}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        n = max(len(self.device_traces), len(other.device_traces))
        if any(not np.array_equal(self.events(d), other.events(d)) for d in range(n)):
            return False
        return (self.segments, self.allocator_settings, self.device_type, self.stacks,
                self.external_annotations, self.event_extras, self.extra) == (
            other.segments, other.allocator_settings, other.device_type, other.stacks,
            other.external_annotations, other.event_extras, other.extra)  # fmt: skip

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_events(
        cls,
        events: Iterable[Sequence[int]] | np.ndarray,
        *,
        device: int = 0,
        device_type: str | None = "cuda",
        segments: list[dict[str, Any]] | None = None,
        allocator_settings: dict[str, Any] | None = None,
    ) -> Trace:
        """A trace from the C engine's drained events for one device.

        ``events`` is a structured array with named fields (the engine's ``drain_events()``
        array: ``action, addr, size`` and optionally ``stream, pool_id, seq, time_us``; sorted by
        ``seq``), an array of :data:`TRACE_DTYPE`, or tuples ``(action code, addr, size, stream,
        pool id[, seq])`` in that order. Without ``segments`` the final segments are derived
        from the events (see :meth:`derive_segments`), so viewers get a consistent end state.
        """
        if isinstance(events, np.ndarray) and events.dtype.names:
            array = _array_from_named(events)
        else:
            array = _array_from_tuples(list(events))
        traces = [np.empty(0, TRACE_DTYPE) for _ in range(device)] + [array]
        trace = cls(traces, [], allocator_settings, device_type)
        trace.segments = trace.derive_segments() if segments is None else list(segments)
        return trace

    @classmethod
    def from_snapshot(
        cls, snapshot: object, source: str = "<snapshot>", limits: TraceLimits = DEFAULT_LIMITS
    ) -> Trace:
        """A trace from a snapshot object (dict format, or the legacy bare list of segments).

        Raises :class:`TraceFormatError` for anything that is not plain snapshot data.
        """
        with bulk_objects():
            p = read_snapshot(snapshot, source, limits)
        trace = cls(p.device_traces, p.segments, p.allocator_settings, p.device_type, p.stacks,
                    p.external_annotations, p.event_extras, p.extra)  # fmt: skip
        if trace.device_type is None:
            trace.device_type = infer_device_type(trace)
        if trace.device_type is None:
            trace.unsupported_device = foreign_device(snapshot, trace)
        return trace

    def to_snapshot(self, *, frames: bool = True) -> dict[str, Any]:
        """PyTorch's snapshot dict: ``segments``, ``device_traces``, ``allocator_settings``, ...

        Events are written as torch writes them (``oom`` carries ``device_free`` instead of
        ``addr``; ``time_us`` only when recorded). With ``frames=False`` all frames are empty.
        """
        device_traces = [
            events_to_entries(a, self.stacks if frames else [], self.event_extras, device)
            for device, a in enumerate(self.device_traces)
        ]
        segments = self.segments if frames else [strip_frames(s) for s in self.segments]
        out: dict[str, Any] = {"segments": segments, "device_traces": device_traces}
        if self.allocator_settings is not None:
            out["allocator_settings"] = self.allocator_settings
        if self.external_annotations is not None:
            out["external_annotations"] = self.external_annotations
        out.update(self.extra)
        if self.device_type is not None:
            out[META_KEY] = {"device_type": self.device_type}
        return out

    # -- data checks ---------------------------------------------------------------------------
    def validate(self, max_messages: int = 100) -> TraceReport:
        """Check the events for data-level problems without changing anything.

        Errors: a free of an address that is not live and lies in no known segment (never
        allocated), a double free, an alloc over a live block, a ``free_completed`` with no
        ``free_requested``, a ``segment_free`` of an unknown segment. Frees of blocks that were
        live when a mid-run recording began are counted in ``pre_existing_frees``, not errors.
        """
        report = TraceReport()

        def add(kind: list[str], message: str) -> None:
            if len(report.errors) + len(report.warnings) < max_messages:
                kind.append(message)
            else:
                report.truncated += 1

        for device, a in enumerate(self.device_traces):
            validate_device(self, device, a, report, add)
        return report

    def derive_segments(self) -> list[dict[str, Any]]:
        """Final segments reconstructed from the events alone (for traces recorded from empty).

        Segments come from ``segment_alloc``/``segment_free`` and, for expandable segments, from
        the mapped ranges of ``segment_map``/``segment_unmap`` (one segment per contiguous
        range). Live blocks are placed at their addresses with their requested size rounded up
        to 512 bytes; the gaps become inactive blocks, so the blocks tile each segment exactly.
        """
        out = []
        for device, a in enumerate(self.device_traces):
            out.extend(derive_device_segments(device, a))
        return out


def _array_from_named(events: np.ndarray) -> np.ndarray:
    """Events from a structured array with named fields (the engine's drained array, or ours)."""
    if events.dtype == TRACE_DTYPE:
        return events.copy()
    names = set(events.dtype.names or ())
    missing = {"action", "addr", "size"} - names
    if missing:
        raise ValueError(f"event array lacks fields {sorted(missing)}")
    if "seq" in names:
        events = events[np.argsort(events["seq"], kind="stable")]
    codes = events["action"].astype(np.int64)
    if len(codes) and (codes.min() < 0 or codes.max() >= len(ACTIONS)):
        raise ValueError(f"action codes must be 0..{len(ACTIONS) - 1}")
    out = np.zeros(len(events), TRACE_DTYPE)
    out["action"] = codes
    out["addr"], out["size"] = events["addr"], events["size"]
    for ours, theirs in (("stream", "stream"), ("pool", "pool_id"), ("pool", "pool")):
        if theirs in names:
            out[ours] = events[theirs]
    out["time_us"] = events["time_us"] if "time_us" in names else NO_TIME
    out["frames"] = NO_FRAMES
    return out


def _array_from_tuples(rows: list[Sequence[int]]) -> np.ndarray:
    """Events from ``(action, addr, size, stream, pool[, seq])`` tuples, ordered by ``seq``."""
    if any(len(r) not in (5, 6) for r in rows):
        raise ValueError("events must be (action, addr, size, stream, pool[, seq]) tuples")
    if rows and len(rows[0]) == 6:
        rows = sorted(rows, key=lambda r: r[5])
    array = np.zeros(len(rows), TRACE_DTYPE)
    if rows:
        cols = list(zip(*rows, strict=True))
        try:
            codes = np.array(cols[0], np.int64)
            if ((codes < 0) | (codes >= len(ACTIONS))).any():
                raise ValueError(f"action codes must be 0..{len(ACTIONS) - 1}")
            array["action"] = codes
            array["addr"] = np.array(cols[1], np.uint64)
            array["size"] = np.array(cols[2], np.uint64)
            array["stream"] = np.array(cols[3], np.int64)
            array["pool"] = np.array(cols[4], np.int64)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"event field out of range: {e}") from None
    array["frames"] = NO_FRAMES
    array["time_us"] = NO_TIME
    return array


def strip_frames(seg: dict[str, Any]) -> dict[str, Any]:
    """A copy of a snapshot segment with its and its blocks' stack frames dropped."""
    out = dict(seg, frames=[])
    out["blocks"] = [dict(b, frames=[]) if "frames" in b else dict(b) for b in seg["blocks"]]
    return out


#: Frame paths of vendor extensions whose allocators have no profile here (device names).
FOREIGN_EXTENSIONS = {"torch_mlu": "mlu", "torch_musa": "musa", "torch_gcu": "gcu",
                       "torch_dipu": "dipu", "torch_xla": "xla", "habana_frameworks": "hpu"}


def foreign_device(snapshot: object, trace: Trace) -> str | None:
    """A device the snapshot names or implies that is not one of DEVICE_TYPES, else None."""
    meta = snapshot.get(META_KEY) if isinstance(snapshot, dict) else None
    named = meta.get("device_type") if isinstance(meta, dict) else None
    if isinstance(named, str) and named and named not in DEVICE_TYPES:
        return named[:40]
    for stack in trace.stacks[:200]:
        for f in stack:
            path = str(f.get("filename", "")) if isinstance(f, dict) else ""
            for ext, name in FOREIGN_EXTENSIONS.items():
                if ext in path:
                    return name
    return None


def infer_device_type(trace: Trace) -> str | None:
    """Guess the device family from what a recording leaves behind (frames, settings)."""
    settings = trace.allocator_settings or {}
    if any("HIP" in str(k) for k in settings):
        return "rocm"
    names = set()
    for stack in trace.stacks[:200]:
        for f in stack:
            names.add(str(f.get("filename", "")))
    for s in trace.segments[:50]:
        for f in s.get("frames", [])[:20] if isinstance(s.get("frames"), list) else []:
            if isinstance(f, dict):
                names.add(str(f.get("filename", "")))
    text = "\n".join(names)
    if "torch_npu" in text:
        return "npu"
    if "/torch/xpu/" in text or "intel_extension_for_pytorch" in text:
        return "xpu"
    # Ascend rounds (request + 32) up to 512 bytes, so a small block whose request is a
    # multiple of 512 is 512 bytes bigger than requested; CUDA, ROCm and XPU give it exactly.
    # (Small-pool blocks always split off remainders >= 512. roundup_power2_divisions can round
    # some such requests up on CUDA, but never all of them, hence "every one of several".)
    slack = []
    for seg in trace.segments:
        for b in seg.get("blocks", ()):
            req = b.get("requested_size")
            if b.get("state") == "active_allocated" and isinstance(req, int) and 0 < req < 1 << 20:
                if req % 512 == 0 and isinstance(b.get("size"), int):
                    slack.append(b["size"] - req)
    if len(slack) >= 8 and set(slack) == {512}:
        return "npu"
    if "/torch/cuda/" in text or "PYTORCH_CUDA_ALLOC_CONF" in settings:
        return "cuda"
    return None

