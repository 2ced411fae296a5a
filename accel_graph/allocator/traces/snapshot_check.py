"""Is a snapshot dict consistent enough for memory_viz? :func:`snapshot_problems` says what is not.

memory_viz's segment view rebuilds the allocator state at any event by undoing, from the final
segments backwards, every later event (torch/utils/viz/MemoryViz.js ``simulate_memory``), and
its timeline pairs each free with the last alloc at its address. That only works when the
events and the final segments tell one story. This check walks the same way and reports every
place where they do not:

- each final segment: its blocks tile it from its address (memory_viz places block ``i`` at
  the segment address plus the sizes of blocks ``0..i-1``), and its ``allocated_size``,
  ``active_size`` and ``requested_size`` are the sums of its blocks';
- undoing events backwards from the final state: an ``alloc`` undoes a live block, a
  ``free_requested`` one that is pending, a ``free_completed`` re-creates a block that is not
  there; a ``segment_alloc``/``segment_map`` undoes a segment (range) that exists and holds no
  live block; a ``segment_free``/``segment_unmap`` re-creates one that overlaps nothing; every
  block re-created lies inside a segment of that moment;
- the events' ``time_us`` (where present) never decrease.

It is a checker for files we write (a predicted snapshot) and for tests; it reads a plain dict
(``Trace.to_snapshot()`` or an unpickled file) and changes nothing. Cost: one pass over the
events with a bisect per event.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["snapshot_problems"]

_LIVE = ("active_allocated", "active_pending_free", "active_awaiting_free")


class _Ranges:
    """Disjoint address ranges (segments), sorted; expandable ones merge like memory_viz's."""

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []

    def containing(self, a: int, b: int) -> int:
        """Index of the range holding [a, b), -1 when none."""
        i = bisect.bisect_right(self.lo, a) - 1
        return i if i >= 0 and b <= self.hi[i] else -1

    def overlaps(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.lo, a) - 1
        if i >= 0 and self.hi[i] > a:
            return True
        return i + 1 < len(self.lo) and self.lo[i + 1] < b

    def add(self, a: int, b: int, merge: bool) -> None:
        i = bisect.bisect_left(self.lo, a)
        self.lo.insert(i, a)
        self.hi.insert(i, b)
        if merge:  # join touching ranges (a mapped expandable range)
            if i + 1 < len(self.lo) and self.lo[i + 1] == b:
                self.hi[i] = self.hi.pop(i + 1)
                self.lo.pop(i + 1)
            if i > 0 and self.hi[i - 1] == a:
                self.hi[i - 1] = self.hi.pop(i)
                self.lo.pop(i)

    def remove(self, a: int, b: int, merge: bool) -> bool:
        """Remove [a, b): the exact range (``merge`` False) or part of one; False if absent."""
        i = self.containing(a, b)
        if i < 0 or (not merge and (self.lo[i] != a or self.hi[i] != b)):
            return False
        lo, hi = self.lo.pop(i), self.hi.pop(i)
        for x, y in ((lo, a), (b, hi)):
            if y > x:
                self.add(x, y, False)
        return True


def _check_segments(segments: list[dict[str, Any]], problems: list[str]) -> None:
    for s in segments:
        addr, total = int(s["address"]), int(s["total_size"])
        blocks = s.get("blocks") or []
        cur = addr
        for b in blocks:
            if int(b["address"]) != cur:
                problems.append(f"segment {addr:#x}: block at {int(b['address']):#x} where the "
                                f"blocks before it end at {cur:#x}")
                break
            cur += int(b["size"])
        if cur != total + addr and not (problems and problems[-1].startswith(f"segment {addr:#x}")):
            problems.append(f"segment {addr:#x}: blocks sum to {cur - addr}, total_size {total}")
        sums = {
            "allocated_size": sum(int(b["size"]) for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(int(b["size"]) for b in blocks if b["state"] in _LIVE),
            "requested_size": sum(int(b["requested_size"]) for b in blocks if b["state"] in _LIVE),
        }
        for key, want in sums.items():
            if key in s and int(s[key]) != want:
                problems.append(f"segment {addr:#x}: {key} {int(s[key])}, its blocks sum to {want}")


def snapshot_problems(snapshot: dict[str, Any], device: int = 0, limit: int = 20) -> list[str]:
    """What makes ``snapshot`` (torch's snapshot dict) inconsistent for ``device``; [] when it
    is consistent. At most ``limit`` messages (the last one says how many more there were)."""
    problems: list[str] = []
    segments = [s for s in snapshot.get("segments", []) if int(s.get("device", 0)) == device]
    _check_segments(segments, problems)
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    ranges = _Ranges()
    live: dict[int, tuple[int, bool]] = {}  # block address -> (size, pending free)
    for s in sorted(segments, key=lambda s: int(s["address"])):
        a = int(s["address"])
        ranges.add(a, a + int(s["total_size"]), bool(s.get("is_expandable")))
        for b in s.get("blocks") or []:
            if b["state"] in _LIVE:
                live[int(b["address"])] = (int(b["size"]), b["state"] != "active_allocated")
    addrs = sorted(live)

    def inside_live(a: int, b: int) -> int | None:
        i = bisect.bisect_left(addrs, a)
        return addrs[i] if i < len(addrs) and addrs[i] < b else None

    def put(a: int, size: int, pending: bool, i: int, what: str) -> None:
        if a in live:
            problems.append(f"event {i} ({what} {a:#x}): the block is already live there")
            return
        if ranges.containing(a, a + max(size, 1)) < 0:
            problems.append(f"event {i} ({what} {a:#x}, {size} bytes): outside every segment")
        live[a] = (size, pending)
        bisect.insort(addrs, a)

    last_time = None
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        act, a, size = e["action"], int(e.get("addr", 0)), int(e.get("size", 0))
        t = e.get("time_us")
        if t is not None:
            if last_time is not None and t > last_time:
                problems.append(f"event {i}: time_us {t} after the next event's {last_time}")
            last_time = t
        if act == "alloc":
            if a not in live:
                problems.append(f"event {i} (alloc {a:#x}): no live block there afterwards")
            else:
                del live[a]
                addrs.remove(a)
        elif act == "free_requested":
            if a not in live or not live[a][1]:
                problems.append(f"event {i} (free_requested {a:#x}): no block awaiting its "
                                "free_completed there afterwards")
            else:
                live[a] = (live[a][0], False)
        elif act == "free_completed":
            put(a, size, True, i, act)
        elif act in ("segment_alloc", "segment_map"):
            blk = inside_live(a, a + size)
            if blk is not None:
                problems.append(f"event {i} ({act} {a:#x}): live block {blk:#x} inside it "
                                "before it existed")
            if not ranges.remove(a, a + size, act == "segment_map"):
                problems.append(f"event {i} ({act} {a:#x}, {size} bytes): no such segment "
                                "afterwards")
        elif act in ("segment_free", "segment_unmap"):
            if ranges.overlaps(a, a + size):
                problems.append(f"event {i} ({act} {a:#x}): overlaps a segment that exists "
                                "after it")
            else:
                ranges.add(a, a + size, act == "segment_unmap")
        if len(problems) > limit:
            break
    if len(problems) > limit:
        return problems[:limit] + [f"... and more ({len(problems) - limit}+ not shown)"]
    return problems
