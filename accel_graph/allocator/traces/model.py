"""Allocator traces in memory, and PyTorch memory snapshots in and out.

:class:`Trace` holds what a memory snapshot holds, in a form the simulator can use directly:
per device, one numpy array of events (:data:`TRACE_DTYPE`), plus interned stack frames, the
final ``segments``, ``allocator_settings`` and the device type. It converts to and from
PyTorch's snapshot dict (the ``_dump_snapshot`` pickle that ``torch.cuda._memory_viz`` and
pytorch.org/memory_viz read), JSON, and the compact binary format of :mod:`.compact`.

:func:`load_trace` sniffs the format and returns a :class:`Trace`; :func:`save_trace` writes one
atomically. Loading never executes anything from the file and refuses truncated, corrupt or
hostile files with a :class:`TraceFormatError` that says what is wrong and what to do. Problems
in the *data* (a free of an address never allocated, ...) do not fail the load: see
:meth:`Trace.validate`.
"""

from __future__ import annotations

import bisect
import json
import os
import pickle
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import compact
from .actions import ACTION_CODE, ACTIONS
from .rmm_csv import is_rmm_csv, read_rmm_csv
from .safe_pickle import safe_loads
from .torch_snapshot import (
    DEFAULT_LIMITS,
    DEVICE_TYPES,
    FORMATS,
    META_KEY,
    NO_FRAMES,
    NO_TIME,
    TRACE_DTYPE,
    Stack,
    TraceFormatError,
    TraceLimits,
    bulk_objects,
    events_to_entries,
    read_snapshot,
    sniff_format,
)

__all__ = [
    "DEVICE_TYPES",
    "TRACE_DTYPE",
    "Trace",
    "TraceFormatError",
    "TraceLimits",
    "TraceReport",
    "load_trace",
    "save_trace",
    "segments_from_layout",
]


