"""The engine's Python API: bad input, OOM messages, statistics keys, events, upstreams, replay."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from torch_stat_names import TORCH_STAT_NAMES

from accel_graph.allocator.core.engine import EVENT_DTYPE, OP, OP_DTYPE, Engine
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.allocator.traces.actions import ACTION_CODE, ACTIONS
from accel_graph.errors import (
    AccelGraphError,
    BackendUnavailable,
    ConfigError,
    OutOfMemoryError,
    PoolError,
)

MIB = 1 << 20

# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, -(1 << 63), 1.5, "8", None])
def test_bad_sizes_are_config_errors(size, check_engine):
    e = Engine()
    with pytest.raises(ConfigError):
        e.malloc(size)
    check_engine(e)
    assert e.memory_stats()["num_ooms"] == 0


@pytest.mark.parametrize("size", [1 << 60, (1 << 63) - 1, 1 << 70])
def test_absurd_sizes_are_oom_like_torch(size):
    e = Engine()
    with pytest.raises(OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        e.malloc(size)
    assert e.malloc(512) > 0  # still usable


def test_bad_frees_are_refused_and_change_nothing(check_engine):
    e = Engine(streams=2)
    p = e.malloc(4096)
    e.free(p)
    q = e.malloc(MIB)
    before = (e.memory_stats(), e.layout())
    for bad in (p + 512, 12345, 0, q + 512):
        with pytest.raises(ConfigError, match="not an allocated block"):
            e.free(bad)
    with pytest.raises(ConfigError):
        e.free(-1)
    with pytest.raises(ConfigError):
        e.free("0x1")
    e.record_stream(q, 1)
    e.free(q)
    with pytest.raises(ConfigError, match="already freed"):
        e.free(q)  # pending on another stream, still refused
    e.process_events()
    with pytest.raises(ConfigError):
        e.free(q)
    after = check_engine(e)
    assert before[0]["allocation.all.current"] == 1
    assert e.memory_stats()["allocation.all.current"] == 0
    assert len(after) == len(before[1])


def test_unknown_streams_and_pools(check_engine):
    e = Engine(streams=2)
    with pytest.raises(ConfigError, match="unknown stream 2"):
        e.malloc(512, stream=2)
    with pytest.raises(ConfigError):
        e.malloc(512, stream=-1)
    p = e.malloc(512)
    with pytest.raises(ConfigError):
        e.record_stream(p, 7)
    with pytest.raises(ConfigError):
        e.record_stream("p", 1)
    with pytest.raises(PoolError, match="pool 42 is not a pool"):
        e.pool_use_count(42)
    with pytest.raises(PoolError):
        e.malloc(512, pool=99)
    with pytest.raises(PoolError):
        e.begin_allocate_to_pool(99)
    with pytest.raises(AccelGraphError, match="not currently allocating"):
        e.end_allocate_to_pool(99)
    pool = e.create_pool()
    e.release_pool(pool)
    with pytest.raises(PoolError, match="released"):
        e.malloc(512, pool=pool)
    with pytest.raises(PoolError):
        e.release_pool(pool)
    pool2 = e.create_pool()
    e.begin_allocate_to_pool(pool2)
    with pytest.raises(AccelGraphError, match="already allocating"):
        e.begin_allocate_to_pool(pool2)
    assert e.create_stream() == 2
    check_engine(e)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_split_size": 10 * MIB},  # below the large segment size
        {"large_segment_size": 3 * MIB},
        {"roundup_power2_divisions": 3},
        {"roundup_power2_divisions": [4] * 15},
        {"garbage_collection_threshold": 1.0},
        {"memory_fraction": 0.5},  # no capacity known on the counting upstream
        {"memory_fraction": 1.5, "cap": MIB},
        {"cap": -1},
        {"device_kind": "rocm"},
    ],
)
def test_bad_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        Engine(settings=EngineSettings(**kwargs))


def test_bad_policy_and_upstream():
    with pytest.raises(ConfigError):
        Engine("cudaMallocAsync")
    with pytest.raises(ConfigError):
        Engine(upstream="disk")
    with pytest.raises(ConfigError):
        Engine(streams=0)


def test_closed_engine_refuses_calls():
    e = Engine()
    e.malloc(512)
    e.close()
    with pytest.raises(AccelGraphError, match="closed"):
        e.malloc(512)
    e.close()  # idempotent


# -- out of memory --------------------------------------------------------------------------------


def test_cap_oom_message_and_recovery(check_engine):
    e = Engine(settings=EngineSettings(cap=100 * MIB))
    e.enable_events()
    a = e.malloc(60 * MIB)
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(60 * MIB)
    msg = str(info.value)
    assert msg.startswith("CUDA out of memory. Tried to allocate 60.00 MiB.")
    assert "total capacity of 100.00 MiB of which 40.00 MiB is free" in msg
    assert "60.00 MiB is allocated by PyTorch" in msg
    assert "0 bytes is reserved by PyTorch but unallocated" in msg
    assert "expandable_segments:True" in msg
    assert isinstance(info.value, MemoryError)
    stats = e.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    events = e.drain_events()
    oom = events[events["action"] == ACTION_CODE["oom"]]
    assert len(oom) == 1 and oom["size"][0] == 60 * MIB and oom["addr"][0] == 40 * MIB
    # still usable: free and allocate again
    e.free(a)
    b = e.malloc(60 * MIB)
    e.free(b)
    check_engine(e)


def test_oom_reports_fragmentation_and_private_pools():
    e = Engine(settings=EngineSettings(cap=100 * MIB))
    pool = e.create_pool()
    with e.allocate_to_pool(pool):
        e.free(e.malloc(20 * MIB))  # 20 MiB cached in a private pool
    keep = [e.malloc(3 * MIB) for _ in range(4)]  # 12 MiB in a 20 MiB segment: 8 MiB cached
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(70 * MIB)
    msg = str(info.value)
    assert "with 20.00 MiB allocated in private pools" in msg
    assert "32.00 MiB is allocated by PyTorch" in msg
    assert "8.00 MiB is reserved by PyTorch but unallocated" in msg
    assert keep


def test_oom_hint_is_dropped_with_expandable_segments():
    e = Engine(settings=EngineSettings(cap=40 * MIB, expandable_segments=True))
    e.malloc(30 * MIB)
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(30 * MIB)
    assert "expandable_segments:True" not in str(info.value)


def test_policy_tables_cover_every_policy():
    """A new policy is a name in POLICIES plus its rows in POLICY_KEYS and POLICY_MODELS: the
    tuner, the OOM message and the CLI's --policy help read them."""
    from accel_graph.allocator.core.settings import POLICIES, POLICY_KEYS, POLICY_MODELS

    assert set(POLICY_KEYS) == set(POLICIES) == set(POLICY_MODELS)


