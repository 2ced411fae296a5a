"""Golden tests: the worked examples of torch-internals.md section 4 and allocator-semantics.md.

Each test states the expected behaviour of PyTorch's caching allocator and why, then checks the
engine's layout and statistics against it.
"""

from __future__ import annotations

import pytest

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import (
    EngineSettings,
    allocation_size,
    round_size,
    rp2_next_division,
)
from accel_graph.errors import OutOfMemoryError

MIB = 1 << 20
GIB = 1 << 30


def _segment_of(engine: Engine, ptr: int) -> dict:
    for seg in engine.snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"no segment holds {ptr:#x}")


def _blocks(seg: dict) -> list[tuple[int, str]]:
    return [(b["size"], b["state"]) for b in seg["blocks"]]


# -- the worked-examples table (defaults) -----------------------------------------------------


def test_100_bytes_gets_512_in_a_2mib_segment(check_engine):
    e = Engine()
    ptr = e.malloc(100)
    seg = _segment_of(e, ptr)
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MIB
    assert _blocks(seg) == [(512, "active_allocated"), (2 * MIB - 512, "inactive")]
    assert seg["blocks"][0]["requested_size"] == 100
    check_engine(e)
    stats = e.memory_stats()
    assert stats["allocated_bytes.small_pool.current"] == 512
    assert stats["requested_bytes.all.current"] == 100
    assert stats["inactive_split.small_pool.current"] == 1


def test_3mib_gets_a_20mib_segment_split_3_plus_17(check_engine):
    e = Engine()
    seg = _segment_of(e, e.malloc(3 * MIB))
    assert seg["segment_type"] == "large" and seg["total_size"] == 20 * MIB
    assert _blocks(seg) == [(3 * MIB, "active_allocated"), (17 * MIB, "inactive")]
    check_engine(e)


