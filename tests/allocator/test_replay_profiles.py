"""Profile-aware replay: engine rounding equals profiles.round_requests, the pytorch#193400
version flag, profile resolution and notes, peaks and kept events, private pools."""

from __future__ import annotations

import numpy as np
import pytest

from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.settings import EngineSettings, round_size
from accel_graph.allocator.sim.profiles import PROFILES, ROUNDING_RULES, round_requests
from accel_graph.allocator.sim.replayer import apply_profile, replay_trace
from accel_graph.allocator.traces import Trace, segments_from_layout

MIB = 1 << 20

# one profile per rounding rule, plus the build that ignores roundup_power2_divisions
ROUNDING_PROFILES = ["cuda-2.13", "npu", "xpu", "cuda-2.13-rp2-ignored"]


def test_every_rounding_rule_is_covered():
    assert {PROFILES[n].rounding for n in ROUNDING_PROFILES} == set(ROUNDING_RULES)


def _random_sizes(seed: int, n: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = np.concatenate((
        rng.integers(1, 4096, n), rng.integers(1, 2 * MIB, n), rng.integers(MIB, 300 * MIB, n),
        np.array([1, 480, 481, 511, 512, 513, MIB - 32, MIB - 33, MIB, 2 * MIB, 11 * MIB + 1]),
    ))
    return sizes.astype(np.int64)


@pytest.mark.parametrize("name", ROUNDING_PROFILES)
@pytest.mark.parametrize("divisions", [0, 4])
def test_engine_rounding_equals_profiles(name, divisions):
    """One place for rounding rules: the engine, set up by apply_profile, gives every request
    the block size that profiles.round_requests says (round_size and real blocks)."""
    base = EngineSettings(roundup_power2_divisions=divisions, expandable_segments=True)
    es, policy, _ = apply_profile(base, name)
    sizes = _random_sizes(divisions + len(name))
    expect = round_requests(sizes, name, divisions)
    assert [round_size(int(s), es, policy) for s in sizes] == expect.tolist()
    # real blocks: in expandable segments every block is split exactly to its rounded size
    e = Engine(policy, "counting", es)
    got = []
    for s in sizes.tolist():
        p = e.malloc(s)
        got.append(e.block_size(p))
        e.free(p)
    assert got == expect.tolist()


def test_round_extra_validation():
    from accel_graph.errors import ConfigError

    with pytest.raises(ConfigError):
        Engine("native", "counting", EngineSettings(round_extra=1 << 31))


# -- pytorch#193400 --------------------------------------------------------------------------

REPRO_SETTINGS = EngineSettings(max_split_size=128 * MIB, expandable_segments=True,
                                cap=16 << 30)


def _repro(engine: Engine, cycles: int = 100) -> None:
    """allocator-semantics.md 3.2/4.4: 91 MiB + 45.5 MiB + a live 2 MiB pin, x100 (the two
    big tensors are freed each cycle, the pins stay)."""
    for _ in range(cycles):
        a = engine.malloc(91 * MIB)
        b = engine.malloc(91 * MIB // 2)
        engine.malloc(2 * MIB)
        engine.free(a)
        engine.free(b)


@pytest.mark.parametrize("rule, peak_mib", [(True, 13_860), (False, 340)])
def test_pytorch_193400_engine_flag(rule, peak_mib):
    from dataclasses import replace

    e = Engine("native", "counting", replace(REPRO_SETTINGS, expandable_oversize_rule=rule))
    _repro(e)
    st = e.memory_stats()
    assert st["reserved_bytes.all.peak"] == peak_mib * MIB
    assert st["allocated_bytes.all.current"] == 200 * MIB


def test_pytorch_193400_by_profile():
    """Recorded once (2.13 engine), replayed as torch 2.13 and as torch 2.9: reserved grows
    ~139 MiB per cycle under 2.13 (13,860 MiB after 100 cycles, 200 MiB allocated) and stays
    140 MiB above the live pins under 2.9 (340 MiB). With 50 cycles: 6,940 vs 240 MiB."""
    e = Engine("native", "counting", REPRO_SETTINGS)
    e.enable_events()
    _repro(e)
    trace = Trace.from_events(e.drain_events(), segments=segments_from_layout(e.layout()))
    new = replay_trace(trace, REPRO_SETTINGS, profile="cuda-2.13")
    old = replay_trace(trace, REPRO_SETTINGS, profile="cuda-2.9")
    assert new.peak_reserved == 13_860 * MIB and new.profile == "cuda-2.13"
    assert old.peak_reserved == 340 * MIB and old.profile == "cuda-2.9"
    assert any("2.9-2.11" in n for n in old.notes)
    assert any("193400" in n for n in new.notes)
    e2 = Engine("native", "counting", REPRO_SETTINGS)
    e2.enable_events()
    _repro(e2, 50)
    half = Trace.from_events(e2.drain_events(), segments=segments_from_layout(e2.layout()))
    assert replay_trace(half, REPRO_SETTINGS, profile="cuda-2.13").peak_reserved == 6_940 * MIB
    assert replay_trace(half, REPRO_SETTINGS, profile="cuda-2.9").peak_reserved == 240 * MIB


# -- profile resolution and notes ------------------------------------------------------------


def _small_trace(settings: EngineSettings, device_type: str = "cuda") -> Trace:
    e = Engine("native", "counting", settings)
    e.enable_events()
    ptrs = [e.malloc(s) for s in (3 * MIB, 100, 5 * MIB + 7, 40 * MIB)]
    for p in ptrs[::2]:
        e.free(p)
    t = Trace.from_events(e.drain_events(), segments=segments_from_layout(e.layout()),
                          device_type=device_type)
    return t


@pytest.mark.parametrize("given, name", [
    (None, "cuda-2.14"), ("cuda", "cuda-2.14"), ("hip", "rocm-2.13"), ("rocm", "rocm-2.13"),
    ("npu", "npu"), ("xpu", "xpu"), ("cuda-2.9", "cuda-2.9"), ("rocm-6", "rocm-6"),
    (PROFILES["cuda-2.12"], "cuda-2.12"),
])  # fmt: skip
def test_profile_names(given, name):
    assert replay_trace(_small_trace(EngineSettings()), profile=given).profile == name


def test_profile_default_from_device_type_and_unknown():
    assert replay_trace(_small_trace(EngineSettings(), "xpu")).profile == "xpu"
    with pytest.raises(KeyError, match="known|profiles"):
        replay_trace(_small_trace(EngineSettings()), profile="tpu")


def test_rocm6_turns_expandable_off_with_a_note():
    t = _small_trace(EngineSettings(expandable_segments=True))
    r = replay_trace(t, profile="rocm-6")
    assert r.maps == 0 and r.device_mallocs > 0
    assert any("expandable_segments" in n and "not available" in n for n in r.notes)
    assert replay_trace(t, profile="rocm-2.13").maps > 0


def test_xpu_policy_unless_given():
    es, pol, notes = apply_profile(EngineSettings(max_split_size=200 * MIB), "xpu")
    assert pol == "xpu" and any("max_split" in n for n in notes)
    es, pol, notes = apply_profile(EngineSettings(), "xpu", policy="native")
    assert pol == "native" and any("explicitly" in n for n in notes)
    assert es.roundup_power2_divisions == 0


def test_roundup_not_applied_and_large_segment_fixed():
    es, _, notes = apply_profile(EngineSettings(roundup_power2_divisions=4),
                                 "cuda-2.13-rp2-ignored")
    assert es.divisions() == (0,) * 16 and notes
    # before 2.11 the large segment is a fixed 20 MiB (cuda-2.9); 2.11 parses the key (measured)
    es, _, notes = apply_profile(EngineSettings(large_segment_size=40 * MIB), "cuda-2.9")
    assert es.large_segment_size == 20 * MIB and any("large_segment_size" in n for n in notes)
    for name in ("cuda-2.11", "cuda-2.12"):
        es, _, _ = apply_profile(EngineSettings(large_segment_size=40 * MIB), name)
        assert es.large_segment_size == 40 * MIB
    es, _, _ = apply_profile(EngineSettings(large_segment_size=40 * MIB), "cuda-2.13")
    assert es.large_segment_size == 40 * MIB
    es, _, _ = apply_profile(EngineSettings(), "cuda-2.9")
    assert es.expandable_oversize_rule is False
    es, _, _ = apply_profile(EngineSettings(), "npu")
    assert es.round_extra == 32


def test_npu_head_alignment_in_the_engine():
    """torch_npu (base_addr_aligned_kb, 16 KiB): with expandable segments a block of 2 MiB or
    more that would start off a 16 KiB boundary starts at the next one, and the skipped head
    stays a free block; smaller requests and native segments are not moved."""
    es, _, notes = apply_profile(EngineSettings(expandable_segments=True), "npu")
    assert es.expandable_head_align == 16384 and any("16 KiB" in n for n in notes)
    assert apply_profile(EngineSettings(), "npu")[0].expandable_head_align == 0
    assert apply_profile(es, "cuda-2.13")[0].expandable_head_align == 0
    e = Engine("native", "counting", es)
    a = e.malloc(1000)  # small pool
    b = e.malloc(3 * MIB + 100)  # 3 MiB + 512: ends off a 16 KiB boundary
    c = e.malloc(1_905_152)  # under 2 MiB: not moved
    d = e.malloc(2 * MIB)  # moved to the next 16 KiB boundary
    assert b % 16384 == 0 and c == b + e.block_size(b) and c % 16384 != 0
    assert d % 16384 == 0 and 0 < d - (c + e.block_size(c)) < 16384
    seg = next(s for s in e.layout() if not s["is_small"])
    head = next(x for x in seg["blocks"] if x["address"] == c + e.block_size(c))
    assert head["state"] == "inactive" and head["size"] == d - head["address"]
    e.free(c)
    e.free(d)  # the head merges back with its free neighbours
    assert [x["state"] for x in e.layout()[-1]["blocks"]][:2] == ["active_allocated", "inactive"]
    del a
    native = Engine("native", "counting", apply_profile(EngineSettings(), "npu")[0])
    native.malloc(3 * MIB + 100)
    assert native.malloc(2 * MIB) % 16384 != 0
    from accel_graph.errors import ConfigError

    with pytest.raises(ConfigError):
        Engine("native", "counting", EngineSettings(expandable_head_align=1000))


# -- peaks and events ------------------------------------------------------------------------


@pytest.mark.parametrize("expandable", [False, True])
def test_peaks_and_kept_events(expandable):
    rng = np.random.default_rng(1)
    settings = EngineSettings(expandable_segments=expandable)
    e = Engine("native", "counting", settings)
    e.enable_events()
    live = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            e.free(live.pop(int(rng.integers(len(live)))))
        else:
            live.append(e.malloc(int(rng.choice([rng.integers(1, 4096), rng.integers(MIB, 30 * MIB)]))))
    st = e.memory_stats()
    trace = Trace.from_events(e.drain_events(), segments=segments_from_layout(e.layout()))
    r = replay_trace(trace, settings, keep_events=True)
    assert r.peak_allocated == st["allocated_bytes.all.peak"]
    assert r.peak_active == st["active_bytes.all.peak"]
    assert r.peak_requested == st["requested_bytes.all.peak"]
    assert r.peak_reserved == st["reserved_bytes.all.peak"]
    c = r.curves()
    assert len(c["seq"]) == len(r.events) == len(trace.events(0))
    assert int(c["reserved"].max()) == r.peak_reserved
    assert int(c["requested"].max()) == r.peak_requested
    assert r.start_stats["reserved_bytes.all.current"] == 0
    plain = replay_trace(trace, settings)
    assert plain.events is None and plain.start_stats is None
    with pytest.raises(ValueError):
        plain.curves()


def test_peaks_exclude_the_prologue():
    """A mid-run recording: the prologue's placeholder blocks do not count in the peaks."""
    e = Engine("native", "counting", EngineSettings())
    keep = [e.malloc(8 * MIB) for _ in range(4)]
    e.free(keep.pop())
    e.enable_events()
    p = e.malloc(MIB // 2)
    e.free(p)
    trace = Trace.from_events(e.drain_events(), segments=segments_from_layout(e.layout()))
    r = replay_trace(trace, EngineSettings())
    assert r.start_reserved == 40 * MIB  # 8 + 8 (+ 4 free) in one segment, 8 in another
    assert r.peak_allocated == 3 * 8 * MIB + MIB // 2
    assert r.peak_requested == 3 * 8 * MIB + MIB // 2


# -- private pools ---------------------------------------------------------------------------


def test_private_pool_does_not_reuse_default_memory():
    """A trace whose allocations in a private pool (graph capture / MemPool) come after the
    default pool freed the same amount: the replay keeps them apart as torch does."""
    e = Engine("native", "counting", EngineSettings())
    pool = e.create_pool()
    e.enable_events()
    a = e.malloc(10 * MIB)
    e.free(a)
    b = e.malloc(10 * MIB, pool=pool)
    c = e.malloc(100)
    d = e.malloc(100, pool=pool)
    e.free(b)
    e.free(d)
    st = e.memory_stats()
    ev = e.drain_events()
    assert set(ev["pool_id"].tolist()) == {0, pool}
    trace = Trace.from_events(ev, segments=segments_from_layout(e.layout()))
    assert set(trace.events(0)["pool"].tolist()) == {0, pool}
    r = replay_trace(trace, EngineSettings(), keep_layout=True)
    assert r.device_mallocs == st["accel.device_mallocs"] == 4
    assert r.peak_reserved == st["reserved_bytes.all.peak"] == 24 * MIB
    assert r.pools == {pool: 1}
    assert any("private pool" in n for n in r.notes)
    assert sorted((s["pool_id"], s["size"]) for s in r.layout) == [
        (0, 2 * MIB), (0, 10 * MIB), (1, 2 * MIB), (1, 10 * MIB)]
    # the same trace without pool ids (as torch writes it): the pools come back from the
    # final segments' segment_pool_id (0, pool), and so does the replay
    flat = trace.events(0).copy()
    flat["pool"] = 0
    trace.device_traces[0] = flat
    r1 = replay_trace(trace, EngineSettings())
    assert r1.device_mallocs == 4 and r1.pools == {pool: 1}
    # with the segments in the default pool too, it reuses the freed default block
    trace.segments = [dict(s, segment_pool_id=(0, 0)) for s in trace.segments]
    r0 = replay_trace(trace, EngineSettings())
    assert r0.device_mallocs == 2 and r0.peak_reserved == 12 * MIB and not r0.pools
    del c


def test_rocm_trace_replays_with_its_recorded_settings():
    """A ROCm trace's recorded settings read in the HIP dialect (they once raised ConfigError:
    "rocm" went to the config parser, which knows "hip")."""
    t = _small_trace(EngineSettings(), "rocm")
    t.allocator_settings = {"PYTORCH_ALLOC_CONF": "backend:hipMallocAsync,max_split_size_mb:40"}
    r = replay_trace(t)
    assert r.profile == "rocm-2.13"
    assert replay_trace(t).peak_reserved == replay_trace(t, profile="rocm-2.13").peak_reserved
