"""The ``bfc`` policy: a model of TensorFlow's BFC allocator (docs/allocator.md "bfc policy").

Hand-computed layouts (best fit, split rule, coalescing, region growth, the OOM path,
empty_cache), a differential test against a naive pure-Python BFC model written from the rules
(lists and linear scans), stream-unawareness, ignored torch settings, and trace replay.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel_graph.allocator.core.engine import OP, OP_DTYPE, Engine
from accel_graph.allocator.core.settings import POLICIES, EngineSettings, round_size
from accel_graph.errors import OutOfMemoryError

KIB = 1 << 10
MIB = 1 << 20
BASE = 0x100000000000  # the counting upstream's first address


def regions(e: Engine) -> list[int]:
    """Region sizes in address order (the counting upstream hands out increasing addresses)."""
    return [s["size"] for s in sorted(e.layout(), key=lambda s: s["address"])]


def blocks(e: Engine) -> list[list[tuple[int, str]]]:
    return [[(b["size"], b["state"]) for b in s["blocks"]]
            for s in sorted(e.layout(), key=lambda s: s["address"])]


def test_policy_is_listed_for_the_tuner():
    assert "bfc" in POLICIES and POLICIES.index("bfc") == 2


def test_rounding_is_256_bytes_and_ignores_torch_knobs():
    s = EngineSettings(roundup_power2_divisions=4, round_extra=32)
    assert round_size(1, policy="bfc") == 256
    assert round_size(256, policy="bfc") == 256
    assert round_size(257, policy="bfc") == 512
    assert round_size(600 * MIB + 1, s, policy="bfc") == 600 * MIB + 256
    e = Engine("bfc")
    p = e.malloc(1000)
    assert e.block_size(p) < 2 * 1024  # a fresh 2 MiB region split at 1024 bytes
    assert e.block_size(p) == 1024


def test_regions_double_one_mib_requests(check_engine):
    e = Engine("bfc")
    e.enable_events()
    ptrs = [e.malloc(MIB) for _ in range(7)]
    assert regions(e) == [2 * MIB, 4 * MIB, 8 * MIB]
    assert blocks(e) == [[(MIB, "active_allocated")] * 2, [(MIB, "active_allocated")] * 4,
                         [(MIB, "active_allocated"), (7 * MIB, "inactive")]]
    # the first region starts at the counting upstream's base; each chunk is its request
    assert ptrs[0] == BASE and ptrs[1] == BASE + MIB and ptrs[2] == BASE + 2 * MIB
    stats = e.memory_stats()
    assert stats["num_device_alloc"] == stats["accel.device_mallocs"] == 3
    assert stats["reserved_bytes.all.current"] == 14 * MIB
    assert stats["allocated_bytes.all.current"] == 7 * MIB
    assert stats["segment.large_pool.current"] == 3 and stats["segment.small_pool.current"] == 0
    ev = e.drain_events()
    seg = ev[ev["action"] == 3]  # segment_alloc
    assert seg["size"].tolist() == [2 * MIB, 4 * MIB, 8 * MIB]
    assert int((ev["action"] == 0).sum()) == 7
    check_engine(e)


def test_large_request_grows_the_region_size_without_doubling_after():
    # 5 MiB: the next size 2 MiB doubles to 8 MiB (increased: it is not doubled again);
    # an 8 MiB chunk for 5 MiB is kept whole (less than twice, remainder < 128 MiB)
    e = Engine("bfc")
    a = e.malloc(5 * MIB)
    assert e.block_size(a) == 8 * MIB
    assert e.memory_stats()["allocated_bytes.all.current"] == 8 * MIB
    e.malloc(MIB)
    assert regions(e) == [8 * MIB, 8 * MIB]
    e.malloc(8 * MIB)  # the 7 MiB remainder is too small: next region 16 MiB (doubled)
    assert regions(e) == [8 * MIB, 8 * MIB, 16 * MIB]


def test_split_rule_twice_the_request_or_128_mib_waste():
    e = Engine("bfc")
    p = e.malloc(1536 * KIB)  # 2 MiB region, 1.5 MiB: not split
    assert e.block_size(p) == 2 * MIB
    e = Engine("bfc")
    p = e.malloc(300 * MIB)  # region 512 MiB: 212 MiB remainder >= 128 MiB: split
    assert regions(e) == [512 * MIB]
    assert e.block_size(p) == 300 * MIB
    q = e.malloc(100 * MIB)  # 212 >= 2 x 100: split
    assert e.block_size(q) == 100 * MIB
    r = e.malloc(60 * MIB)  # 112 < 120 and 52 MiB waste: whole
    assert e.block_size(r) == 112 * MIB
    assert blocks(e) == [[(300 * MIB, "active_allocated"), (100 * MIB, "active_allocated"),
                          (112 * MIB, "active_allocated")]]


def test_coalescing_free_middle_then_neighbours(check_engine):
    e = Engine("bfc")
    a, b, c = (e.malloc(512 * KIB) for _ in range(3))
    assert blocks(e) == [[(512 * KIB, "active_allocated")] * 3 + [(512 * KIB, "inactive")]]
    e.free(b)
    assert blocks(e) == [[(512 * KIB, "active_allocated"), (512 * KIB, "inactive"),
                          (512 * KIB, "active_allocated"), (512 * KIB, "inactive")]]
    stats = e.memory_stats()
    assert stats["inactive_split.all.current"] == 2
    assert stats["inactive_split_bytes.all.current"] == MIB
    e.free(a)
    assert blocks(e) == [[(MIB, "inactive"), (512 * KIB, "active_allocated"),
                          (512 * KIB, "inactive")]]
    e.free(c)
    assert blocks(e) == [[(2 * MIB, "inactive")]]
    stats = e.memory_stats()
    assert stats["inactive_split.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == 2 * MIB
    check_engine(e)


def test_best_fit_smallest_sufficient_then_lowest_address(check_engine):
    e = Engine("bfc")
    _a = e.malloc(256 * KIB)
    s1 = e.malloc(512 * KIB)
    _b = e.malloc(256 * KIB)
    s2 = e.malloc(256 * KIB)
    _c = e.malloc(256 * KIB)
    # one 2 MiB region: a s1 b s2 c, then a 512 KiB free tail
    assert blocks(e)[0][-1] == (512 * KIB, "inactive")
    e.free(s1)
    e.free(s2)
    # free chunks: s1 512 KiB, s2 256 KiB, tail 512 KiB
    assert e.malloc(200 * KIB) == s2  # the smallest that fits (first fit would take s1)
    assert e.block_size(s2) == 256 * KIB  # 256 < 2 x 200: not split
    # s1 and the tail are the same size: the lower address wins
    assert e.malloc(500 * KIB) == s1
    check_engine(e)


def test_stream_unaware_reuse_across_streams(check_engine):
    e = Engine("bfc", streams=2)
    e.enable_events()
    p = e.malloc(MIB, stream=1)
    e.free(p)
    q = e.malloc(MIB, stream=0)
    assert q == p and e.memory_stats()["num_device_alloc"] == 1
    ev = e.drain_events()
    allocs = ev[ev["action"] == 0]
    assert allocs["stream"].tolist() == [1, 0]  # events keep the request's stream
    assert {s["stream"] for s in e.layout()} == {0}
    check_engine(e)
    # the native allocator caches per stream: a second segment
    n = Engine("native", streams=2)
    p = n.malloc(MIB, stream=1)
    n.free(p)
    assert n.malloc(MIB, stream=0) != p
    assert n.memory_stats()["num_device_alloc"] == 2


def test_record_stream_defers_the_free(check_engine):
    e = Engine("bfc", streams=2)
    p = e.malloc(MIB, stream=1)
    e.record_stream(p, 1)  # its own stream: no deferral
    e.free(p)
    assert blocks(e) == [[(2 * MIB, "inactive")]]
    p = e.malloc(MIB, stream=1)
    e.record_stream(p, 0)
    e.free(p)
    assert blocks(e)[0][0] == (MIB, "active_pending_free")
    check_engine(e)
    e.process_events()
    assert blocks(e) == [[(2 * MIB, "inactive")]]
    check_engine(e)


def test_torch_settings_are_ignored():
    torchy = EngineSettings(expandable_segments=True, max_split_size=40 * MIB,
                            roundup_power2_divisions=8, round_extra=32,
                            garbage_collection_threshold=0.5, expandable_head_align=16 * KIB,
                            large_segment_size=40 * MIB)
    plain, other = Engine("bfc"), Engine("bfc", settings=torchy)
    for e in (plain, other):
        ptrs = [e.malloc(s) for s in (3 * MIB, 100, 70 * MIB, 5 * MIB + 1)]
        e.free(ptrs[1])
        e.free(ptrs[2])
        e.empty_cache()
    assert plain.layout() == other.layout()
    assert plain.memory_stats() == other.memory_stats()
    assert not any(s["is_expandable"] for s in other.layout())
    assert other.memory_stats()["max_split_size"] == -1


def test_cap_clamps_the_last_region_then_ooms(check_engine):
    e = Engine("bfc", settings=EngineSettings(cap=5 * MIB))
    ptrs = [e.malloc(MIB) for _ in range(5)]
    assert regions(e) == [2 * MIB, 3 * MIB]  # the 4 MiB region is clamped to what is left
    with pytest.raises(OutOfMemoryError) as exc:
        e.malloc(MIB)
    msg = str(exc.value)
    assert "Tried to allocate 1024.00 KiB" in msg and "policy bfc" in msg
    assert "expandable_segments:True" not in msg
    stats = e.memory_stats()
    assert stats["num_ooms"] == 1 and stats["reserved_bytes.all.current"] == 5 * MIB
    check_engine(e)
    e.free(ptrs[0])
    assert e.malloc(MIB) == ptrs[0]  # usable after the OOM
    check_engine(e)


def test_memory_fraction_limits_regions():
    e = Engine("bfc", settings=EngineSettings(capacity=10 * MIB, memory_fraction=0.5))
    for _ in range(5):
        e.malloc(MIB)
    assert regions(e) == [2 * MIB, 3 * MIB]
    with pytest.raises(OutOfMemoryError):
        e.malloc(256)


def test_oom_path_returns_free_regions_then_extends(check_engine):
    e = Engine("bfc", settings=EngineSettings(cap=6 * MIB))
    e.enable_events()
    a = e.malloc(MIB)
    b = e.malloc(1536 * KIB)
    assert regions(e) == [2 * MIB, 4 * MIB]
    e.free(a)
    e.free(b)
    c = e.malloc(5 * MIB)  # no chunk fits, no room: both free regions go, one 6 MiB region
    assert regions(e) == [6 * MIB] and e.block_size(c) == 6 * MIB
    stats = e.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["accel.device_frees"] == 2
    assert stats["num_ooms"] == 0
    ev = e.drain_events()
    assert ev[ev["action"] == 4]["size"].tolist() == [2 * MIB, 4 * MIB]  # segment_free
    check_engine(e)


def test_oom_path_keeps_regions_that_cannot_help():
    e = Engine("bfc", settings=EngineSettings(cap=6 * MIB))
    a = e.malloc(MIB)
    _b = e.malloc(1536 * KIB)
    e.free(a)  # a 2 MiB free region; 2 MiB < 7 MiB even with it returned
    with pytest.raises(OutOfMemoryError):
        e.malloc(7 * MIB)
    assert regions(e) == [2 * MIB, 4 * MIB]
    assert e.memory_stats()["num_alloc_retries"] == 0


def test_empty_cache_releases_wholly_free_regions_and_restarts_growth(check_engine):
    e = Engine("bfc")
    ptrs = [e.malloc(MIB) for _ in range(7)]
    for p in ptrs[2:]:
        e.free(p)
    e.empty_cache()
    assert regions(e) == [2 * MIB]
    stats = e.memory_stats()
    assert stats["reserved_bytes.all.current"] == 2 * MIB
    assert stats["accel.device_frees"] == 2 and stats["num_device_free"] == 2
    check_engine(e)
    # growth restarts at 2 x the largest region left (2 MiB): the next region is 4 MiB
    e.malloc(MIB)
    assert regions(e) == [2 * MIB, 4 * MIB]
    e.malloc(3 * MIB)  # 3 MiB left in the 4 MiB region: fits, no new region
    assert regions(e) == [2 * MIB, 4 * MIB]
    e.malloc(MIB)  # next region 8 MiB (doubled after the 4 MiB one)
    assert regions(e) == [2 * MIB, 4 * MIB, 8 * MIB]
    # a region with a live chunk stays
    f = Engine("bfc")
    keep = f.malloc(MIB)
    tmp = f.malloc(MIB)
    f.free(tmp)
    f.empty_cache()
    assert blocks(f) == [[(MIB, "active_allocated"), (MIB, "inactive")]]
    f.free(keep)
    f.empty_cache()
    assert f.layout() == [] and f.memory_stats()["reserved_bytes.all.current"] == 0
    f.malloc(MIB)
    assert regions(f) == [2 * MIB]  # nothing held: the first size again


def test_snapshot_and_private_pools():
    e = Engine("bfc")
    e.malloc(MIB)
    pool = e.create_pool()
    with e.allocate_to_pool(pool):
        p = e.malloc(MIB)
    snap = e.snapshot()
    assert len(snap) == 2 and {s["segment_type"] for s in snap} == {"large"}
    assert e.pool_memory(pool)["reserved_bytes"] == 2 * MIB
    e.free(p)
    e.empty_cache()  # the pool is still held by its creator: its region stays
    assert len(e.snapshot()) == 2
    e.release_pool(pool)
    e.empty_cache()  # the released pool's region goes back
    assert len(e.snapshot()) == 1


# -- a naive pure-Python model of the rules, for the differential test -------------------------


class BfcModel:
    """Regions as lists of [addr, size, state]; free chunks found by a linear scan."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.limit = cap if cap is not None else 1 << 62
        self.next_addr = BASE
        self.regions: list[list[list]] = []  # each: [[addr, size, live], ...]
        self.next_size = 0
        self.reserved = 0
        self.mallocs = self.frees = self.retries = self.ooms = 0

    def _avail(self) -> int:
        return max(self.limit - self.reserved, 0) // 256 * 256

    def _find(self, size: int) -> tuple[int, int] | None:
        best = None
        for ri, reg in enumerate(self.regions):
            for bi, (addr, bsize, live) in enumerate(reg):
                if not live and bsize >= size and (best is None or (bsize, addr) < best[0]):
                    best = ((bsize, addr), (ri, bi))
        return best[1] if best else None

    def _extend(self, size: int) -> bool:
        avail = self._avail()
        if size > avail:
            return False
        if not self.next_size:
            self.next_size = max(256, -(-min(self.limit, 2 * MIB) // 256) * 256)
        increased = False
        while size > self.next_size:
            self.next_size *= 2
            increased = True
        nbytes = min(self.next_size, avail)
        if not increased:
            self.next_size *= 2
        self.regions.append([[self.next_addr, nbytes, False]])
        self.next_addr += -(-nbytes // 512) * 512
        self.reserved += nbytes
        self.mallocs += 1
        return True

    def _free_regions(self, size: int) -> bool:
        free = [r for r in self.regions if len(r) == 1 and not r[0][2]]
        total = sum(r[0][1] for r in free)
        if not total or size > max(self.limit - self.reserved, 0) + total:
            return False
        self.retries += 1
        for r in free:
            self.regions.remove(r)
            self.reserved -= r[0][1]
            self.frees += 1
        return True

    def malloc(self, size: int) -> int | None:
        size = max(256, -(-size // 256) * 256)
        at = self._find(size)
        if at is None and self._extend(size):
            at = self._find(size)
        if at is None and self._free_regions(size) and self._extend(size):
            at = self._find(size)
        if at is None:
            self.ooms += 1
            return None
        reg = self.regions[at[0]]
        chunk = reg[at[1]]
        rem = chunk[1] - size
        if rem >= size or rem >= 128 * MIB:
            reg.insert(at[1] + 1, [chunk[0] + size, rem, False])
            chunk[1] = size
        chunk[2] = True
        return chunk[0]

    def free(self, ptr: int) -> None:
        for reg in self.regions:
            for i, chunk in enumerate(reg):
                if chunk[0] == ptr:
                    chunk[2] = False
                    if i + 1 < len(reg) and not reg[i + 1][2]:
                        chunk[1] += reg.pop(i + 1)[1]
                    if i > 0 and not reg[i - 1][2]:
                        reg[i - 1][1] += reg.pop(i)[1]
                    return
        raise AssertionError(f"model: unknown pointer {ptr:#x}")

    def empty_cache(self) -> None:
        free = [r for r in self.regions if len(r) == 1 and not r[0][2]]
        for r in free:
            self.regions.remove(r)
            self.reserved -= r[0][1]
            self.frees += 1
        if free:
            largest = max((sum(c[1] for c in r) for r in self.regions), default=0)
            first = max(256, -(-min(self.limit, 2 * MIB) // 256) * 256)
            self.next_size = max(first, 2 * largest)

    def layout(self) -> list[list[tuple[int, int, bool]]]:
        return [[tuple(c) for c in r] for r in sorted(self.regions, key=lambda r: r[0][0])]


def engine_layout(e: Engine) -> list[list[tuple[int, int, bool]]]:
    return [[(b["address"], b["size"], b["state"] == "active_allocated") for b in s["blocks"]]
            for s in sorted(e.layout(), key=lambda s: s["address"])]


_sizes = st.one_of(
    st.integers(1, 4 * KIB),
    st.integers(4 * KIB, 3 * MIB),
    st.sampled_from([256, 257, MIB, 2 * MIB, 2 * MIB + 1, 5 * MIB, 40 * MIB, 129 * MIB]),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), _sizes, st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=_ops, cap=st.sampled_from([None, 6 * MIB, 64 * MIB, 200 * MIB + 1000]))
def test_differential_against_python_model(program, cap, check_engine):
    e = Engine("bfc", "counting", EngineSettings(cap=cap), streams=3)
    m = BfcModel(cap)
    live: list[tuple[int, int]] = []  # (ptr, requested)
    for op, arg, stream in program:
        if op == "malloc":
            want = m.malloc(arg)
            try:
                got = e.malloc(arg, stream=stream)
            except OutOfMemoryError:
                got = None
            assert got == want, (op, arg)
            if got is not None:
                live.append((got, arg))
        elif op == "free" and live:
            ptr, _ = live.pop(arg % len(live))
            e.free(ptr)
            m.free(ptr)
        elif op == "empty_cache":
            e.empty_cache()
            m.empty_cache()
        assert engine_layout(e) == m.layout()
        check_engine(e)
        stats = e.memory_stats()
        assert stats["reserved_bytes.all.current"] == m.reserved
        assert stats["allocated_bytes.all.current"] == sum(
            c[1] for r in m.regions for c in r if c[2])
        assert stats["requested_bytes.all.current"] == sum(r for _, r in live)
        assert stats["accel.device_mallocs"] == m.mallocs
        assert stats["accel.device_frees"] == m.frees
        assert stats["num_alloc_retries"] == m.retries
        assert stats["num_ooms"] == m.ooms
        if cap is not None:
            assert stats["accel.upstream_peak_bytes"] <= cap


def _ops_array(program: list[tuple[str, int, int]]) -> np.ndarray:
    rows = []
    for op, size, slot in program:
        rows.append((OP[op], 0, size, slot, 0))
    return np.array(rows, dtype=OP_DTYPE)


def test_replay_matches_python_calls(check_engine):
    rng = np.random.default_rng(7)
    program: list[tuple[str, int, int]] = []
    live: list[int] = []
    for i in range(400):
        if live and rng.random() < 0.45:
            program.append(("free", 0, live.pop(int(rng.integers(len(live))))))
        elif rng.random() < 0.02:
            program.append(("empty_cache", 0, 0))
        else:
            size = int(rng.choice([512, 3000, 200 * KIB, MIB, 3 * MIB, 17 * MIB]))
            program.append(("malloc", size, i))
            live.append(i)
    cap = 48 * MIB
    a = Engine("bfc", settings=EngineSettings(cap=cap))
    res = a.replay(_ops_array(program), n_slots=400)
    b = Engine("bfc", settings=EngineSettings(cap=cap))
    slots: dict[int, int] = {}
    for (op, size, slot), r in zip(program, res, strict=True):
        if op == "malloc":
            try:
                slots[slot] = b.malloc(size)
                assert r == slots[slot]
            except OutOfMemoryError:
                assert r < 0
        elif op == "free" and slot in slots:
            b.free(slots.pop(slot))
        elif op == "empty_cache":
            b.empty_cache()
    assert a.layout() == b.layout()
    assert a.memory_stats() == b.memory_stats()
    check_engine(a)


# -- trace replay ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frag_trace():
    from accel_graph.allocator.sim.generate import generate

    return generate("frag")


def test_replay_trace_under_bfc(frag_trace):
    from accel_graph.allocator.sim.replayer import replay_trace

    r = replay_trace(frag_trace, policy="bfc")
    assert r.ooms == 0 and r.device_mallocs > 0
    assert r.peak_reserved >= r.peak_requested > 0
    assert r.peak_reserved >= r.peak_allocated >= r.peak_requested
    assert r.maps == r.unmaps == 0
    # the segment events account for the reserved bytes
    seg = r.segment_events
    grown = int(seg[seg["action"] == 3]["size"].sum()) - int(seg[seg["action"] == 4]["size"].sum())
    assert r.start_reserved + grown == r.final_stats["reserved_bytes.all.current"]
    assert r.device_mallocs == int((seg["action"] == 3).sum())
    native = replay_trace(frag_trace, policy="native")
    assert native.peak_requested == r.peak_requested  # same trace, same requests


def test_replay_trace_under_bfc_with_a_cap_runs_out(frag_trace):
    from accel_graph.allocator.sim.replayer import replay_trace

    free = replay_trace(frag_trace, policy="bfc")
    cap = free.peak_requested // 2
    r = replay_trace(frag_trace, EngineSettings(cap=cap), policy="bfc")
    assert r.ooms > 0
    assert r.peak_reserved <= cap