@dataclass
class TraceReport:
    """What :meth:`Trace.validate` found. ``ok`` is true when ``errors`` is empty."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Frees of blocks that were live before recording began (normal for mid-run recordings).
    pre_existing_frees: int = 0
    truncated: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


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
            trace.device_type = _infer_device_type(trace)
        if trace.device_type is None:
            trace.unsupported_device = _foreign_device(snapshot, trace)
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
        segments = self.segments if frames else [_strip_frames(s) for s in self.segments]
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
            _validate_device(self, device, a, report, add)
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
            out.extend(_derive_device_segments(device, a))
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


def _strip_frames(seg: dict[str, Any]) -> dict[str, Any]:
    out = dict(seg, frames=[])
    out["blocks"] = [dict(b, frames=[]) if "frames" in b else dict(b) for b in seg["blocks"]]
    return out


#: Frame paths of vendor extensions whose allocators have no profile here (device names).
_FOREIGN_EXTENSIONS = {"torch_mlu": "mlu", "torch_musa": "musa", "torch_gcu": "gcu",
                       "torch_dipu": "dipu", "torch_xla": "xla", "habana_frameworks": "hpu"}


def _foreign_device(snapshot: object, trace: Trace) -> str | None:
    """A device the snapshot names or implies that is not one of DEVICE_TYPES, else None."""
    meta = snapshot.get(META_KEY) if isinstance(snapshot, dict) else None
    named = meta.get("device_type") if isinstance(meta, dict) else None
    if isinstance(named, str) and named and named not in DEVICE_TYPES:
        return named[:40]
    for stack in trace.stacks[:200]:
        for f in stack:
            path = str(f.get("filename", "")) if isinstance(f, dict) else ""
            for ext, name in _FOREIGN_EXTENSIONS.items():
                if ext in path:
                    return name
    return None


def _infer_device_type(trace: Trace) -> str | None:
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


# ------------------------------------------------------------------------------------------
# Data checks and derived segments


def _segment_ranges(trace: Trace, device: int) -> list[tuple[int, int]]:
    return [
        (int(s["address"]), int(s["address"]) + int(s["total_size"]))
        for s in trace.segments
        if int(s.get("device", 0)) == device
    ]


def _validate_device(trace: Trace, device: int, a: np.ndarray, report: TraceReport, add) -> None:
    final_ranges = _segment_ranges(trace, device)
    seg_starts = {lo for lo, _ in final_ranges}
    live: dict[int, int] = {}
    pending: set[int] = set()
    freed: set[int] = set()
    segs: dict[int, int] = {}
    mapped: list[tuple[int, int]] = []
    touched: set[int] = set()
    codes = {name: ACTION_CODE[name] for name in ACTIONS}

    def in_known_segment(addr: int) -> bool:
        if any(lo <= addr < lo + size for lo, size in segs.items()):
            return True
        if any(lo <= addr < hi for lo, hi in mapped) or any(
            lo <= addr < hi for lo, hi in final_ranges
        ):
            return True
        return False

    last_time = -1
    act, addrs, sizes, times = (a[k].tolist() for k in ("action", "addr", "size", "time_us"))
    for i, (code, addr, size, t) in enumerate(zip(act, addrs, sizes, times, strict=True)):
        where = f"device {device} event {i} ({ACTIONS[code]} at {addr:#x})"
        if t != NO_TIME:
            if t < last_time:
                add(report.warnings, f"{where}: time_us goes backwards")
            last_time = t
        if code == codes["alloc"]:
            if addr in live:
                add(report.errors, f"{where}: allocates over a live block")
            live[addr] = size
            freed.discard(addr)
            touched.add(addr)
        elif code == codes["free_requested"]:
            if addr in live:
                del live[addr]
                pending.add(addr)
            elif addr in freed or addr in pending:
                add(report.errors, f"{where}: double free")
            elif addr not in touched and in_known_segment(addr):
                report.pre_existing_frees += 1
                pending.add(addr)
            else:
                add(report.errors, f"{where}: free of an address that was never allocated")
            touched.add(addr)
        elif code == codes["free_completed"]:
            if addr in pending:
                pending.discard(addr)
                freed.add(addr)
            else:
                add(report.errors, f"{where}: free_completed without a free_requested")
        elif code == codes["segment_alloc"]:
            segs[addr] = size
        elif code == codes["segment_free"]:
            if addr in segs:
                del segs[addr]
            elif addr in seg_starts or not final_ranges:
                pass  # a segment that existed before recording began
            else:
                add(report.errors, f"{where}: frees a segment that was never allocated")
        elif code == codes["segment_map"]:
            mapped.append((addr, addr + size))
        elif code == codes["segment_unmap"]:
            mapped = _subtract(mapped, addr, addr + size)


def _subtract(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo))
        if b > hi:
            out.append((hi, b))
    return out


def _merge(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge adjacent or overlapping (start, end, stream) ranges of the same stream."""
    out: list[tuple[int, int, int]] = []
    for lo, hi, st in sorted(ranges):
        if out and out[-1][2] == st and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi), st)
        else:
            out.append((lo, hi, st))
    return out


