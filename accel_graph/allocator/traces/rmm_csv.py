"""RMM's ``logging_resource_adaptor`` CSV as an allocator trace.

RMM (RAPIDS Memory Manager) logs one row per call through a logged memory resource, with the
header ``Thread,Time,Action,Pointer,Size,Stream`` (older releases omit ``Thread``). Actions are
``allocate``, ``free`` (``deallocate`` in some documentation) and ``allocate failure``. The log
is what the program asked of its allocator, so each row becomes a request in our trace:

- ``allocate`` -> ``alloc`` of ``Size`` bytes at ``Pointer``;
- ``free``/``deallocate`` -> ``free_requested`` and ``free_completed`` (RMM frees synchronously
  on the stream given);
- ``allocate failure`` -> ``oom``.

The log has no segments: the trace starts from an empty allocator (frees of pointers never
allocated in the log are treated as blocks that existed before it, as with snapshots). Times are
read as seconds (``1634567890.123456``) or a clock time (``15:23:22.123456`` or
``15:23:22:123456``); anything else leaves the trace without timestamps. Streams are the
logged stream handles, renumbered densely in order of first appearance.
"""

from __future__ import annotations

import csv
import io
import re
from typing import Any

import numpy as np

from ...errors import TraceFormatError
from .actions import ACTION_CODE
from .record import NO_FRAMES, NO_TIME, TRACE_DTYPE, TraceLimits, show

__all__ = ["is_rmm_csv", "read_rmm_csv"]

_REQUIRED = ("Action", "Pointer", "Size")
_ACTIONS = {
    "allocate": "alloc",
    "free": "free",
    "deallocate": "free",
    "allocate failure": "oom",
    "allocation failure": "oom",
}
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2}):(\d{2})[.:](\d{1,9})$")


def is_rmm_csv(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts with an RMM log header."""
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return text.startswith(b"thread,time,action,") or text.startswith(b"time,action,pointer,")


def _time_us(text: str) -> int | None:
    """Microseconds, or None (the trace then has no timestamps) for anything unreadable,
    negative, non-finite or beyond int64."""
    text = text.strip()
    m = _CLOCK.match(text)
    if m:
        h, mi, s, frac = m.groups()
        return ((int(h) * 60 + int(mi)) * 60 + int(s)) * 1_000_000 + int(frac.ljust(6, "0")[:6])
    try:
        value = float(text) * 1e6
    except ValueError:
        return None
    return int(round(value)) if 0 <= value < 2**62 else None  # nan and inf fail the test


def _int(text: str, what: str, where: str) -> int:
    try:
        return int(text.strip(), 0) if text.strip().lower().startswith("0x") else int(text)
    except ValueError:
        raise TraceFormatError(f"{where}: {what} {text[:40]!r} is not an integer or 0x-hex value "
                               "(of at most 4,300 digits).") from None


def read_rmm_csv(data: bytes, source: str = "<rmm csv>",
                 limits: TraceLimits | None = None) -> np.ndarray:
    """Parse an RMM log into one device's :data:`TRACE_DTYPE` event array.

    Raises :class:`TraceFormatError` naming the line for a missing column, an unknown action, a
    non-integer pointer or size, a negative or absurd size, or too many events.
    """
    limits = limits or TraceLimits()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{source}: not UTF-8 text at byte {e.start}; is this an RMM log?") from None
    try:
        return _parse(csv.reader(io.StringIO(text)), source, limits)
    except csv.Error as e:  # a field over csv.field_size_limit() (128 KiB), a NUL byte, ...
        raise TraceFormatError(f"{source}: not a readable RMM log CSV ({e}); no RMM log row "
                               "holds that.") from None


def _parse(reader: Any, source: str, limits: TraceLimits) -> np.ndarray:
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceFormatError(f"{source}: empty RMM log.") from None
    missing = [c for c in _REQUIRED if c not in header]
    if missing:
        raise TraceFormatError(
            f"{source}: RMM log header lacks {', '.join(missing)} (expected "
            "Thread,Time,Action,Pointer,Size,Stream)."
        )
    col = {name: header.index(name) for name in header}
    i_act, i_ptr, i_size = col["Action"], col["Pointer"], col["Size"]
    i_time, i_stream = col.get("Time"), col.get("Stream")
    rows: list[tuple[int, int, int, int, int]] = []
    streams: dict[str, int] = {}
    timed = i_time is not None
    for lineno, row in enumerate(reader, start=2):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        where = f"{source}: line {lineno}"
        if len(row) < len(header):
            raise TraceFormatError(f"{where}: {len(row)} fields, the header has {len(header)} "
                                   "(truncated file?).")
        kind = _ACTIONS.get(row[i_act].strip().lower())
        if kind is None:
            raise TraceFormatError(f"{where}: unknown action {row[i_act][:40]!r}; RMM logs "
                                   "allocate, free and allocate failure.")
        addr = _int(row[i_ptr], "pointer", where)
        size = _int(row[i_size], "size", where)
        # pointers below 2^63, as every loader's addresses (torch_snapshot._ADDR_MAX)
        if not 0 <= size <= limits.max_bytes_value or not 0 <= addr < 1 << 63:
            raise TraceFormatError(f"{where}: size {show(size)} or pointer {show(addr)} is out of "
                                   "range (sizes up to TraceLimits.max_bytes_value, pointers "
                                   "below 2^63).")
        stream = streams.setdefault(row[i_stream].strip(), len(streams)) if i_stream is not None else 0
        t = _time_us(row[i_time]) if timed else None
        if t is None:
            timed = False
        tu = t if t is not None else NO_TIME
        if kind == "free":
            rows.append((ACTION_CODE["free_requested"], addr, size, stream, tu))
            rows.append((ACTION_CODE["free_completed"], addr, size, stream, tu))
        else:
            rows.append((ACTION_CODE[kind], addr, size, stream, tu))
        if len(rows) > limits.max_events:
            raise TraceFormatError(f"{source}: more than {limits.max_events} events; raise "
                                   "TraceLimits.max_events if the file is genuine.")
    a = np.zeros(len(rows), TRACE_DTYPE)
    if rows:
        cols = np.array(rows, dtype=np.int64) if max(r[1] for r in rows) < 1 << 63 else None
        if cols is None:
            a["action"] = [r[0] for r in rows]
            a["addr"] = [r[1] for r in rows]
            a["size"] = [r[2] for r in rows]
            a["stream"] = [r[3] for r in rows]
            a["time_us"] = [r[4] for r in rows]
        else:
            a["action"], a["addr"], a["size"] = cols[:, 0], cols[:, 1], cols[:, 2]
            a["stream"], a["time_us"] = cols[:, 3], cols[:, 4]
    a["frames"] = NO_FRAMES
    if not timed:
        a["time_us"] = NO_TIME
    return a
