"""Allocator profiles (accel_graph.allocator.sim.profiles) and the Ascend NPU rounding rule,
checked against the real NPU snapshots in shared/traces/npu/ (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_graph.allocator.core.settings import EngineSettings, round_size
from accel_graph.allocator.sim.profiles import (
    PROFILES,
    ROUNDING_RULES,
    Profile,
    get_profile,
    profile_for,
    round_request,
    round_requests,
)
from accel_graph.allocator.traces import load_trace

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _npu_dir() -> Path | None:
    for base in (ROOT / "shared", ROOT.parent / "shared"):
        d = base / "traces" / "npu"
        if d.is_dir() and any(d.glob("*.pkl")):
            return d
    return None


NPU = _npu_dir()
needs_npu = pytest.mark.skipif(NPU is None, reason="shared/traces/npu not found beside the repo")


def test_registry():
    assert {"cuda-2.9", "cuda-2.11", "cuda-2.12", "cuda-2.13", "cuda-2.14", "rocm-2.13", "npu", "xpu"} <= set(PROFILES)
    for name, p in PROFILES.items():
        assert isinstance(p, Profile) and p.name == name
        assert p.rounding in ROUNDING_RULES and p.policy in ("native", "xpu")
        assert p.notes and p.references
    with pytest.raises(KeyError, match="known"):
        get_profile("cuda-1.0")
    with pytest.raises(AttributeError):
        get_profile("npu").name = "x"  # frozen


def test_profile_for_versions():
    assert profile_for("2.9.1", "cuda").name == "cuda-2.9"
    assert profile_for("2.10.0", "cuda").name == "cuda-2.9"
    assert profile_for("2.11.0+cu130", "cuda").name == "cuda-2.11"
    assert profile_for("2.12.0+cu128", "cuda").name == "cuda-2.12"
    assert profile_for((2, 13), "cuda").name == "cuda-2.13"
    assert profile_for("2.14.0.dev20260101", "cuda").name == "cuda-2.14"
    assert profile_for("2.14.1+cu130", "cuda").name == "cuda-2.14"
    assert profile_for("2.13.0+cpu", "cuda").name == "cuda-2.13"
    assert profile_for("2.15.0", "cuda").name == "cuda-2.14"
    assert profile_for("2.13.0", "hip").name == "rocm-2.13"
    assert profile_for("2.6.0", "npu").name == "npu"
    assert profile_for("2.13.0", "xpu").policy == "xpu"
    with pytest.raises(ValueError):
        profile_for("2.13", "tpu")
    with pytest.raises(ValueError):
        profile_for("banana", "cuda")


def test_version_behaviour_flags():
    """pytorch#193400: the max_split + expandable-segments growth is 2.12+, not 2.9."""
    assert not get_profile("cuda-2.9").max_split_blocks_expandable_reuse
    assert get_profile("cuda-2.12").max_split_blocks_expandable_reuse
    assert get_profile("cuda-2.13").max_split_blocks_expandable_reuse
    assert not get_profile("cuda-2.11").max_split_blocks_expandable_reuse  # assumed like 2.9.1
    assert "large_segment_size_mb" not in get_profile("cuda-2.9").settings_keys
    assert "large_segment_size_mb" in get_profile("cuda-2.11").settings_keys
    assert "large_segment_size_mb" in get_profile("cuda-2.12").settings_keys
    assert "large_segment_size_mb" in get_profile("cuda-2.13").settings_keys
    assert get_profile("cuda-2.13").throw_on_cudamalloc_oom
    assert not get_profile("cuda-2.12").throw_on_cudamalloc_oom
    assert not get_profile("rocm-6").expandable_segments


@pytest.mark.parametrize("size", [1, 4, 511, 512, 513, 1200, 16384, MIB - 1, MIB, 3 * MIB + 7,
                                  5 * MIB + 123, 700 * MIB + 1])  # fmt: skip
@pytest.mark.parametrize("divisions", [0, 4])
def test_cuda_rounding_matches_engine(size, divisions):
    expect = round_size(size, EngineSettings(roundup_power2_divisions=divisions))
    assert round_request(size, "cuda-2.13", divisions) == expect
    assert round_request(size, "xpu", divisions) == round_size(size, policy="xpu")


def test_npu_rounding_rule():
    assert round_request(16384, "npu") == 16384 + 512
    assert round_request(4, "npu") == 512
    assert round_request(480, "npu") == 512
    assert round_request(481, "npu") == 1024
    assert round_request(MIB, "npu") == MIB + 512  # goes to the large pool
    with pytest.raises(ValueError):
        round_request(0, "npu")


@needs_npu
def test_npu_rule_on_real_snapshots():
    """Every live block: size == ceil((requested + 32) / 512) * 512, except large-pool blocks
    that were not split, which are bigger by an un-split remainder of at most 1 MiB."""
    files = sorted(NPU.glob("*.pkl"))
    checked = exact = multiples = 0
    for f in files:
        trace = load_trace(f)
        assert trace.device_type == "npu"
        for seg in trace.segments:
            for b in seg["blocks"]:
                if b["state"] != "active_allocated":
                    continue
                r, size = b["requested_size"], b["size"]
                want = round_request(r, "npu")
                checked += 1
                if size == want:
                    exact += 1
                    if r % 512 == 0:
                        multiples += 1
                        assert size == r + 512
                    continue
                # only unsplit large-pool blocks may differ (remainder <= 1 MiB not split)
                assert seg["segment_type"] == "large" and not seg["is_expandable"], (f, r, size)
                assert 0 < size - want <= MIB, (f, r, size)
    assert checked > 1000 and exact / checked > 0.99 and multiples > 500


@pytest.mark.parametrize("name", ["cuda-2.13", "npu", "xpu", "cuda-2.13-rp2-ignored"])
@pytest.mark.parametrize("divisions", [0, 4])
def test_vectorised_rounding(name, divisions):
    sizes = [1, 4, 511, 512, 513, 1200, 16384, MIB - 1, MIB, 3 * MIB + 7, 700 * MIB + 1]
    got = round_requests(sizes, name, divisions)
    assert got.tolist() == [round_request(x, name, divisions) for x in sizes]


def test_cuda_211_keys_are_what_torch_211_accepts():
    """The cuda-2.11 profile honours exactly the keys torch 2.11.0+cu130's parser accepted on
    its frozen table (tests/allocator/data/alloc_conf_torch-2.11.json) among the CUDA keys the
    newest profile knows: measured, not copied from 2.13."""
    import json

    table = json.loads((Path(__file__).parent / "data" / "alloc_conf_torch-2.11.json").read_text())
    assert table["torch"].startswith("2.11.")
    refused = {t.split(":")[0] for t, o in table["outcomes"].items()
               if o and o[1].startswith("Unrecognized key '") and t.count(":") == 1
               and o[1] == f"Unrecognized key '{t.split(':')[0]}' in Accelerator allocator config."}
    newest = get_profile("cuda-2.14").settings_keys
    assert newest - get_profile("cuda-2.11").settings_keys == refused & newest
    assert refused & newest == {"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                                "pinned_free_catch_all", "throw_on_cudamalloc_oom"}
    assert "measured on torch 2.11.0+cu130 only" in get_profile("cuda-2.11").notes
