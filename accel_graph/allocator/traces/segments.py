"""Data checks and derived segments of a :class:`~.model.Trace`: what the events imply.

:func:`validate_device` is the per-device walk behind :meth:`Trace.validate`;
:func:`derive_device_segments` the one behind :meth:`Trace.derive_segments`;
:func:`segments_from_layout` turns an engine layout into snapshot segments.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .actions import ACTION_CODE, ACTIONS
from .record import NO_TIME

__all__ = ["TraceReport", "WithSegments", "derive_device_segments", "segments_from_layout",
           "validate_device"]

# Data checks and derived segments


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


class WithSegments(Protocol):
    """What the data checks read of a :class:`~.model.Trace` besides its events: the final
    segments (a protocol, so that this module, below the model, needs no import of it)."""

    segments: list[dict[str, Any]]


def _segment_ranges(trace: WithSegments, device: int) -> list[tuple[int, int]]:
    return [
        (int(s["address"]), int(s["address"]) + int(s["total_size"]))
        for s in trace.segments
        if int(s.get("device", 0)) == device
    ]


def validate_device(
    trace: WithSegments,
    device: int,
    a: np.ndarray,
    report: TraceReport,
    add: Callable[[list[str], str], None],
) -> None:
    """Check device ``device``'s events ``a`` against each other and ``trace``'s final segments.

    Findings go to ``report`` through ``add(report.errors or report.warnings, message)`` (the
    caller caps how many are kept); ``report``'s counters are updated in place.
    """
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
        elif code == codes["annotate"] and addr not in live and addr in touched:
            # torch annotates live allocations only; an untouched address may be a block
            # allocated before the recording began
            add(report.warnings, f"{where}: annotates a block that was freed (not live)")


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


def derive_device_segments(device: int, a: np.ndarray) -> list[dict[str, Any]]:
    """The final segments of device ``device`` implied by its events ``a`` alone (see
    :meth:`Trace.derive_segments <accel_graph.allocator.traces.model.Trace.derive_segments>`)."""
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

