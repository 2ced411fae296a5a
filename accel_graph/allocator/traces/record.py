"""The event record, trace limits and format sniffing: what every trace format module shares.

The event record (:data:`TRACE_DTYPE`) is the in-memory and on-disk (compact format) layout of
one allocator event. It is a fixed 48-byte little-endian C struct so that the C engine can
read an array of them directly::

    struct event { uint8_t action; uint8_t pad[3]; int32_t frames;
                   uint64_t addr; uint64_t size; int64_t stream; int64_t time_us; int64_t pool; };

``action`` is a code from :data:`accel_graph.allocator.traces.actions.ACTIONS`; ``frames`` indexes the
trace's interned stacks (-1: none); ``addr`` holds ``device_free`` for ``oom`` events (which have
no address); ``time_us`` is -1 when the recording had no timestamps.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import numpy as np

from ...errors import TraceFormatError
from ...foundation.gc_pause import gc_paused
from ..devices import DEVICE_TYPES

__all__ = [
    "COMPACT_MAGIC",
    "DEFAULT_LIMITS",
    "DEVICE_TYPES",
    "FORMATS",
    "META_KEY",
    "NO_FRAMES",
    "NO_TIME",
    "TRACE_DTYPE",
    "TraceLimits",
    "bulk_objects",
    "show",
    "sniff_format",
]


TRACE_DTYPE = np.dtype(
    {
        "names": ["action", "frames", "addr", "size", "stream", "time_us", "pool"],
        "formats": ["u1", "<i4", "<u8", "<u8", "<i8", "<i8", "<i8"],
        "offsets": [0, 4, 8, 16, 24, 32, 40],
        "itemsize": 48,
    }
)
NO_FRAMES = -1
NO_TIME = -1

#: Leading bytes of the compact binary format (the 0x89 catches text-mode mangling, as in PNG).
COMPACT_MAGIC = b"\x89AGTRACE"
#: Top-level key under which our writers record what torch's format has no place for.
META_KEY = "accel_graph"

FORMATS = ("pickle", "json", "compact")


@dataclass(frozen=True)
class TraceLimits:
    """Upper bounds a loader enforces before it trusts a file; raise them for huge traces.

    A pickle can expand to many times its size in memory, so ``max_file_bytes`` is the main
    guard; the others turn absurd values into clear errors instead of silent nonsense.
    """

    max_file_bytes: int = 4 << 30
    max_events: int = 500_000_000
    max_devices: int = 4096
    max_segments: int = 50_000_000
    max_blocks: int = 500_000_000
    max_stack_depth: int = 100_000
    #: No allocation, segment or free-memory figure can exceed this many bytes (1 PiB).
    max_bytes_value: int = 1 << 50
    max_nesting: int = 64
    #: A pickle or JSON file may build at most this many bytes of objects per byte of file, as
    #: estimated before decoding (genuine snapshots: 9-13 for pickles, 3-4 for JSON), plus
    #: ``decode_slack_bytes``.
    max_decode_expansion: int = 16
    decode_slack_bytes: int = 48 << 20
    #: Plain data kept verbatim (settings, annotations, segments, unknown keys) may repeat shared
    #: sub-objects (a pickle's memo) to at most this many times its distinct size, plus
    #: ``plain_slack_units``: what a JSON writer would print stays in proportion to the file.
    max_plain_expansion: int = 128
    plain_slack_units: int = 1 << 20

    def check_decode_size(self, estimate: int, nbytes: int, source: str, what: str) -> None:
        """Refuse a file whose ``estimate`` of decoded bytes is out of proportion to its
        ``nbytes`` (more than ``max_decode_expansion`` times plus ``decode_slack_bytes``), before
        anything is decoded. ``what`` names the format in the message ("pickle", "JSON")."""
        allowed = self.max_decode_expansion * nbytes + self.decode_slack_bytes
        if estimate > allowed:
            raise TraceFormatError(
                f"{source}: decoding these {nbytes} bytes of {what} would build about "
                f"{estimate >> 20} MiB of objects, more than the {allowed >> 20} MiB allowed "
                f"({self.max_decode_expansion}x the file plus slack; genuine snapshots need "
                "3-13x); the file is corrupt or hostile. If it is genuine, pass "
                "limits=TraceLimits(max_decode_expansion=...)."
            )


DEFAULT_LIMITS = TraceLimits()


#: GLOBAL (``c``) or INST (``i``) with its two newline-terminated names: how a protocol 0/1
#: pickle that calls something starts.
_PICKLE_GLOBAL = re.compile(rb"[ci][A-Za-z_][\w.]{0,40}\n[A-Za-z_][\w.]{0,40}\n")


def sniff_format(head: bytes) -> str | None:
    """Guess a file's format from its first bytes: "compact", "json", "pickle" or None."""
    if head.startswith(COMPACT_MAGIC):
        return "compact"
    stripped = head.lstrip(b" \t\r\n")
    if stripped[:1] in (b"{", b"["):
        return "json"
    if head[:1] == b"\x80" or head[:1] in (b"(", b"]", b"}"):
        return "pickle"  # protocol >= 2 starts with PROTO; 0/1 with MARK or an empty container
    if _PICKLE_GLOBAL.match(head):
        # protocol 0/1 opening with GLOBAL/INST (``cos\nsystem\n``): a pickle that names a
        # global, refused as hostile by the unpickler rather than called an unknown format
        return "pickle"
    return None


def show(value: int) -> str:
    """An integer for a message: in full up to 30 digits, else its size (str() of an integer over
    4,300 digits raises, and a message should not be pages long)."""
    if -(10**30) < value < 10**30:
        return str(value)
    return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"


def bulk_objects() -> contextlib.AbstractContextManager[None]:
    """Pause the cyclic garbage collector while millions of acyclic dicts are built or read.

    Each container allocation counts towards a collection, and collections walk every live
    object: for a million-event snapshot that is most of the time spent. Nothing built here is
    cyclic, and the previous state is restored even on error.
    """
    return gc_paused()
