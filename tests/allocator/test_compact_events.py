"""Issue 29 item 6: a compact trace whose size disagrees with its header is described in events.

"truncated: 114 bytes, header promises 128" left the reader to work out that the header's event
count and the payload disagree; the message now says so, with both numbers in events.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from accel_graph.allocator.traces import Trace, load_trace, save_trace
from accel_graph.allocator.traces.actions import ACTION_CODE as C
from accel_graph.allocator.traces.record import TRACE_DTYPE
from accel_graph.errors import TraceFormatError

MIB = 1 << 20
FIXED = struct.Struct("<8sIIQII")


def compact_bytes(tmp_path: Path) -> bytes:
    rows = [
        (C["segment_alloc"], 1 << 40, 2 * MIB, 0, 0),
        (C["alloc"], 1 << 40, 100, 0, 0),
        (C["free_requested"], 1 << 40, 100, 0, 0),
        (C["free_completed"], 1 << 40, 100, 0, 0),
    ]
    path = tmp_path / "t.agt"
    save_trace(Trace.from_events(rows), path)
    return path.read_bytes()


def refused(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "bad.agt"
    path.write_bytes(data)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    return str(info.value)


def test_cut_payload_is_described_in_events(tmp_path: Path) -> None:
    data = compact_bytes(tmp_path)
    cut = data[: len(data) - TRACE_DTYPE.itemsize - 14]  # one event and part of another gone
    message = refused(tmp_path, cut)
    assert "event count and the payload disagree" in message, message
    assert "header promises 4 events" in message, message
    assert "payload holds 2 events and" in message, message
    assert "stray bytes" in message, message


def test_header_promising_more_events_than_the_payload_holds(tmp_path: Path) -> None:
    # a header rewritten to promise one event more (with a consistent payload length field),
    # over the original payload: the case of the adversarial round
    data = compact_bytes(tmp_path)
    magic, version, head_len, payload_len, crc, _ = FIXED.unpack_from(data)
    head = json.loads(data[FIXED.size : FIXED.size + head_len])
    assert head["event_counts"] == [4]
    start = FIXED.size + head_len + (-(FIXED.size + head_len) % 64)
    payload = data[start:]
    head["event_counts"] = [5]
    new_head = json.dumps(head, separators=(",", ":")).encode()
    pad = b"\0" * (-(FIXED.size + len(new_head)) % 64)
    fixed = FIXED.pack(
        magic, version, len(new_head), payload_len + TRACE_DTYPE.itemsize, crc,
        zlib.crc32(new_head),
    )  # fmt: skip
    message = refused(tmp_path, fixed + new_head + pad + payload)
    assert "truncated" in message and "event count and the payload disagree" in message
    assert "header promises 5 events" in message, message
    assert "payload holds 4 events (" in message, message


def test_trailing_bytes_and_unreadable_header(tmp_path: Path) -> None:
    data = compact_bytes(tmp_path)
    message = refused(tmp_path, data + bytes(TRACE_DTYPE.itemsize))
    assert "has trailing bytes" in message and "payload holds 5 events" in message, message
    assert "header promises 4 events" in message, message
    # header cut too: only the fixed field's payload length is left, still stated in events
    message = refused(tmp_path, data[: FIXED.size + 10])
    assert "event count and the payload disagree" in message, message
    assert f"a payload of {4 * TRACE_DTYPE.itemsize} bytes (4 events)" in message, message
