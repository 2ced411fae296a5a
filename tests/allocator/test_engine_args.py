"""Bad arguments to every Engine entry point are ConfigError, never cffi's OverflowError or
TypeError, and change nothing (issue 14 item 9)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.errors import ConfigError, PoolError

MIB = 1 << 20
HUGE = 10**5000  # repr() of this int raises ValueError: the message must not need it



def _id(value: object) -> str:
    if isinstance(value, int) and abs(value) == HUGE:
        return "HUGE" if value > 0 else "-HUGE"
    return repr(value)


# bad values for an argument the C core takes as uint64 (a block address)
BAD_U64 = [-1, 1 << 64, HUGE, "0x10", 1.5, None, True, False]
# bad values for an int64 argument (a pool id)
BAD_I64 = [1 << 63, -(1 << 63) - 1, HUGE, "1", 1.0, None, True, False]
# bad values for an int32 argument (a stream)
BAD_I32 = [1 << 31, -(1 << 31) - 1, HUGE, "0", 0.0, True]


@pytest.fixture
def engine():
    e = Engine(settings=EngineSettings(cap=64 * MIB))
    yield e
    e.close()


def _unchanged(e: Engine, ptr: int, pool: int, before: dict[str, int]) -> None:
    assert e.memory_stats() == before
    assert e.block_size(ptr) == 512
    assert e.pool_use_count(pool) == 1


@pytest.mark.parametrize("bad", BAD_U64, ids=_id)
def test_block_size_refuses_bad_addresses(engine, bad):
    p = engine.malloc(100)
    pool = engine.create_pool()
    before = engine.memory_stats()
    with pytest.raises(ConfigError, match="block_size: ptr"):
        engine.block_size(bad)
    _unchanged(engine, p, pool, before)


@pytest.mark.parametrize("bad", BAD_U64, ids=_id)
def test_free_and_record_stream_refuse_bad_addresses(engine, bad):
    p = engine.malloc(100)
    pool = engine.create_pool()
    before = engine.memory_stats()
    with pytest.raises(ConfigError, match="free: ptr"):
        engine.free(bad)
    with pytest.raises(ConfigError, match="record_stream: ptr"):
        engine.record_stream(bad, 0)
    _unchanged(engine, p, pool, before)


@pytest.mark.parametrize("bad", BAD_I32, ids=_id)
def test_streams_must_be_int32(engine, bad):
    p = engine.malloc(100)
    pool = engine.create_pool()
    before = engine.memory_stats()
    with pytest.raises(ConfigError, match="record_stream: stream"):
        engine.record_stream(p, bad)
    with pytest.raises(ConfigError, match="malloc: stream"):
        engine.malloc(100, stream=bad)
    with pytest.raises(ConfigError, match="begin_allocate_to_pool: stream"):
        engine.begin_allocate_to_pool(pool, bad)
    _unchanged(engine, p, pool, before)


@pytest.mark.parametrize(
    "call",
    [
        "begin_allocate_to_pool",
        "end_allocate_to_pool",
        "release_pool",
        "pool_use_count",
        "pool_memory",
        "malloc",
    ],
)
@pytest.mark.parametrize("bad", BAD_I64, ids=_id)
def test_pool_calls_refuse_bad_pool_ids(engine, call, bad):
    if bad is None and call in ("pool_memory", "malloc"):
        pytest.skip("None is the default pools there")
    p = engine.malloc(100)
    pool = engine.create_pool()
    before = engine.memory_stats()
    with pytest.raises(ConfigError, match=f"{call}: pool"):
        if call == "malloc":
            engine.malloc(100, pool=bad)
        else:
            getattr(engine, call)(bad)
    _unchanged(engine, p, pool, before)


def test_in_range_unknown_pools_stay_pool_errors(engine):
    for pool in (0, -1, 7, (1 << 63) - 1, np.int64(3)):
        with pytest.raises(PoolError):
            engine.pool_use_count(pool)


def test_numpy_integers_are_ints(engine):
    p = engine.malloc(np.int64(100))
    assert engine.block_size(np.uint64(p)) == 512
    pool = engine.create_pool()
    assert engine.pool_use_count(np.int32(pool)) == 1
    engine.record_stream(p, np.int8(0))
    engine.free(np.uint64(p))


def test_malloc_refuses_bools(engine):
    before = engine.memory_stats()
    with pytest.raises(ConfigError, match="malloc: size"):
        engine.malloc(True)
    with pytest.raises(ConfigError, match="malloc: pool"):
        engine.malloc(100, pool=False)
    assert engine.memory_stats() == before


@pytest.mark.parametrize("flag", ["yes", 1, None, 0.0, HUGE], ids=_id)
def test_create_pool_flags_are_bools(engine, flag):
    with pytest.raises(ConfigError, match="create_pool: no_split"):
        engine.create_pool(no_split=flag)
    with pytest.raises(ConfigError, match="create_pool: use_on_oom"):
        engine.create_pool(use_on_oom=flag)
    assert engine.create_pool(no_split=True, use_on_oom=False) == 1  # nothing was created


@pytest.mark.parametrize("bad", [-1, 1 << 63, HUGE, 1.5, None, True, "8"], ids=_id)
def test_enable_events_refuses_bad_bounds(engine, bad):
    with pytest.raises(ConfigError, match="enable_events: max_entries"):
        engine.enable_events(bad)
    engine.malloc(100)
    assert len(engine.drain_events()) == 0  # recording never started


@pytest.mark.parametrize("bad", [-1, 1 << 63, HUGE, 1.5, "2", True], ids=_id)
def test_replay_refuses_bad_slot_counts(engine, bad):
    with pytest.raises(ConfigError, match="replay: n_slots"):
        engine.replay([], n_slots=bad)


@pytest.mark.parametrize("bad", [0, -1, 1 << 31, HUGE, 2.0, "2", True], ids=_id)
def test_stream_count_is_checked(bad):
    with pytest.raises(ConfigError, match="Engine: streams"):
        Engine(streams=bad)


# -- memory fraction: torch's set_per_process_memory_fraction takes [0, 1], refuses NaN ------


@pytest.mark.parametrize(
    "bad",
    [math.nan, -0.5, -1.0, -math.inf, 1.0000001, 2, math.inf, HUGE, -HUGE, "0.5", b"", True, False],
    ids=_id,
)
def test_set_memory_fraction_refuses_out_of_range(engine, bad):
    engine.set_memory_fraction(0.5)
    with pytest.raises(ConfigError, match="set_memory_fraction"):
        engine.set_memory_fraction(bad)
    # the 0.5 limit still holds: 32 MiB of the 64 MiB device
    with pytest.raises(Exception, match="out of memory"):
        engine.malloc(40 * MIB)
    engine.malloc(30 * MIB)


def test_memory_fraction_range_ends_and_unset(engine):
    engine.set_memory_fraction(0)
    with pytest.raises(Exception, match="out of memory"):
        engine.malloc(512)
    engine.set_memory_fraction(np.float32(1.0))
    engine.malloc(40 * MIB)
    engine.set_memory_fraction(0.25)
    engine.set_memory_fraction(None)
    engine.malloc(20 * MIB)


@pytest.mark.parametrize("bad", [math.nan, -0.5, 1.5, "0.5", True], ids=_id)
def test_settings_memory_fraction_refuses_out_of_range(bad):
    with pytest.raises(ConfigError, match="memory fraction"):
        Engine(settings=EngineSettings(cap=64 * MIB, memory_fraction=bad))


@pytest.mark.parametrize("bad", [HUGE, -1, True, 1.5], ids=_id)
def test_settings_byte_counts_refuse_bad_values(bad):
    with pytest.raises(ConfigError, match="cap"):
        Engine(settings=EngineSettings(cap=bad))
