"""PyTorch memory snapshots in and out: the checked conversion between torch's snapshot dicts
(untrusted input) and event arrays of :data:`~.record.TRACE_DTYPE`.

:func:`read_snapshot` checks every value it keeps (the value checks are
:mod:`.snapshot_values`') and raises :class:`TraceFormatError` for anything that is not plain
snapshot data; :func:`~.snapshot_entries.events_to_entries` (in :mod:`.snapshot_entries`)
writes one device's events back as torch's trace-entry dicts.

What each torch writes, and what is read here (field names from torch 2.14.1's
``torch/cuda/memory.py`` ``_snapshot`` docstring, ``torch/cuda/_memory_viz.py`` and
``c10/core/CachingDeviceAllocator.h``):

- ``segments``, ``device_traces`` (one event list per device), ``allocator_settings``,
  ``external_annotations``: every torch since 2.1.
- Trace entries: ``action``, ``addr`` (``device_free`` for ``oom``), ``size``, ``stream``,
  ``time_us``, ``frames``; newer ones ``pool_id``, ``compile_context`` and ``user_metadata``
  (the calling thread's ``_set_memory_metadata`` string: per thread since 2.14). Keys beyond
  the first six are kept per event (``event_extras``) and written back.
- ``annotate`` (torch 2.14, ``_annotate_tensor``): metadata attached to a live allocation
  after the fact; ``addr`` is the allocation's base address and ``user_metadata`` the text.
  It is an event like the others (code ``A_ANNOTATE``) that allocates and frees nothing.
- ``host_segments``/``host_traces`` (torch 2.14, ``_record_memory_history(
  record_pinned_host_memory=True)``): the pinned host allocator's segments and events. They
  must be lists; they are kept verbatim (``extra``) and are not device memory, so no replay
  reads them (:func:`host_memory_counts` says how much a snapshot holds).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np

from .actions import ACTION_CODE, ACTIONS
from .record import DEVICE_TYPES, META_KEY, NO_FRAMES, NO_TIME, TRACE_DTYPE, TraceLimits
from .snapshot_values import ADDR_MAX, INT64_MAX, INT64_MIN, SnapshotValueChecker, Stack

__all__ = [
    "BLOCK_STATES",
    "HOST_KEYS",
    "SnapshotParts",
    "Stack",
    "host_memory_counts",
    "read_snapshot",
]


BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")
#: torch 2.14's pinned host memory records (top-level lists; not device memory).
HOST_KEYS = ("host_segments", "host_traces")
_EVENT_KEYS = frozenset({"action", "addr", "size", "stream", "time_us", "frames", "device_free"})
_OOM = ACTION_CODE["oom"]


def host_memory_counts(extra: dict[str, Any]) -> dict[str, int] | None:
    """``{"host_segments": n, "host_traces": m}`` for a snapshot's kept top-level keys
    (``Trace.extra``), None when it has neither (a torch before 2.14, or host recording off
    and the keys absent). Both are lists once :func:`read_snapshot` accepted them."""
    if not any(k in extra for k in HOST_KEYS):
        return None
    return {k: len(extra.get(k) or []) for k in HOST_KEYS}


class SnapshotParts(NamedTuple):
    """The checked contents of a snapshot object (see :class:`~.model.Trace` fields)."""

    device_traces: list[np.ndarray]
    segments: list[dict[str, Any]]
    allocator_settings: dict[str, Any] | None
    device_type: str | None
    stacks: list[Stack]
    external_annotations: list[Any] | None
    event_extras: dict[tuple[int, int], dict[str, Any]]
    extra: dict[str, Any]


def read_snapshot(obj: object, source: str, limits: TraceLimits) -> SnapshotParts:
    """Check an untrusted snapshot object (dict format or legacy list) and convert it.

    Raises :class:`TraceFormatError` for anything that is not plain snapshot data.
    """
    return _SnapshotReader(source, limits).read(obj)


class _SnapshotReader(SnapshotValueChecker):
    """Turns an untrusted snapshot object into a Trace, checking every value it keeps."""

    def read(self, obj: object) -> SnapshotParts:
        if isinstance(obj, list):  # legacy format: torch.cuda.memory_snapshot() segments only
            obj = {"segments": obj}
        if not isinstance(obj, dict):
            raise self.fail("top level", f"expected a dict or a list, got {type(obj).__name__}")
        if "segments" not in obj and "device_traces" not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:10])
            raise self.fail("top level", f"no 'segments' or 'device_traces' key (keys: {keys})")
        segments = self.segments(obj.get("segments", []))
        traces, extras = self.device_traces(obj.get("device_traces", []))
        settings = obj.get("allocator_settings")
        if settings is not None:
            if not isinstance(settings, dict):
                raise self.fail("allocator_settings", "expected a dict")
            self.expanded += self.plain(settings, "allocator_settings")
        annotations = obj.get("external_annotations")
        if annotations is not None:
            if not isinstance(annotations, list):
                raise self.fail("external_annotations", "expected a list")
            self.expanded += self.plain(annotations, "external_annotations")
        meta = obj.get(META_KEY)
        device_type = None
        if isinstance(meta, dict) and meta.get("device_type") in DEVICE_TYPES:
            device_type = meta["device_type"]
        for key in HOST_KEYS:  # torch 2.14: kept verbatim below, but they must be lists
            if key in obj and not isinstance(obj[key], list):
                raise self.fail(key, f"expected a list (torch's pinned host memory records), "
                                f"got {type(obj[key]).__name__}")
        known = {"segments", "device_traces", "allocator_settings", "external_annotations", META_KEY}
        extra = {k: v for k, v in obj.items() if k not in known}
        for k, v in extra.items():
            if not isinstance(k, str):
                raise self.fail("top level", f"non-string key {type(k).__name__}")
            self.expanded += self.plain(v, k[:80])
        limit = self.limits.max_plain_expansion * self.distinct + self.limits.plain_slack_units
        if self.expanded > limit:
            raise self.fail(
                "top level", f"the snapshot's metadata repeats shared objects (pickle memo "
                f"references) so that {self.distinct} units of data expand to {self.expanded}, "
                f"more than {self.limits.max_plain_expansion}x; a snapshot never does, and "
                "printing it would not end")
        return SnapshotParts(
            traces, segments, settings, device_type, self.stacks, annotations, extras, extra
        )

    def segments(self, segments: object) -> list[dict[str, Any]]:
        if not isinstance(segments, list):
            raise self.fail("segments", f"expected a list, got {type(segments).__name__}")
        if len(segments) > self.limits.max_segments:
            raise self.fail("segments", f"{len(segments)} segments exceed the limit")
        out = []
        blocks_seen = 0
        for i, seg in enumerate(segments):
            where = f"segments[{i}]"
            if not isinstance(seg, dict):
                raise self.fail(where, f"expected a dict, got {type(seg).__name__}")
            for key in ("address", "total_size", "blocks"):
                if key not in seg:
                    raise self.fail(where, f"missing '{key}'")
            self.integer(seg["address"], f"{where}.address", hi=ADDR_MAX)
            self.integer(seg["total_size"], f"{where}.total_size")
            for key in ("allocated_size", "active_size", "requested_size"):
                if key in seg:
                    self.integer(seg[key], f"{where}.{key}")
            if "device" in seg:
                self.integer(seg["device"], f"{where}.device", hi=self.limits.max_devices - 1)
            if "stream" in seg:
                self.integer(seg["stream"], f"{where}.stream", INT64_MIN, INT64_MAX)
            blocks = seg["blocks"]
            if not isinstance(blocks, list):
                raise self.fail(f"{where}.blocks", "expected a list")
            blocks_seen += len(blocks)
            if blocks_seen > self.limits.max_blocks:
                raise self.fail(where, "too many blocks")
            # Legacy snapshots (torch 1.x) give no block addresses: the blocks tile the segment.
            legacy = not any(isinstance(b, dict) and "address" in b for b in blocks)
            at = seg["address"]
            for j, b in enumerate(blocks):
                bw = f"{where}.blocks[{j}]"
                if not isinstance(b, dict):
                    raise self.fail(bw, f"expected a dict, got {type(b).__name__}")
                if "size" not in b:
                    raise self.fail(bw, "missing 'size'")
                self.integer(b["size"], f"{bw}.size")
                if "address" in b:
                    self.integer(b["address"], f"{bw}.address", hi=ADDR_MAX)
                elif not legacy:
                    raise self.fail(bw, "missing 'address' (other blocks of the segment have one)")
                if "requested_size" in b:
                    self.integer(b["requested_size"], f"{bw}.requested_size")
                if "state" in b and not isinstance(b["state"], str):
                    raise self.fail(f"{bw}.state", "expected a string")
            pool = seg.get("segment_pool_id")
            if isinstance(pool, (list, tuple)) and len(pool) == 2:  # torch: (0, n) or (uid, 0)
                for x in pool:
                    self.integer(x, f"{where}.segment_pool_id", hi=(1 << 31) - 1)
            elif pool is not None:
                self.integer(pool, f"{where}.segment_pool_id", INT64_MIN, INT64_MAX)
            seg = dict(seg)
            if isinstance(pool, list):  # JSON has no tuples; torch writes a 2-tuple
                seg["segment_pool_id"] = tuple(pool)
            if legacy and blocks:
                seg["blocks"] = blocks = [dict(b) for b in blocks]
                for b in blocks:
                    b["address"], at = at, at + b["size"]
                self.integer(at, f"{where}.blocks", hi=ADDR_MAX)
            self.expanded += self.plain(seg, where)
            out.append(seg)
        return out

    def device_traces(
        self, traces: object
    ) -> tuple[list[np.ndarray], dict[tuple[int, int], dict[str, Any]]]:
        if not isinstance(traces, list):
            raise self.fail("device_traces", f"expected a list, got {type(traces).__name__}")
        if len(traces) > self.limits.max_devices:
            raise self.fail("device_traces", f"{len(traces)} devices exceed the limit")
        # A pickle can name one list or dict many times (its memo): 12 KB became 8.2 million
        # events. torch never shares an event or a device's list, so each counts once or fails.
        shared = self.fail("device_traces", "the same event (or event list) appears more than "
                           "once by reference, which torch never writes (it would multiply)")
        lists = [t for t in traces if isinstance(t, list)]
        if len({id(t) for t in lists}) != len(lists):
            raise shared
        total = sum(map(len, lists))
        if total > self.limits.max_events:
            raise self.fail("device_traces", f"{total} events exceed the limit")
        ids = np.fromiter(map(id, itertools.chain.from_iterable(lists)), np.uint64, total)
        ids.sort()
        if total > 1 and bool((ids[1:] == ids[:-1]).any()):
            raise shared
        arrays = []
        extras: dict[tuple[int, int], dict[str, Any]] = {}
        for device, entries in enumerate(traces):
            if not isinstance(entries, list):
                raise self.fail(f"device_traces[{device}]", "expected a list of events")
            arrays.append(self.events(device, entries, extras))
        return arrays, extras

    def events(
        self, device: int, entries: list[Any], extras: dict[tuple[int, int], dict[str, Any]]
    ) -> np.ndarray:
        """One device's events. A column-at-a-time fast path handles well-formed data; on any
        doubt the per-event path runs instead and produces the precise error message."""
        fast = self.events_fast(device, entries, extras)
        return fast if fast is not None else self.events_checked(device, entries, extras)

    def events_fast(
        self, device: int, entries: list[Any], extras: dict[tuple[int, int], dict[str, Any]]
    ) -> np.ndarray | None:
        if not entries:
            return np.empty(0, TRACE_DTYPE)
        if set(map(type, entries)) != {dict}:
            return None
        try:
            codes = list(map(ACTION_CODE.get, [e.get("action") for e in entries]))
        except TypeError:  # an unhashable action
            return None
        if None in codes:
            return None
        addr = _column(entries, "addr", None)
        if _OOM in codes:
            for i in [i for i, c in enumerate(codes) if c == _OOM]:
                addr[i] = entries[i].get("device_free")
        size = _column(entries, "size", None)
        stream = _column(entries, "stream", 0)
        time_us = _column(entries, "time_us", None)
        pool = _column(entries, "pool_id", 0)
        absent = time_us.count(None)
        if absent:
            time_us = [NO_TIME if t is None else t for t in time_us]
        for column in (addr, size, stream, time_us, pool):
            if set(map(type, column)) != {int}:
                return None  # bool, float, None, str...: let the checked path say which
        try:
            out = np.empty(len(entries), TRACE_DTYPE)
            out["action"] = np.array(codes, np.uint8)
            out["addr"] = np.array(addr, np.uint64)
            out["size"] = sizes = np.array(size, np.uint64)
            out["stream"] = np.array(stream, np.int64)
            out["time_us"] = times = np.array(time_us, np.int64)
            out["pool"] = np.array(pool, np.int64)
        except OverflowError:
            return None
        if (int(sizes.max()) > self.limits.max_bytes_value or int(times.min()) < NO_TIME
                or int(out["addr"].max()) > ADDR_MAX):  # fmt: skip
            return None
        if int(np.count_nonzero(times == NO_TIME)) != absent:
            return None  # an explicit time_us of -1
        by_id, stack, where = self.stack_by_id, self.stack, f"device_traces[{device}]"
        frames = []
        for fr in _column(entries, "frames", None):
            if fr is None or fr == []:  # only an empty *list* equals []
                frames.append(NO_FRAMES)
            else:
                index = by_id.get(id(fr))
                frames.append(stack(fr, where) if index is None else index)
        out["frames"] = np.array(frames, np.int32)
        known = _EVENT_KEYS | {"pool_id"}
        for i in [i for i, e in enumerate(entries) if not known.issuperset(e)]:
            other = {k: v for k, v in entries[i].items() if k not in known}
            self.expanded += self.plain(other, f"device_traces[{device}][{i}]")
            extras[(device, i)] = other
        return out

    def events_checked(
        self, device: int, entries: list[Any], extras: dict[tuple[int, int], dict[str, Any]]
    ) -> np.ndarray:
        n = len(entries)
        # Python lists, converted once at the end: per-element numpy stores are slower.
        action, frames, addr, size, stream, time_us, pool = ([0] * n for _ in range(7))
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise self.fail(f"device_traces[{device}][{i}]", "expected an event dict")
            name = e.get("action")
            code = ACTION_CODE.get(name) if isinstance(name, str) else None
            if code is None:
                raise self.fail(
                    f"device_traces[{device}][{i}]",
                    f"unknown action {e.get('action')!r} (known: {', '.join(ACTIONS)})",
                )
            action[i] = code
            try:
                a = e["device_free"] if code == _OOM else e["addr"]
                s = e["size"]
            except KeyError as k:
                raise self.fail(f"device_traces[{device}][{i}]", f"missing {k}") from None
            if (type(a) is not int or type(s) is not int or not 0 <= a <= ADDR_MAX
                    or not 0 <= s <= self.limits.max_bytes_value):  # fmt: skip
                where = f"device_traces[{device}][{i}] ({ACTIONS[code]})"
                key = "device_free" if code == _OOM else "addr"
                self.integer(a, f"{where}.{key}", hi=ADDR_MAX)
                self.integer(s, f"{where}.size")
            addr[i], size[i] = a, s
            st = e.get("stream", 0)
            if type(st) is not int or not INT64_MIN <= st <= INT64_MAX:
                self.integer(st, f"device_traces[{device}][{i}].stream", INT64_MIN, INT64_MAX)
            stream[i] = st
            t = e.get("time_us")
            if t is None:
                t = NO_TIME
            elif type(t) is not int or not 0 <= t <= INT64_MAX:
                self.integer(t, f"device_traces[{device}][{i}].time_us", 0, INT64_MAX)
            time_us[i] = t
            p = e.get("pool_id", 0)
            if type(p) is not int:
                self.integer(p, f"device_traces[{device}][{i}].pool_id", INT64_MIN, INT64_MAX)
            pool[i] = p
            fr = e.get("frames")
            frames[i] = NO_FRAMES if fr is None else self.stack(fr, f"device_traces[{device}][{i}]")
            if len(e) > 2 and not _EVENT_KEYS.issuperset(e):
                other = {k: v for k, v in e.items() if k not in _EVENT_KEYS and k != "pool_id"}
                if other:
                    self.expanded += self.plain(other, f"device_traces[{device}][{i}]")
                    extras[(device, i)] = other
        out = np.empty(n, TRACE_DTYPE)
        out["action"], out["frames"] = np.array(action, np.uint8), np.array(frames, np.int32)
        try:
            out["addr"] = np.array(addr, np.uint64)
            out["size"] = np.array(size, np.uint64)
            out["stream"] = np.array(stream, np.int64)
            out["time_us"] = np.array(time_us, np.int64)
            out["pool"] = np.array(pool, np.int64)
        except OverflowError as e:
            raise self.fail(f"device_traces[{device}]", f"value out of range ({e})") from None
        return out


def _column(entries: list[dict[str, Any]], key: str, default: object) -> list[Any]:
    """``[e.get(key, default) for e in entries]``, but subscripting when every event has the key
    (a plain subscript is much cheaper than a method call, and a million events add up)."""
    try:
        return [e[key] for e in entries]
    except KeyError:
        return [e.get(key, default) for e in entries]
