"""The compact binary trace format: a small JSON header and raw event arrays, no stack frames.

Layout (all integers little-endian)::

    0   8 bytes  magic  b"\\x89AGTRACE"
    8   u32      format version (1)
    12  u32      header length H (bytes of UTF-8 JSON)
    16  u64      payload length P (bytes)
    24  u32      CRC-32 of the payload
    28  u32      CRC-32 of the header
    32  H bytes  header JSON: {"event_itemsize": 48, "event_counts": [n per device index], ...}
    ... zero padding up to a multiple of 64
    P bytes      the events of device 0, then device 1, ..., each an array of TRACE_DTYPE

The header also carries the trace's metadata (device type, final segments without frames,
allocator settings). Loading is a bounds check, two CRCs and ``np.frombuffer``: no per-event
Python work, so a million events load in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

from ...errors import TraceFormatError
from .actions import ACTIONS
from .record import COMPACT_MAGIC, TRACE_DTYPE, TraceLimits

__all__ = ["VERSION", "decode", "encode"]

VERSION = 1
_FIXED = struct.Struct("<8sIIQII")  # magic, version, header length, payload length, crc, crc
_ALIGN = 64
_MAX_HEADER = 1 << 30


def _padding(header_len: int) -> int:
    return -(_FIXED.size + header_len) % _ALIGN


def encode(header: dict[str, Any], arrays: list[np.ndarray]) -> list[bytes | memoryview]:
    """The file's bytes as a list of chunks (so large arrays are written without a copy)."""
    for a in arrays:
        if a.dtype != TRACE_DTYPE:
            raise TypeError(f"event arrays must have TRACE_DTYPE, got {a.dtype}")
    header = dict(
        header, event_itemsize=TRACE_DTYPE.itemsize, event_counts=[len(a) for a in arrays]
    )
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    payload = [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
    crc = 0
    for chunk in payload:
        crc = zlib.crc32(chunk, crc)
    size = sum(len(c) for c in payload)
    fixed = _FIXED.pack(COMPACT_MAGIC, VERSION, len(head), size, crc, zlib.crc32(head))
    return [fixed, head, b"\0" * _padding(len(head)), *payload]


def decode(
    data: bytes | bytearray | memoryview, source: str, limits: TraceLimits
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Check and split a compact file: its header dict and one event array per device index.

    The arrays are views into ``data`` (no copy). Raises :class:`TraceFormatError` for any
    truncation, corruption or out-of-range value.
    """
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise TraceFormatError(f"{source}: compact trace truncated inside its fixed header.")
    magic, version, head_len, payload_len, crc, head_crc = _FIXED.unpack_from(view)
    if magic != COMPACT_MAGIC:
        raise TraceFormatError(f"{source}: not a compact trace (bad magic {bytes(magic)!r}).")
    if version != VERSION:
        raise TraceFormatError(
            f"{source}: compact trace version {version}; this accel-graph reads version "
            f"{VERSION}. Re-save it with a matching accel-graph."
        )
    if head_len > _MAX_HEADER:
        raise TraceFormatError(f"{source}: absurd header length {head_len}; the file is corrupt.")
    start = _FIXED.size + head_len + _padding(head_len)
    expected = start + payload_len
    if len(view) != expected:
        raise TraceFormatError(_size_mismatch(view, source, start, payload_len))
    head = bytes(view[_FIXED.size : _FIXED.size + head_len])
    if zlib.crc32(head) != head_crc:
        raise TraceFormatError(f"{source}: compact trace header is corrupt (CRC mismatch).")
    payload = view[start:]
    if zlib.crc32(payload) != crc:
        raise TraceFormatError(f"{source}: compact trace events are corrupt (CRC mismatch).")
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(f"{source}: compact trace header is not valid JSON ({e}).") from None
    if not isinstance(header, dict):
        raise TraceFormatError(f"{source}: compact trace header is not a JSON object.")
    counts = header.get("event_counts")
    if header.get("event_itemsize") != TRACE_DTYPE.itemsize or not (
        isinstance(counts, list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    ):
        raise TraceFormatError(
            f"{source}: compact trace header lacks valid 'event_itemsize'/'event_counts'."
        )
    if len(counts) > limits.max_devices or sum(counts) > limits.max_events:
        raise TraceFormatError(
            f"{source}: {len(counts)} devices / {sum(counts)} events exceed the limits "
            f"({limits.max_devices} / {limits.max_events}); pass larger TraceLimits if genuine."
        )
    if sum(counts) * TRACE_DTYPE.itemsize != payload_len:
        raise TraceFormatError(
            f"{source}: event counts {counts} do not match the payload of {payload_len} bytes."
        )
    arrays = []
    offset = 0
    for n in counts:
        arrays.append(np.frombuffer(payload, dtype=TRACE_DTYPE, count=n, offset=offset))
        offset += n * TRACE_DTYPE.itemsize
    for device, a in enumerate(arrays):
        check_event_array(a, f"{source}: device {device}", limits)
    return header, arrays


def _size_mismatch(view: memoryview, source: str, start: int, payload_len: int) -> str:
    """The message for a file whose size is not what its fixed header says, in events.

    A reader acts on events, not bytes: "truncated: 114 bytes, header promises 128" left them
    to work out that the header's event count and the events present disagree. The header JSON
    is read best-effort here (it may itself be cut or corrupt: then only the payload's own
    length field is used), never trusted beyond this message.
    """
    itemsize = TRACE_DTYPE.itemsize
    present = max(0, len(view) - start)
    short = len(view) < start + payload_len
    promised = _promised_events(view, start)
    if promised is None:
        # the header is unreadable: the fixed field's payload length is all there is
        promised_text = f"a payload of {payload_len} bytes ({payload_len / itemsize:g} events)"
    else:
        promised_text = f"{promised} events ({promised * itemsize} bytes of payload)"
    held = present // itemsize
    partial = f" and {present % itemsize} stray bytes" if present % itemsize else ""
    what = "truncated" if short else "has trailing bytes"
    return (
        f"{source}: compact trace {what}: the event count and the payload disagree: the "
        f"header promises {promised_text}, the payload holds {held} events{partial} "
        f"({present} bytes; file {len(view)} bytes, expected {start + payload_len}). "
        "Re-copy or re-save it."
    )


def _promised_events(view: memoryview, start: int) -> int | None:
    """The header's total event count, or None when the header cannot be read as one."""
    if len(view) < start:
        return None
    try:
        header = json.loads(bytes(view[_FIXED.size : start]).rstrip(b"\0"))
        counts = header["event_counts"]
        total = sum(counts)
    except (ValueError, RecursionError, KeyError, TypeError):
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        return None
    return total


def check_event_array(a: np.ndarray, where: str, limits: TraceLimits) -> None:
    """Vectorised range checks on an event array (unknown actions, absurd sizes, frames ids)."""
    if not len(a):
        return
    bad = np.flatnonzero(a["action"] >= len(ACTIONS))
    if len(bad):
        raise TraceFormatError(
            f"{where}: event {bad[0]} has unknown action code {a['action'][bad[0]]} "
            f"(known: 0..{len(ACTIONS) - 1} = {', '.join(ACTIONS)})."
        )
    bad = np.flatnonzero(a["size"] > limits.max_bytes_value)
    if len(bad):
        raise TraceFormatError(
            f"{where}: event {bad[0]} has an absurd size {a['size'][bad[0]]} bytes "
            f"(limit {limits.max_bytes_value}); the trace is corrupt."
        )
    # addresses below 2^63, as every loader's (torch_snapshot._ADDR_MAX): analyses use int64
    bad = np.flatnonzero(a["addr"] > np.uint64((1 << 63) - 1))
    if len(bad):
        raise TraceFormatError(
            f"{where}: event {bad[0]} has an absurd address {int(a['addr'][bad[0]]):#x} "
            f"(limit 2^63 - 1; no device hands out such addresses); the trace is corrupt."
        )
    bad = np.flatnonzero(a["frames"] < -1)
    if len(bad):
        raise TraceFormatError(f"{where}: event {bad[0]} has an invalid frames index.")
