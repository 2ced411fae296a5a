"""Differential test: the C engine against a naive pure-Python model of the native policy.

The model below is written straight from torch-internals.md section 4 with no data structures
to speak of (lists and linear scans), so that it is easy to check by eye. Random programs run
on both; after every step the layouts (every block of every segment) and the counters must be
identical, with and without expandable segments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.errors import OutOfMemoryError

MIB = 1 << 20
BASE = 0x100000000000  # the counting upstream's first address
UNLIMITED = (1 << 64) - 1
_SOAK = max(1, int(os.environ.get("ACCEL_GRAPH_SOAK", "1")))


@dataclass(eq=False)
class Block:
    ptr: int
    size: int
    stream: int
    pool: BlockPool
    seg: Segment
    allocated: bool = False
    pending: bool = False
    requested: int = 0
    gc_base: int = 0
    mapped: bool = True


@dataclass(eq=False)
class Segment:
    base: int
    size: int
    blocks: list[Block] = field(default_factory=list)  # by address
    page: int = 0  # expandable: the page size; 0 for an ordinary segment


@dataclass(eq=False)
class BlockPool:
    small: bool
    owner: int = 0  # private pool id, 0 = default
    free: list[Block] = field(default_factory=list)  # mapped free blocks
    unmapped: list[Block] = field(default_factory=list)
    gc_calls: int = 0


class Model:
    def __init__(self, s: EngineSettings, cap: int | None, capacity: int | None) -> None:
        self.ms = UNLIMITED if s.max_split_size is None else s.max_split_size
        self.mnsr = s.max_non_split_rounding_size or s.large_segment_size
        self.lss = s.large_segment_size
        self.divs = s.divisions()
        self.gc_t = s.garbage_collection_threshold
        self.es = s.expandable_segments
        self.capacity = capacity
        self.cap = cap
        frac = s.memory_fraction
        self.set_fraction = frac is not None and frac < 1.0
        self.allowed = int(frac * capacity) if self.set_fraction else UNLIMITED
        self.next_addr = BASE
        self.total = 0
        self.segments: list[Segment] = []
        self.pools = {0: (BlockPool(True), BlockPool(False))}
        self.capture: int | None = None  # pool id receiving allocations (every stream)
        self.pending: list[Block] = []
        self.live: dict[int, Block] = {}
        self.c = dict(retries=0, ooms=0, syncs=0, dev_alloc=0, dev_free=0)
        self.request = 0  # the rounded size of the malloc in progress

    # -- rounding --------------------------------------------------------------------------
    def round(self, n: int) -> int:
        if n < 512:
            return 512
        i = min(max(n.bit_length() - 1 - 20, 0), 15)
        d = self.divs[i]
        if d > 1 and n > 512 * d:
            if n & (n - 1) == 0:
                return n
            p = 1 << (n.bit_length() - 1)
            step = p // d
            if step == 0:
                return 2 * p
            f = n - n % step
            return n if f == n else f + step
        return -(-n // 512) * 512

    def alloc_size(self, n: int) -> int:
        if n <= MIB:
            return 2 * MIB
        if n < 10 * MIB:
            return self.lss
        return -(-n // (2 * MIB)) * (2 * MIB)

    # -- helpers ---------------------------------------------------------------------------
    def neighbours(self, b: Block) -> tuple[Block | None, Block | None]:
        bl = b.seg.blocks
        i = bl.index(b)
        return (bl[i - 1] if i else None), (bl[i + 1] if i + 1 < len(bl) else None)

    def is_split(self, b: Block) -> bool:
        return len(b.seg.blocks) > 1

    @staticmethod
    def allocatable(b: Block | None) -> bool:
        return b is not None and not b.allocated and not b.pending

    def merge(self, dst: Block, src: Block | None) -> None:
        """Absorb a free neighbour with the same mapped state into dst."""
        if not self.allocatable(src) or src.mapped != dst.mapped:
            return
        (dst.pool.free if src.mapped else dst.pool.unmapped).remove(src)
        dst.seg.blocks.remove(src)
        dst.ptr = min(dst.ptr, src.ptr)
        dst.size += src.size

    def insert(self, p: BlockPool, b: Block) -> None:
        b.gc_base = p.gc_calls
        p.free.append(b)

    def gc_on(self) -> bool:
        return self.set_fraction and self.gc_t > 0

    # -- malloc ----------------------------------------------------------------------------
    def malloc(self, n: int, stream: int) -> int:
        if self.capture is None:
            self.complete_pending()
        size = self.round(n)
        small = size <= MIB
        pair = self.pools[self.capture if self.capture is not None else 0]
        pool = pair[0] if small else pair[1]
        asz = self.alloc_size(size)
        self.request = size
        blk = self.get_free_block(pool, size, stream)
        if blk is None:
            if self.gc_on():
                self.garbage_collect()
            blk = self.alloc_block(pool, asz, stream, False)
            if blk is None and self.release_available(pool, size, stream):
                blk = self.alloc_block(pool, asz, stream, False)
            if blk is None and self.capture is None:
                self.release_cached()
                blk = self.alloc_block(pool, asz, stream, True)
        if blk is None:
            self.c["ooms"] += 1
            raise OutOfMemoryError("model")
        rem = blk.size - size
        if pool.small or self.es:
            split = rem >= 512
        else:
            split = size < self.ms and rem > MIB
        if split:
            new = Block(blk.ptr, size, stream, pool, blk.seg)
            i = blk.seg.blocks.index(blk)
            blk.seg.blocks.insert(i, new)
            blk.ptr += size
            blk.size -= size
            self.insert(pool, blk)
            blk = new
        blk.allocated = True
        blk.requested = n
        self.live[blk.ptr] = blk
        return blk.ptr

    def get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        if self.gc_on():
            pool.gc_calls += 1
        cands = sorted(
            (b for b in pool.free if b.stream == stream and b.size >= size),
            key=lambda b: (b.size, b.ptr),
        )
        if not cands:
            return None
        b = cands[0]
        if b.seg.page:
            # best fit by the size a block can grow to (its unmapped right neighbour)
            def grow(x: Block) -> int:
                nxt = self.neighbours(x)[1]
                return x.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            i = 0
            while cands[i].seg.page and i + 1 < len(cands) and grow(cands[i + 1]) < grow(cands[i]):
                i += 1
            b = cands[i]
        if size < self.ms and b.size >= self.ms:
            return None
        if size >= self.ms and b.size >= size + self.mnsr:
            return None
        pool.free.remove(b)
        return b

    def alloc_block(self, pool: BlockPool, asz: int, stream: int, retry: bool) -> Block | None:
        if retry:
            self.c["retries"] += 1
        if self.set_fraction and self.total + asz > self.allowed:
            return None
        if self.es:
            # the expandable path maps for the rounded request, not the segment size
            return self.try_expandable(pool, self.request, stream)
        if self.cap is not None and self.total + asz > self.cap:
            return None
        seg = Segment(self.next_addr, asz)
        self.next_addr += asz
        self.total += asz
        b = Block(seg.base, asz, stream, pool, seg)
        seg.blocks.append(b)
        self.segments.append(seg)
        self.c["dev_alloc"] += 1
        return b

    # -- expandable segments -----------------------------------------------------------------
    def find_expandable(self, pool: BlockPool, size: int, stream: int) -> Block:
        for c in sorted((u for u in pool.unmapped if u.stream == stream), key=lambda u: u.ptr):
            x = c
            prev = self.neighbours(c)[0]
            if self.allocatable(prev):
                x = prev
            got, y = 0, x
            while y is not None and got < size and self.allocatable(y):
                got += y.size
                y = self.neighbours(y)[1]
            if got >= size:
                return x
        page = 2 * MIB if pool.small else self.lss
        cap = self.capacity if self.capacity is not None else 1 << 40
        va = -(-(cap + cap // 8) // page) * page
        if va < size:
            va = -(-size // page) * page
        seg = Segment(self.next_addr, va, page=page)
        self.next_addr += va
        b = Block(seg.base, va, stream, pool, seg, mapped=False)
        seg.blocks.append(b)
        pool.unmapped.append(b)
        self.segments.append(seg)
        return b

    def map_block(self, b: Block, size: int) -> bool:
        page = b.seg.page
        msize = min(-(-size // page) * page, b.size)
        if self.cap is not None and self.total + msize > self.cap:
            return False
        b.pool.unmapped.remove(b)
        b.mapped = True
        if msize < b.size:
            rest = Block(b.ptr + msize, b.size - msize, b.stream, b.pool, b.seg, mapped=False)
            b.seg.blocks.insert(b.seg.blocks.index(b) + 1, rest)
            b.pool.unmapped.append(rest)
            b.size = msize
        prev, nxt = self.neighbours(b)
        self.merge(b, prev)
        self.merge(b, nxt)
        self.insert(b.pool, b)
        self.total += msize
        self.c["dev_alloc"] += 1
        return True

    def try_expandable(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        c = self.find_expandable(pool, size, stream)
        if not c.mapped and not self.map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            n = self.neighbours(c)[1]
            if not self.map_block(n, min(size - c.size, n.size)):
                return None
            c = n
        pool.free.remove(c)
        return c

    def unmap_block(self, b: Block) -> None:
        seg, page = b.seg, b.seg.page
        begin = seg.base + -(-(b.ptr - seg.base) // page) * page
        end = seg.base + (b.ptr + b.size - seg.base) // page * page
        if begin >= end:
            return
        b.pool.free.remove(b)
        i = seg.blocks.index(b)
        if begin > b.ptr:
            before = Block(b.ptr, begin - b.ptr, b.stream, b.pool, seg)
            seg.blocks.insert(i, before)
            self.insert(b.pool, before)
        if b.ptr + b.size > end:
            after = Block(end, b.ptr + b.size - end, b.stream, b.pool, seg)
            seg.blocks.insert(seg.blocks.index(b) + 1, after)
            self.insert(b.pool, after)
        b.ptr, b.size, b.mapped = begin, end - begin, False
        prev, nxt = self.neighbours(b)
        self.merge(b, prev)
        self.merge(b, nxt)
        b.pool.unmapped.append(b)
        self.total -= end - begin
        self.c["dev_free"] += 1

    def release_blocks(self, pool: BlockPool) -> None:
        order = sorted(pool.free, key=lambda b: (b.stream, b.size, b.ptr))
        for b in order:
            if not b.seg.page and not self.is_split(b):
                self.release_block(b)
        for b in order:
            if b.seg.page:
                self.unmap_block(b)
                if not self.is_split(b) and not b.mapped:
                    pool.unmapped.remove(b)
                    self.segments.remove(b.seg)

    def release_block(self, b: Block) -> None:
        b.pool.free.remove(b)
        self.segments.remove(b.seg)
        self.total -= b.size
        self.c["dev_free"] += 1

    def release_available(self, pool: BlockPool, size: int, stream: int) -> bool:
        if self.ms == UNLIMITED:
            return False
        key = max(size, self.ms)
        order = sorted(pool.free, key=lambda b: (b.stream, b.size, b.ptr))
        at = [b for b in order if (b.stream, b.size, b.ptr) >= (stream, key, 0)]
        if at and at[0].stream == stream and not at[0].seg.page:
            self.release_block(at[0])
            return True
        below = [b for b in order if (b.stream, b.size, b.ptr) < (stream, key, 0)]
        released = 0
        for b in reversed(below):
            if released >= key or b.size < self.ms or b.stream != stream:
                break
            if not b.seg.page:
                released += b.size
                self.release_block(b)
        return released >= key

    def garbage_collect(self) -> None:
        thr = int(self.gc_t * self.allowed)
        if self.total <= thr:
            return
        target = self.total - thr
        pool = self.pools[0][1]
        cands = [b for b in pool.free if not self.is_split(b)]
        if not cands:
            return
        total_age = sum(pool.gc_calls - b.gc_base for b in cands)
        count = len(cands)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            mean = total_age / count
            freed = False
            for b in list(pool.free):
                if self.is_split(b) or b.seg.page:
                    continue
                age = pool.gc_calls - b.gc_base
                if age >= mean:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self.release_block(b)

    def release_cached(self) -> None:
        self.c["syncs"] += 1
        self.complete_pending()
        for pool in (self.pools[0][1], self.pools[0][0]):
            self.release_blocks(pool)

    # -- free ------------------------------------------------------------------------------
    def free(self, ptr: int, uses: bool) -> None:
        b = self.live[ptr]
        b.allocated = False
        if uses:
            b.pending = True
            self.pending.append(b)
        else:
            self.free_block(b)

    def free_block(self, b: Block) -> None:
        del self.live[b.ptr]
        b.pending = False
        prev, nxt = self.neighbours(b)
        self.merge(b, prev)
        self.merge(b, nxt)
        self.insert(b.pool, b)

    def complete_pending(self) -> None:
        pend, self.pending = self.pending, []
        for b in pend:
            self.free_block(b)

    def layout(self) -> list[tuple]:
        out = []
        for s in sorted(self.segments, key=lambda s: s.base):
            out.append(
                (
                    s.base,
                    s.size,
                    tuple(
                        (
                            b.ptr,
                            b.size,
                            "active_allocated"
                            if b.allocated
                            else (
                                "active_pending_free"
                                if b.pending
                                else ("inactive" if b.mapped else "unmapped")
                            ),
                        )
                        for b in s.blocks
                    ),
                )
            )
        return out


def _engine_layout(e: Engine) -> list[tuple]:
    return sorted(
        (s["address"], s["size"], tuple((b["address"], b["size"], b["state"]) for b in s["blocks"]))
        for s in e.layout()
    )


sizes = st.one_of(
    st.sampled_from([1, 512, 513, MIB, MIB + 1, 10 * MIB, 20 * MIB, 21 * MIB, 40 * MIB]),
    st.integers(1, MIB),
    st.integers(MIB + 1, 10 * MIB),
    st.integers(10 * MIB, 80 * MIB),
)
programs = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.integers(0, 1)),
        st.tuples(st.just("malloc"), sizes, st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 999), st.booleans()),
        st.tuples(st.just("free"), st.integers(0, 999), st.just(False)),
        st.tuples(st.just("empty_cache")),
        st.tuples(st.just("capture")),
    ),
    max_size=50,
)
model_settings = st.builds(
    EngineSettings,
    max_split_size=st.sampled_from([None, 20 * MIB, 40 * MIB]),
    max_non_split_rounding_size=st.sampled_from([None, 30 * MIB]),
    roundup_power2_divisions=st.one_of(
        st.sampled_from([0, 2, 4, 8]),
        st.lists(st.sampled_from([0, 1, 2, 4, 16]), min_size=16, max_size=16),
    ),
    garbage_collection_threshold=st.sampled_from([0.0, 0.3, 0.7]),
    memory_fraction=st.sampled_from([None, 0.5, 0.8]),
    expandable_segments=st.booleans(),
    cap=st.sampled_from([None, 96 * MIB, 160 * MIB]),
    capacity=st.just(200 * MIB),
)


@settings(max_examples=120 * _SOAK, deadline=None)
@given(s=model_settings, program=programs)
def test_engine_matches_the_reference_model(s, program):
    e = Engine("native", "counting", s, streams=2)
    m = Model(s, s.cap, s.capacity)
    pool = e.create_pool()
    m.pools[pool] = (BlockPool(True, pool), BlockPool(False, pool))
    live: list[int] = []
    for op in program:
        if op[0] == "malloc":
            try:
                got = e.malloc(op[1], op[2])
            except OutOfMemoryError:
                got = None
            try:
                want = m.malloc(op[1], op[2])
            except OutOfMemoryError:
                want = None
            assert got == want, op
            if got is not None:
                live.append(got)
        elif op[0] == "free" and live:
            ptr = live.pop(op[1] % len(live))
            if op[2]:
                e.record_stream(ptr, 1)  # a no-op for blocks of stream 1
            uses = op[2] and m.live[ptr].stream != 1
            e.free(ptr)
            m.free(ptr, uses)
        elif op[0] == "empty_cache":
            e.empty_cache()
            if m.capture is None:
                m.release_cached()
        elif op[0] == "capture":
            if m.capture is None:
                e.begin_allocate_to_pool(pool)
                m.capture = pool
            else:
                e.end_allocate_to_pool(pool)
                e.release_pool(pool)
                m.capture = None
        assert _engine_layout(e) == m.layout(), op
        stats = e.memory_stats()
        assert stats["num_alloc_retries"] == m.c["retries"]
        assert stats["num_ooms"] == m.c["ooms"]
        assert stats["num_sync_all_streams"] == m.c["syncs"]
        assert stats["num_device_alloc"] == m.c["dev_alloc"]
        assert stats["num_device_free"] == m.c["dev_free"]