def _derive_device_segments(device: int, a: np.ndarray) -> list[dict[str, Any]]:
    segs: dict[int, tuple[int, int]] = {}
    mapped: list[tuple[int, int, int]] = []
    live: dict[int, tuple[int, str]] = {}
    c = ACTION_CODE
    act, addrs, sizes, streams = (a[k].tolist() for k in ("action", "addr", "size", "stream"))
    for code, addr, size, st in zip(act, addrs, sizes, streams, strict=True):
        if code == c["alloc"]:
            live[addr] = (size, "active_allocated")
        elif code == c["free_requested"] and addr in live:
            live[addr] = (live[addr][0], "active_pending_free")
        elif code == c["free_completed"]:
            live.pop(addr, None)
        elif code == c["segment_alloc"]:
            segs[addr] = (size, st)
        elif code == c["segment_free"]:
            segs.pop(addr, None)
        elif code == c["segment_map"]:
            mapped = _merge(mapped + [(addr, addr + size, st)])
        elif code == c["segment_unmap"]:
            mapped = [
                (p, q, s) for x, y, s in mapped for p, q in _subtract([(x, y)], addr, addr + size)
            ]
    ranges = [(lo, lo + size, st, False) for lo, (size, st) in segs.items()]
    ranges += [(lo, hi, st, True) for lo, hi, st in mapped]
    live_addrs = sorted(live)
    out = []
    for lo, hi, st, expandable in sorted(ranges):
        blocks = []
        cursor = lo
        allocated = requested = 0
        j = bisect.bisect_left(live_addrs, lo)
        while j < len(live_addrs) and live_addrs[j] < hi:
            addr = live_addrs[j]
            req, state = live[addr]
            nxt = live_addrs[j + 1] if j + 1 < len(live_addrs) else hi
            j += 1
            bsize = min(max(512, -(-req // 512) * 512), min(nxt, hi) - addr)
            if addr > cursor:
                blocks.append(_block(cursor, addr - cursor, 0, "inactive"))
            blocks.append(_block(addr, bsize, req, state))
            allocated += bsize
            requested += req
            cursor = addr + bsize
        if cursor < hi:
            blocks.append(_block(cursor, hi - cursor, 0, "inactive"))
        out.append(
            {
                "device": device,
                "address": lo,
                "total_size": hi - lo,
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": requested,
                "stream": st,
                "segment_type": "small" if hi - lo <= 2 << 20 else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    return out


def segments_from_layout(layout: Iterable[dict[str, Any]], device: int = 0) -> list[dict[str, Any]]:
    """Snapshot segments from an engine's ``layout()``, exactly as torch would report them.

    An expandable segment becomes one snapshot segment per contiguous mapped range (its
    ``unmapped`` blocks are left out), as in torch. The engine's integer pool id ``n`` is written
    as torch's pair ``(0, n)``.
    """
    out = []
    for seg in layout:
        runs: list[list[dict[str, Any]]] = [[]]
        for b in seg["blocks"]:
            if b["state"] == "unmapped":
                runs.append([])
            else:
                runs[-1].append(b)
        for run in runs:
            if not run:
                continue
            blocks = [
                _block(b["address"], b["size"], b.get("requested_size", 0), b["state"]) for b in run
            ]
            active = [b for b in blocks if b["state"] != "inactive"]
            allocated = [b for b in blocks if b["state"] == "active_allocated"]
            out.append(
                {
                    "device": device,
                    "address": run[0]["address"],
                    "total_size": sum(b["size"] for b in blocks),
                    "allocated_size": sum(b["size"] for b in allocated),
                    "active_size": sum(b["size"] for b in active),
                    "requested_size": sum(b["requested_size"] for b in active),
                    "stream": seg.get("stream", 0),
                    "segment_type": "small" if seg.get("is_small") else "large",
                    "segment_pool_id": (0, int(seg.get("pool_id", 0))),
                    "is_expandable": bool(seg.get("is_expandable")),
                    "frames": [],
                    "blocks": blocks,
                }
            )
    out.sort(key=lambda s: s["address"])
    return out


def _block(addr: int, size: int, requested: int, state: str) -> dict[str, Any]:
    return {
        "address": addr,
        "size": size,
        "requested_size": requested,
        "state": state,
        "frames": [],
    }


# ------------------------------------------------------------------------------------------
# Files


def load_trace(
    path: str | os.PathLike[str],
    *,
    device_type: str | None = None,
    limits: TraceLimits = DEFAULT_LIMITS,
) -> Trace:
    """Load a trace from a snapshot pickle (dict or legacy list), JSON, compact file or RMM
    ``logging_resource_adaptor`` CSV (:mod:`~accel_graph.allocator.traces.rmm_csv`).

    The format is sniffed from the content, not the name. ``device_type`` overrides what the
    file says or what is inferred. Raises :class:`TraceFormatError` (a ``ValueError``) for a
    missing, empty, truncated, corrupt, oversized or hostile file; nothing in it is executed.
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_file_bytes:
                raise TraceFormatError(
                    f"{source}: {size} bytes exceed the {limits.max_file_bytes}-byte limit; "
                    "pass limits=TraceLimits(max_file_bytes=...) if the file is trusted and genuine."
                )
            data = f.read(limits.max_file_bytes + 1)
            if len(data) > limits.max_file_bytes:
                raise TraceFormatError(f"{source}: the file grew past the size limit while read.")
    except OSError as e:
        raise TraceFormatError(f"{source}: cannot read the file ({e.strerror or e}).") from None
    if not data:
        raise TraceFormatError(f"{source}: the file is empty; re-record or re-copy it.")
    fmt = sniff_format(data[:64])
    if fmt is None and is_rmm_csv(data[:64]):
        events = read_rmm_csv(data, source, limits)
        return Trace([events], [], None, device_type or "cuda")
    if fmt is None:
        if data[:2] == b"\x1f\x8b":
            raise TraceFormatError(f"{source}: gzip-compressed; decompress it first (gunzip).")
        raise TraceFormatError(
            f"{source}: not a memory snapshot pickle, JSON trace, compact trace or RMM log CSV "
            f"(starts with {bytes(data[:8])!r})."
        )
    if fmt == "compact":
        trace = _from_compact(data, source, limits)
    else:
        with bulk_objects():
            obj = _json_loads(data, source) if fmt == "json" else safe_loads(data, source)
        trace = Trace.from_snapshot(obj, source, limits)
        del obj
    if device_type is not None:
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES}")
        trace.device_type = device_type
    return trace


def save_trace(trace: Trace, path: str | os.PathLike[str], format: str | None = None) -> None:
    """Write ``trace`` atomically as "pickle" (PyTorch's snapshot), "json" or "compact".

    ``format=None`` picks by suffix: ``.json`` is JSON, ``.agt``/``.compact`` is compact, anything
    else a pickle. The pickle opens in ``python -m torch.cuda._memory_viz`` and memory_viz. The
    compact format drops stack frames. A failed write leaves any existing file untouched.
    """
    if format is None:
        suffix = Path(path).suffix.lower()
        format = {".json": "json", ".agt": "compact", ".compact": "compact"}.get(suffix, "pickle")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    with bulk_objects():
        if format == "pickle":
            chunks: list[bytes | memoryview] = [pickle.dumps(trace.to_snapshot(), protocol=4)]
        else:
            try:
                if format == "json":
                    chunks = [json.dumps(_jsonable(trace.to_snapshot()), allow_nan=False).encode()]
                else:
                    chunks = _to_compact(trace)
            except ValueError as e:  # NaN or infinity somewhere in the metadata
                raise ValueError(
                    f"cannot write {os.fspath(path)} as {format}: the trace holds a value JSON "
                    f"cannot represent ({e}); save it as a pickle instead"
                ) from None
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (os.umask sets it, which
    would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _json_loads(data: bytes, source: str) -> object:
    def refuse_constant(name: str) -> object:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=refuse_constant)
    except UnicodeDecodeError:
        raise TraceFormatError(f"{source}: JSON trace is not valid UTF-8 (corrupt?).") from None
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(
            f"{source}: not valid JSON ({e}); the file is truncated or corrupt."
        ) from None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _to_compact(trace: Trace) -> list[bytes | memoryview]:
    arrays = []
    for a in trace.device_traces:
        if len(a) and (a["frames"] != NO_FRAMES).any():
            a = a.copy()
            a["frames"] = NO_FRAMES  # the compact format carries no stacks
        arrays.append(a)
    header = {
        "device_type": trace.device_type,
        "segments": _jsonable([_strip_frames(s) for s in trace.segments]),
        "allocator_settings": _jsonable(trace.allocator_settings),
        "external_annotations": _jsonable(trace.external_annotations),
        "extra": _jsonable(trace.extra),
    }
    return compact.encode(header, arrays)


def _from_compact(data: bytes, source: str, limits: TraceLimits) -> Trace:
    header, arrays = compact.decode(data, source, limits)
    if any(len(a) and (a["frames"] != NO_FRAMES).any() for a in arrays):
        raise TraceFormatError(f"{source}: compact trace events refer to stack frames it lacks.")
    meta = {
        "segments": header.get("segments") or [],
        "device_traces": [],
    }
    for key in ("allocator_settings", "external_annotations"):
        if header.get(key) is not None:
            meta[key] = header[key]
    extra = header.get("extra") or {}
    if not isinstance(extra, dict) or any(k in meta or k == META_KEY for k in extra):
        raise TraceFormatError(f"{source}: compact trace header has a malformed 'extra'.")
    meta.update(extra)
    base = Trace.from_snapshot(meta, source, limits)
    base.device_traces = arrays
    dt = header.get("device_type")
    base.device_type = dt if dt in DEVICE_TYPES else _infer_device_type(base)
    return base
