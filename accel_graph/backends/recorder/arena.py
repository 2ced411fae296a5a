"""Bookkeeping of a graph pool's memory: segments, best-fit blocks, splitting and merging.

Pure bookkeeping, no memory: the same class keeps a live pool's books and simulates a capture's
allocation sequence on its own (``standalone_bytes``). The policy is a small caching allocator
in the shape of PyTorch's large pool: sizes round up to 512 bytes, segments are at least 2 MiB
(larger requests round up to 2 MiB multiples), the smallest free block that fits is taken
(ties by address), blocks split when at least 512 bytes remain, and free neighbours inside a
segment merge. The allocator engine can replace it behind the same methods.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SEGMENT = 2 << 20


def round_block(nbytes: int) -> int:
    """Bytes a request occupies: at least 512, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """Bytes of a new segment for a block of ``nbytes`` (already rounded)."""
    return max(SEGMENT, -(-nbytes // SEGMENT) * SEGMENT)


@dataclass
class Segment:
    index: int
    size: int
    #: offset -> (size, allocated) for every block; blocks tile the segment.
    blocks: dict[int, list]
    live: int = 0  # allocated blocks
    #: end offset -> start offset of every block, so merging finds the previous block in O(1).
    ends: dict[int, int] | None = None

    def __post_init__(self) -> None:
        if self.ends is None:
            self.ends = {o + b[0]: o for o, b in self.blocks.items()}

    def put(self, off: int, size: int, allocated: bool) -> None:
        self.blocks[off] = [size, allocated]
        self.ends[off + size] = off

    def drop(self, off: int) -> None:
        size = self.blocks.pop(off)[0]
        del self.ends[off + size]


class Arena:
    """Segments and blocks of one pool. Offsets are bytes from the segment's start."""

    def __init__(self, limit: int | None = None) -> None:
        self.segments: dict[int, Segment] = {}
        self._free: list[tuple[int, int, int]] = []  # sorted (size, segment, offset)
        self._next_segment = 0
        self.limit = limit
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_reserved = 0

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> tuple[int, int, int, bool]:
        """Allocate; returns ``(segment, offset, size, new_segment)``.

        Raises ``MemoryError`` (turned into OutOfMemoryError by the pool) past ``limit``.
        """
        size = round_block(nbytes)
        i = bisect.bisect_left(self._free, (size, -1, -1))
        new = False
        if i == len(self._free):
            seg_bytes = segment_size(size)
            if self.limit is not None and self.reserved_bytes + seg_bytes > self.limit:
                raise MemoryError(
                    f"pool limit reached: tried to allocate {nbytes} bytes (a new segment of "
                    f"{seg_bytes}); reserved {self.reserved_bytes}, allocated "
                    f"{self.allocated_bytes}, limit {self.limit}"
                )
            seg = Segment(self._next_segment, seg_bytes, {0: [seg_bytes, False]})
            self._next_segment += 1
            self.segments[seg.index] = seg
            self.reserved_bytes += seg_bytes
            self.peak_reserved = max(self.peak_reserved, self.reserved_bytes)
            bisect.insort(self._free, (seg_bytes, seg.index, 0))
            i = bisect.bisect_left(self._free, (size, -1, -1))
            new = True
        bsize, sidx, off = self._free.pop(i)
        seg = self.segments[sidx]
        if bsize - size >= MIN_BLOCK:
            seg.drop(off)
            seg.put(off, size, True)
            seg.put(off + size, bsize - size, False)
            bisect.insort(self._free, (bsize - size, sidx, off + size))
        else:
            size = bsize
            seg.blocks[off] = [bsize, True]
        seg.live += 1
        self.allocated_bytes += size
        return sidx, off, size, new

    def free(self, sidx: int, off: int) -> None:
        """Return a block; merges with free neighbours of the same segment."""
        seg = self.segments.get(sidx)
        blk = seg.blocks.get(off) if seg is not None else None
        if blk is None or not blk[1]:
            raise ValueError(f"free of a block that is not allocated (segment {sidx}, offset {off})")
        size = blk[0]
        blk[1] = False
        seg.live -= 1
        self.allocated_bytes -= size
        # Merge with the next block, then the previous one.
        nxt = off + size
        nb = seg.blocks.get(nxt)
        seg.drop(off)
        if nb is not None and not nb[1]:
            self._free.remove((nb[0], sidx, nxt))
            seg.drop(nxt)
            size += nb[0]
        prev = seg.ends.get(off)
        if prev is not None and not seg.blocks[prev][1]:
            psize = seg.blocks[prev][0]
            self._free.remove((psize, sidx, prev))
            seg.drop(prev)
            off, size = prev, psize + size
        seg.put(off, size, False)
        bisect.insort(self._free, (size, sidx, off))

    def release_free_segments(self, keep: set[int] = frozenset()) -> list[int]:
        """Drop segments with no allocated block (except those in ``keep``); returns them."""
        dropped = []
        for sidx, seg in list(self.segments.items()):
            if seg.live == 0 and sidx not in keep:
                self._free.remove((seg.size, sidx, 0))
                del self.segments[sidx]
                self.reserved_bytes -= seg.size
                dropped.append(sidx)
        return dropped

    def check(self) -> None:
        """Assert the invariants (blocks tile segments, books balance); for tests."""
        reserved = allocated = 0
        for seg in self.segments.values():
            pos, live = 0, 0
            for o in sorted(seg.blocks):
                s, a = seg.blocks[o]
                assert o == pos, f"gap or overlap in segment {seg.index} at {o}"
                pos += s
                live += a
                allocated += s if a else 0
            assert pos == seg.size, f"blocks do not tile segment {seg.index}"
            assert seg.ends == {o + b[0]: o for o, b in seg.blocks.items()}
            assert live == seg.live
            reserved += seg.size
        assert reserved == self.reserved_bytes and allocated == self.allocated_bytes


def simulate_peak(events: list[tuple[str, int, int]]) -> int:
    """Peak reserved bytes of an ``("alloc"|"free", key, nbytes)`` sequence on a fresh arena."""
    arena = Arena()
    where: dict[int, tuple[int, int]] = {}
    for action, key, nbytes in events:
        if action == "alloc":
            sidx, off, _, _ = arena.alloc(nbytes)
            where[key] = (sidx, off)
        elif key in where:
            arena.free(*where.pop(key))
    return arena.peak_reserved