def test_12_5mib_gets_a_14mib_segment_split_with_1_5mib_remainder(check_engine):
    e = Engine()
    size = 12 * MIB + MIB // 2
    seg = _segment_of(e, e.malloc(size))
    # >= 10 MiB: the segment is the request rounded to 2 MiB; 1.5 MiB > 1 MiB, so it splits
    assert seg["total_size"] == 14 * MIB
    assert _blocks(seg) == [(size, "active_allocated"), (MIB + MIB // 2, "inactive")]
    check_engine(e)


def test_11mib_plus_1_gets_an_unsplit_12mib_block(check_engine):
    e = Engine()
    assert round_size(11 * MIB + 1) == 11 * MIB + 512
    ptr = e.malloc(11 * MIB + 1)
    seg = _segment_of(e, ptr)
    # remainder 1 MiB - 512 is not > 1 MiB: no split, the whole 12 MiB is the allocation
    assert seg["total_size"] == 12 * MIB
    assert _blocks(seg) == [(12 * MIB, "active_allocated")]
    assert e.block_size(ptr) == 12 * MIB
    assert e.memory_stats()["allocated_bytes.all.current"] == 12 * MIB
    check_engine(e)


def test_allocation_sizes():
    assert allocation_size(512) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB  # 1 MiB is still small
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(MIB + 512, EngineSettings(large_segment_size=32 * MIB)) == 32 * MIB


# -- order dependence (devlog "When does fragmentation occur", 2026-06-01) ----------------------


def _eight_then_four(first: int, n_first: int, second: int, n_second: int, es: bool) -> int:
    e = Engine(settings=EngineSettings(expandable_segments=es))
    ptrs = [e.malloc(first) for _ in range(n_first)]
    for p in ptrs:
        e.free(p)
    ptrs = [e.malloc(second) for _ in range(n_second)]
    reserved = e.memory_stats()["reserved_bytes.all.peak"]
    for p in ptrs:
        e.free(p)
    return reserved


def test_small_then_large_reserves_twice_as_much_as_large_then_small():
    # Eight 16 MiB blocks: each request >= 10 MiB gets its own 16 MiB segment, an exact fit,
    # so nothing splits (128 MiB). After all are freed the cache holds eight 16 MiB blocks,
    # none of which can serve 32 MiB, and segments never merge across cudaMalloc boundaries,
    # so four 32 MiB requests get four new segments: 256 MiB reserved.
    assert _eight_then_four(16 * MIB, 8, 32 * MIB, 4, es=False) == 256 * MIB
    # The opposite order: four 32 MiB segments (128 MiB); freed, each one is the best fit for
    # a 16 MiB request and splits (16 < max_split, remainder 16 MiB > 1 MiB), so eight 16 MiB
    # blocks fit in the same 128 MiB.
    assert _eight_then_four(32 * MIB, 4, 16 * MIB, 8, es=False) == 128 * MIB


def test_expandable_segments_make_the_order_irrelevant():
    # With expandable segments every large request grows one address range in 20 MiB pages,
    # and freed neighbours merge, so either order maps ceil(128 MiB / 20 MiB) = 7 pages = 140
    # MiB, and the second phase reuses the merged free range without mapping more.
    a = _eight_then_four(16 * MIB, 8, 32 * MIB, 4, es=True)
    b = _eight_then_four(32 * MIB, 4, 16 * MIB, 8, es=True)
    assert a == b == 140 * MIB


# -- roundup_power2_divisions -------------------------------------------------------------------


def test_rp2_next_division_examples():
    assert rp2_next_division(1200, 4) == 1280  # 1024 + one 256-byte step
    assert rp2_next_division(1024, 4) == 1024  # powers of two are kept
    assert rp2_next_division(1280, 4) == 1280  # already on a division
    assert rp2_next_division(5 * MIB + 1, 8) == 5 * MIB + 512 * 1024  # 4 MiB + 2 x 512 KiB


def test_round_size_applies_divisions_only_above_512_times_d():
    s = EngineSettings(roundup_power2_divisions=4)
    # 1200 <= 512 * 4, so torch's round_size keeps plain 512-byte rounding (1536), even though
    # the division rounding of 1200 itself would be 1280.
    assert round_size(1200, s) == 1536
    # 3000 > 2048: floor power of two 2048, step 2048 / 4 = 512, so 3000 rounds up to 3072
    assert round_size(3000, s) == 3072
    assert round_size(100, s) == 512
    # a value of 1 means no rounding (pytorch/pytorch#161139)
    assert round_size(514 * MIB, EngineSettings(roundup_power2_divisions=1)) == 514 * MIB


def test_per_interval_divisions_follow_the_code_not_the_docs():
    # "[256:1,512:2,1024:4,>:8]": key K sets interval log2(K), covering [K MiB, 2K MiB); the first
    # entry also fills every lower interval and ">" every higher one. So <512 MiB gets 1,
    # [512 MiB, 1 GiB) gets 2, [1, 2) GiB gets 4, >= 2 GiB gets 8.
    divs = [1] * 9 + [2] + [4] + [8] * 5
    s = EngineSettings(roundup_power2_divisions=divs)
    assert round_size(300 * MIB + 1, s) == 300 * MIB + 512
    assert round_size(600 * MIB, s) == 768 * MIB  # 512 MiB + one 256 MiB step
    assert round_size(512 * MIB, s) == 512 * MIB
    assert round_size(GIB + GIB // 2 + 1, s) == GIB + 3 * GIB // 4
    assert round_size(3 * GIB + 1, s) == 3 * GIB + 256 * MIB
    # the xpu policy has no power-of-two rounding at all
    assert round_size(600 * MIB + 1, s, policy="xpu") == 600 * MIB + 512


# -- oversize rules and the OOM chain -----------------------------------------------------------


def test_requests_below_max_split_never_take_oversize_blocks(check_engine):
    e = Engine(settings=EngineSettings(max_split_size=40 * MIB))
    big = e.malloc(50 * MIB)
    e.free(big)
    small = e.malloc(30 * MIB)  # the cached 50 MiB block is oversize: a new segment instead
    assert small != big
    stats = e.memory_stats()
    assert stats["segment.all.current"] == 2
    assert stats["oversize_segments.current"] == 1
    assert stats["max_split_size"] == 40 * MIB
    check_engine(e)


def test_large_requests_take_oversize_blocks_within_the_rounding_window(check_engine):
    e = Engine(settings=EngineSettings(max_split_size=40 * MIB))
    p = e.malloc(70 * MIB)
    e.free(p)
    # 60 MiB >= max_split and 70 < 60 + 20 (max_non_split_rounding_size): reused whole, unsplit
    q = e.malloc(60 * MIB)
    assert q == p and e.block_size(q) == 70 * MIB
    assert e.memory_stats()["oversize_allocations.current"] == 1
    e.free(q)
    # 90 MiB is outside the window for a 60 MiB request
    e2 = Engine(settings=EngineSettings(max_split_size=40 * MIB))
    e2.free(e2.malloc(90 * MIB))
    assert e2.block_size(e2.malloc(60 * MIB)) == 60 * MIB
    check_engine(e)
    check_engine(e2)


def test_release_available_cached_blocks_frees_an_oversize_block_before_a_full_release(
    check_engine,
):
    e = Engine(settings=EngineSettings(max_split_size=40 * MIB, cap=100 * MIB))
    e.free(e.malloc(90 * MIB))
    e.malloc(60 * MIB)  # 90 is outside the window; 90 + 60 > cap; the 90 MiB block goes first
    stats = e.memory_stats()
    assert stats["num_alloc_retries"] == 0  # no full release was needed
    assert stats["num_sync_all_streams"] == 0
    assert stats["num_device_free"] == 1
    check_engine(e)


def test_full_release_and_retry_counts_one_retry(check_engine):
    e = Engine(settings=EngineSettings(cap=100 * MIB))
    e.free(e.malloc(60 * MIB))
    e.malloc(70 * MIB)  # 60 cached + 70 > cap: release every cached segment, then retry
    stats = e.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_sync_all_streams"] == 1
    assert stats["num_ooms"] == 0
    assert stats["reserved_bytes.all.current"] == 70 * MIB
    check_engine(e)


def test_garbage_collection_needs_a_memory_fraction(check_engine):
    def run(fraction):
        s = EngineSettings(
            garbage_collection_threshold=0.5, memory_fraction=fraction, capacity=200 * MIB
        )
        e = Engine(settings=s)
        ptrs = [e.malloc(30 * MIB) for _ in range(3)]
        for p in ptrs:
            e.free(p)
        e.malloc(40 * MIB)
        check_engine(e)
        return e.memory_stats()

    # allowed = 0.5 * 200 = 100 MiB, GC threshold 50 MiB; 90 MiB reserved is above it, so the
    # 40 MiB request first collects: all three cached 30 MiB segments have the same age (one
    # search since they were freed), which is >= the mean, so one round frees all of them.
    with_gc = run(0.5)
    assert with_gc["num_device_free"] == 3
    assert with_gc["reserved_bytes.all.current"] == 40 * MIB
    assert with_gc["num_alloc_retries"] == 0
    # without a fraction the threshold is ignored (pytorch/pytorch#106660)
    without = run(None)
    assert without["num_device_free"] == 0
    assert without["reserved_bytes.all.current"] == 130 * MIB


def test_memory_fraction_caps_reserved_memory():
    e = Engine(settings=EngineSettings(memory_fraction=0.5, capacity=200 * MIB))
    e.malloc(60 * MIB)
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(60 * MIB)
    assert "100.00 MiB allowed;" in str(info.value)


# -- expandable segments --------------------------------------------------------------------------


def test_expandable_segments_map_and_unmap_pages(check_engine):
    e = Engine(settings=EngineSettings(expandable_segments=True))
    e.enable_events()
    a = e.malloc(3 * MIB)  # maps one 20 MiB page of the large range
    s = e.memory_stats()
    assert (s["accel.device_maps"], s["num_device_alloc"], s["segment.all.current"]) == (1, 1, 0)
    assert s["reserved_bytes.large_pool.current"] == 20 * MIB
    b = e.malloc(25 * MIB)  # 17 MiB free + one more page: 37 MiB, split 25 + 12
    assert b == a + 3 * MIB  # one contiguous range
    assert e.memory_stats()["reserved_bytes.all.current"] == 40 * MIB
    snap = e.snapshot()
    assert len(snap) == 1 and snap[0]["is_expandable"] and snap[0]["total_size"] == 40 * MIB
    assert _blocks(snap[0]) == [
        (3 * MIB, "active_allocated"),
        (25 * MIB, "active_allocated"),
        (12 * MIB, "inactive"),
    ]
    c = e.malloc(100)  # the small pool has its own range, with 2 MiB pages
    assert e.memory_stats()["reserved_bytes.small_pool.current"] == 2 * MIB
    for p in (a, b, c):
        e.free(p)
    e.empty_cache()  # one unmap per free run of whole pages; fully unmapped ranges go away
    s = e.memory_stats()
    assert (s["accel.device_maps"], s["accel.device_unmaps"]) == (3, 2)
    assert s["num_device_free"] == 2 and s["reserved_bytes.all.current"] == 0
    assert e.layout() == [] and e.snapshot() == []
    actions = list(e.drain_events()["action"])
    # alloc/free events interleave with maps: map, alloc, map, alloc, map, alloc, frees, unmaps
    assert actions.count(5) == 3 and actions.count(6) == 2 and 3 not in actions and 4 not in actions
    check_engine(e)


def test_expandable_unmap_keeps_pages_under_live_blocks(check_engine):
    e = Engine(settings=EngineSettings(expandable_segments=True))
    a = e.malloc(30 * MIB)  # two pages (40 MiB)
    b = e.malloc(5 * MIB)  # inside the second page
    e.free(a)
    e.empty_cache()  # only the first page is wholly free
    s = e.memory_stats()
    assert s["accel.device_unmaps"] == 1 and s["reserved_bytes.all.current"] == 20 * MIB
    seg = e.layout()[0]
    states = [blk["state"] for blk in seg["blocks"]]
    assert states[:3] == ["unmapped", "inactive", "active_allocated"]
    e.free(b)
    check_engine(e)


# -- record_stream, private pools -----------------------------------------------------------------


def test_record_stream_defers_the_free_until_events_complete(check_engine):
    e = Engine(streams=2)
    e.enable_events()
    p = e.malloc(MIB, stream=0)
    e.record_stream(p, 1)
    e.free(p)
    seg = _segment_of(e, p)
    assert seg["blocks"][0]["state"] == "active_pending_free"
    s = e.memory_stats()
    assert s["allocation.all.current"] == 0 and s["active.all.current"] == 1
    assert list(e.drain_events()["action"]) == [
        3,
        0,
        1,
    ]  # segment_alloc, alloc, free_requested
    check_engine(e)
    e.process_events()
    assert list(e.drain_events()["action"]) == [2]  # free_completed
    assert e.memory_stats()["active.all.current"] == 0
    check_engine(e)


def test_pending_frees_wait_while_a_pool_receives_allocations(check_engine):
    e = Engine(streams=2)
    p = e.malloc(MIB)
    e.record_stream(p, 1)
    e.free(p)
    pool = e.create_pool()
    with e.allocate_to_pool(pool, stream=0):
        e.malloc(MIB)  # no process_events during capture
        assert e.memory_stats()["active.all.current"] == 2
    e.malloc(512)
    assert e.memory_stats()["active.all.current"] == 2  # the pending free completed
    check_engine(e)


def test_private_pool_memory_is_separate_and_returns_after_release(check_engine):
    e = Engine()
    pool = e.create_pool()
    e.begin_allocate_to_pool(pool, stream=0)
    assert e.pool_use_count(pool) == 2
    p = e.malloc(3 * MIB)
    e.end_allocate_to_pool(pool)
    seg = _segment_of(e, p)
    assert seg["segment_pool_id"] == (0, pool)
    assert e.pool_memory(pool) == {
        "segments": 1,
        "reserved_bytes": 20 * MIB,
        "allocated_bytes": 3 * MIB,
        "active_bytes": 3 * MIB,
        "blocks_allocated": 1,
        "use_count": 2,
        "freeable": 0,
    }
    e.free(p)
    q = e.malloc(3 * MIB)  # a normal request never uses a private pool's memory
    assert e.pool_memory()["allocated_bytes"] == 3 * MIB
    assert _segment_of(e, q)["segment_pool_id"] == (0, 0)
    e.empty_cache()  # the pool is in use: its segment stays
    assert e.memory_stats()["segment.all.current"] == 2
    e.release_pool(pool)
    e.release_pool(pool)
    e.empty_cache()  # use count 0: its memory goes back and the pool is gone
    assert e.memory_stats()["segment.all.current"] == 1
    from accel_graph.errors import PoolError

    with pytest.raises(PoolError):
        e.pool_use_count(pool)
    check_engine(e)


def test_explicit_pool_argument_and_no_split_pools(check_engine):
    e = Engine()
    pool = e.create_pool(no_split=True)
    p = e.malloc(100, pool=pool)
    seg = _segment_of(e, p)
    assert seg["segment_pool_id"] == (0, pool)
    assert _blocks(seg) == [(2 * MIB, "active_allocated")]  # never split
    check_engine(e)


def test_use_on_oom_pools_lend_free_blocks_before_oom(check_engine):
    def run(use_on_oom):
        e = Engine(settings=EngineSettings(cap=30 * MIB))
        pool = e.create_pool(use_on_oom=use_on_oom)
        e.free(e.malloc(12 * MIB, pool=pool))  # a 12 MiB block cached in the pool
        try:
            # 8 MiB wants a 20 MiB segment: 12 + 20 > cap; the full release skips the live pool
            ptr = e.malloc(8 * MIB)
        except OutOfMemoryError:
            return None
        check_engine(e)
        return e, pool, ptr

    assert run(False) is None
    e, pool, ptr = run(True)
    seg = _segment_of(e, ptr)
    assert seg["segment_pool_id"] == (0, pool)  # served from the pool's cached block
    assert _blocks(seg) == [(8 * MIB, "active_allocated"), (4 * MIB, "inactive")]
    assert e.memory_stats()["num_ooms"] == 0


# -- the xpu policy ---------------------------------------------------------------------------------


def test_xpu_policy_has_no_oversize_rules(check_engine):
    s = EngineSettings(max_split_size=40 * MIB)
    e = Engine("xpu", settings=s)
    big = e.malloc(50 * MIB)
    e.free(big)
    small = e.malloc(30 * MIB)  # xpu: best fit is the cached 50 MiB block, split 30 + 20
    assert small == big
    seg = _segment_of(e, small)
    assert _blocks(seg) == [(30 * MIB, "active_allocated"), (20 * MIB, "inactive")]
    stats = e.memory_stats()
    assert stats["oversize_allocations.current"] == 0 and stats["oversize_segments.current"] == 0
    check_engine(e)