@pytest.mark.parametrize("policy", ["xpu", "bfc"])
def test_oom_hint_follows_the_policy_keys(policy):
    """torch's expandable-segments hint stays for a policy that honours the key (xpu) and is
    replaced by what the policy models for one that does not (bfc)."""
    e = Engine(policy, settings=EngineSettings(cap=40 * MIB))
    e.malloc(30 * MIB)
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(30 * MIB)
    msg = str(info.value)
    if policy == "xpu":
        assert "expandable_segments:True" in msg and "policy xpu" not in msg
    else:
        assert "expandable_segments:True" not in msg
        assert msg.endswith("(policy bfc: a model of TensorFlow's BFC allocator; torch's allocator "
                            "settings do not apply)")


# -- statistics keys -------------------------------------------------------------------------------


def test_memory_stats_has_torchs_keys():
    stats = Engine().memory_stats()
    for name in TORCH_STAT_NAMES:
        for pool in ("all", "small_pool", "large_pool"):
            for f in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{f}" in stats
    for key in (
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "oversize_allocations.current",
        "oversize_segments.peak",
        "accel.device_maps",
    ):
        assert key in stats
    assert stats["max_split_size"] == -1
    assert list(stats) == sorted(stats)


def test_peak_and_accumulated_counters():
    e = Engine()
    p = e.malloc(3 * MIB)
    e.free(p)
    s = e.memory_stats()
    assert s["allocated_bytes.all.peak"] == 3 * MIB
    assert s["allocated_bytes.all.allocated"] == s["allocated_bytes.all.freed"] == 3 * MIB
    e.reset_peak_stats()
    e.reset_accumulated_stats()
    s = e.memory_stats()
    assert s["allocated_bytes.all.peak"] == 0 and s["allocated_bytes.all.allocated"] == 0
    assert s["reserved_bytes.all.peak"] == 20 * MIB  # still reserved


def test_snapshot_shape():
    e = Engine()
    p = e.malloc(100)
    (seg,) = e.snapshot()
    assert set(seg) == {
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "requested_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    }
    assert seg["allocated_size"] == seg["active_size"] == 512 and seg["requested_size"] == 100
    assert set(seg["blocks"][0]) == {"address", "size", "requested_size", "state", "frames"}
    assert seg["blocks"][0]["address"] == p


# -- events ------------------------------------------------------------------------------------------


def test_events_use_the_trace_action_codes():
    e = Engine()
    e.free(e.malloc(100))  # nothing recorded while disabled
    assert len(e.drain_events()) == 0
    e.enable_events()
    p = e.malloc(3 * MIB)
    e.free(p)
    e.empty_cache()
    ev = e.drain_events()
    assert ev.dtype == EVENT_DTYPE
    names = [ACTIONS[a] for a in ev["action"]]
    assert names == [
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "segment_free",
        "segment_free",  # the small segment of the first, unrecorded malloc
    ]
    assert list(ev["seq"]) == list(range(6))
    assert abs(int(ev["time_us"][0]) - time.time() * 1e6) < 600e6  # Unix-epoch microseconds
    assert ev["size"][1] == 3 * MIB and ev["addr"][1] == p
    assert len(e.drain_events()) == 0


def test_event_ring_keeps_the_newest():
    e = Engine()
    e.enable_events(max_entries=3)
    for _ in range(5):
        e.free(e.malloc(512))
    ev = e.drain_events()
    assert len(ev) == 3 and ev["seq"][-1] == ev["seq"][0] + 2
    e.disable_events()
    e.malloc(512)
    assert len(e.drain_events()) == 0


def test_events_carry_stream_and_pool_id():
    e = Engine(streams=2)
    pool = e.create_pool()
    e.enable_events()
    with e.allocate_to_pool(pool, stream=1):
        e.malloc(100, stream=1)
    ev = e.drain_events()
    assert set(ev["pool_id"]) == {pool} and set(ev["stream"]) == {1}


# -- replay ------------------------------------------------------------------------------------------


def test_replay_goes_on_after_oom_and_reports_bad_ops():
    e = Engine(settings=EngineSettings(cap=50 * MIB))
    ops = np.array(
        [
            (OP["malloc"], 0, 40 * MIB, 0, 0),
            (OP["malloc"], 0, 40 * MIB, 1, 0),  # OOM: slot 1 stays empty
            (OP["free"], 0, 0, 1, 0),  # skipped
            (OP["free"], 0, 0, 0, 0),
            (OP["malloc"], 0, 40 * MIB, 1, 0),
        ],
        dtype=OP_DTYPE,
    )
    res = e.replay(ops)
    assert res[0] > 0 and res[1] < 0 and res[4] == res[0]
    assert e.memory_stats()["num_ooms"] == 1
    bad = np.array([(OP["malloc"], 5, 512, 0, 0)], dtype=OP_DTYPE)
    with pytest.raises(ConfigError, match="replay stopped at op 0"):
        e.replay(bad)


# -- upstreams -----------------------------------------------------------------------------------------


def test_host_upstream_gives_real_memory():
    e = Engine(upstream="host", settings=EngineSettings(expandable_segments=True, cap=64 * MIB))
    p = e.malloc(5 * MIB)
    ctypes.memset(p, 7, 5 * MIB)
    assert ctypes.string_at(p, 4) == b"\x07" * 4
    e.free(p)
    e.empty_cache()
    assert e.memory_stats()["accel.upstream_bytes"] == 0
    e.close()


def test_device_upstream_with_a_missing_library_names_the_paths():
    s = EngineSettings(device_libs=("/nonexistent/libcudart.so", "libnothing-here.so.1"))
    with pytest.raises(BackendUnavailable) as info:
        Engine(upstream="device", settings=s)
    assert "/nonexistent/libcudart.so" in str(info.value)
    assert "libnothing-here.so.1" in str(info.value)


def test_device_upstream_refuses_expandable_segments():
    with pytest.raises(ConfigError, match="virtual-memory"):
        Engine(upstream="device", settings=EngineSettings(expandable_segments=True))


_FAKE_RUNTIME = r"""
#include <stdlib.h>
static size_t used, total = 64u << 20;
int cudaMalloc(void **p, size_t n) {
    if (used + n > total) return 2; /* cudaErrorMemoryAllocation */
    *p = malloc(n); if (!*p) return 2; used += n; return 0;
}
int cudaFree(void *p) { free(p); return 0; }
int cudaMemGetInfo(size_t *fr, size_t *tot) { *fr = total - used; *tot = total; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the fake runtime")
def test_device_upstream_through_a_fake_cuda_runtime(tmp_path, check_engine):
    """dlopen/dlsym plumbing on a CPU box: a stand-in libcudart backed by malloc."""
    src = tmp_path / "fake.c"
    src.write_text(_FAKE_RUNTIME)
    lib = tmp_path / "libfakecudart.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], check=True)
    e = Engine(upstream="device", settings=EngineSettings(device_libs=(str(lib),)))
    assert e.capacity == 64 * MIB  # from cudaMemGetInfo
    p = e.malloc(30 * MIB)
    ctypes.memset(p, 1, 30 * MIB)
    with pytest.raises(
        OutOfMemoryError, match="total capacity of 64.00 MiB of which 34.00 MiB is free"
    ):
        e.malloc(40 * MIB)  # the fake runtime says cudaErrorMemoryAllocation
    e.free(p)
    check_engine(e)
    e.close()


def test_numpy_layouts_match_the_c_structs():
    from accel_graph.allocator.core.loader import load_core as _core

    ffi = _core().ffi
    assert EVENT_DTYPE.itemsize == ffi.sizeof("ag_event")
    assert OP_DTYPE.itemsize == ffi.sizeof("ag_op")
    assert [f for f, _ in ffi.typeof("ag_op").fields] == list(OP_DTYPE.names)
    assert [f for f, _ in ffi.typeof("ag_event").fields] == list(EVENT_DTYPE.names)


def test_threads_can_share_an_engine(check_engine):
    """cffi releases the GIL around C calls; the engine serialises them itself."""
    import threading

    e = Engine(streams=2)
    errors = []

    def worker(stream):
        try:
            for i in range(3000):
                p = e.malloc(512 * (1 + i % 7), stream)
                if i % 3 == 0:
                    e.record_stream(p, 1 - stream)
                e.free(p)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    e.synchronize()
    check_engine(e)
    assert e.memory_stats()["allocation.all.current"] == 0


def test_importing_the_engine_loads_no_compiled_code():
    code = (
        "import sys, accel_graph.allocator.core.engine as m; "
        "assert 'accel_graph.allocator.core._core' not in sys.modules; "
        "m.Engine(); assert 'accel_graph.allocator.core._core' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_core_says_how_to_rebuild(monkeypatch):
    from accel_graph.allocator.core import loader as mod

    def refuse(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(mod, "_core_module", None)
    monkeypatch.setattr(mod.importlib, "import_module", refuse)
    with pytest.raises(BackendUnavailable, match="reinstall the package"):
        Engine()
