"""Allocator config strings: differential tests against the installed torch's own parser, values,
round trips.

torch's parser is reached through ``torch._C._accelerator_setAllocatorSettings``
(:func:`alloc_conf_parity.torch_outcome`). The rules compared are the installed torch's:
its version (``parse_config(torch=...)``) and its build kind (``device``: the CPU build
validates the common keys and skips the rest; a CUDA build, such as pip's default torch 2.14.1
even without a GPU, also runs the CUDA hook and refuses unknown keys). ``device="cuda"`` must
also match wherever only common keys occur. The frozen per-version tables are checked in
test_config_tables.py.
"""

from __future__ import annotations

import pytest
import torch
from alloc_conf_compare import mismatch
from alloc_conf_parity import (
    CORE_CORPUS,
    DEVICE_CORPUS,
    SKIPPED_ON_CPU_CORPUS,
    build_device,
    outcome_record,
    torch_minor,
    torch_outcome,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from accel_graph.allocator.alloc_conf import (
    CORE_KEYS,
    MIB,
    AllocatorSettings,
    parse_config,
    settings_from_environment,
    settings_from_snapshot,
)
from accel_graph.errors import ConfigError

_set = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
needs_torch_parser = pytest.mark.skipif(_set is None, reason="torch has no allocator-settings hook")
#: the installed torch's rules: its build kind and its version
BUILD = build_device() if _set is not None else "cpu"
TORCH = torch_minor()


def assert_same(text: str, device: str, version: str | None = TORCH) -> None:
    problem = mismatch(outcome_record(torch_outcome(text)), text, device, version)
    assert problem is None, problem


def test_corpus_is_large_enough() -> None:
    assert len(CORE_CORPUS) + len(SKIPPED_ON_CPU_CORPUS) >= 100


@needs_torch_parser
@pytest.mark.parametrize("text", CORE_CORPUS + SKIPPED_ON_CPU_CORPUS + DEVICE_CORPUS)
def test_build_rules_match_torch(text: str) -> None:
    """The installed build's rules (cpu, cuda, hip or xpu) accept and reject what it does."""
    assert_same(text, BUILD)


@needs_torch_parser
@pytest.mark.parametrize("text", CORE_CORPUS)
def test_cuda_rules_match_torch_on_common_keys(text: str) -> None:
    assert_same(text, "cuda")


_KEYS = list(CORE_KEYS) + ["backend", "foo", "pinned_num_register_threads"]
_VALUES = ["20", "25", "11", "10", "0.5", "True", "False", "4", "3", "0", ">", "-1", "abc", "1e-3"]
_PIECES = _KEYS + _VALUES + [":", ",", "[", "]", " "]


@needs_torch_parser
@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12))
def test_fuzz_build_rules_match_torch(pieces: list[str]) -> None:
    assert_same("".join(pieces), BUILD)


@needs_torch_parser
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(CORE_KEYS), st.sampled_from(_VALUES + ["[256:1,>:2]"])),
        max_size=4,
    )
)
def test_fuzz_well_formed_common_keys_match_torch_on_cuda(pairs: list[tuple[str, str]]) -> None:
    assert_same(",".join(f"{k}:{v}" for k, v in pairs), "cuda")


# --- values ---------------------------------------------------------------------------------


def test_defaults() -> None:
    s = parse_config("")
    assert s == AllocatorSettings()
    assert s.max_split_size is None
    assert s.large_segment_size == 20 * MIB
    assert s.max_non_split_rounding_size == 20 * MIB
    assert s.garbage_collection_threshold == 0.0
    assert s.roundup_power2_divisions == (0,) * 16
    assert s.per_process_memory_fraction == 1.0
    assert s.pinned_num_register_threads == 1
    assert s.backend == "native"


def test_sizes_are_bytes() -> None:
    s = parse_config("large_segment_size_mb:32,max_split_size_mb:128,max_non_split_rounding_mb:64")
    assert s.large_segment_size == 32 * MIB
    assert s.max_split_size == 128 * MIB
    assert s.max_non_split_rounding_size == 64 * MIB
    # max_non_split_rounding follows a changed large segment size when not given
    assert parse_config("large_segment_size_mb:40").max_non_split_rounding_size == 40 * MIB


def test_lenient_numbers_like_torch() -> None:
    assert parse_config("max_split_size_mb:100abc").max_split_size == 100 * MIB
    # stoull wraps '-1' to SIZE_MAX, then torch clamps to SIZE_MAX // MiB MiB
    assert parse_config("max_split_size_mb:-1").max_split_size == ((1 << 64) - 1) // MIB * MIB
    assert parse_config("garbage_collection_threshold:0x1p-1").garbage_collection_threshold == 0.5


@pytest.mark.parametrize(
    "text,expected",
    [
        ("roundup_power2_divisions:4", (4,) * 16),
        # K covers [K MiB, 2K MiB); the first entry fills below; '>' fills above the last one
        (
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
            (1,) * 9 + (2, 4) + (8,) * 5,
        ),
        ("roundup_power2_divisions:[>:4]", (0,) + (4,) * 15),
        ("roundup_power2_divisions:[64:8]", (8,) * 7 + (0,) * 9),
        ("roundup_power2_divisions:[65536:2]", (2,) * 16),
        ("roundup_power2_divisions:[1:2,4:4]", (2, 0, 4) + (0,) * 13),
        ("roundup_power2_divisions:[2:2,>:4,8:1]", (2, 2) + (4,) + (1,) + (4,) * 12),
        # torch's own C++ test string
        (
            "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]",
            (8,) * 8 + (16, 1, 0, 8) + (2,) * 4,
        ),
    ],
)
def test_roundup_semantics(text: str, expected: tuple[int, ...]) -> None:
    assert parse_config(text).roundup_power2_divisions == expected


def test_roundup_divisions_lookup() -> None:
    s = parse_config("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert s.roundup_divisions(100) == 1
    assert s.roundup_divisions(511 * MIB) == 1
    assert s.roundup_divisions(512 * MIB) == 2
    assert s.roundup_divisions(1024 * MIB) == 4
    assert s.roundup_divisions(2048 * MIB) == 8
    assert s.roundup_divisions(1 << 50) == 8


def test_device_keys_values() -> None:
    s = parse_config(
        "backend:cudaMallocAsync,release_lock_on_cudamalloc:True,pinned_use_hip_host_register:True,"
        "pinned_num_register_threads:8,pinned_reserve_segment_size_mb:16,"
        "graph_capture_record_stream_reuse:True,per_process_memory_fraction:0.25,"
        "pinned_free_catch_all:True,throw_on_cudamalloc_oom:True"
    )
    assert s.backend == "cudaMallocAsync"
    assert s.release_lock_on_cudamalloc and s.pinned_use_cuda_host_register
    assert s.pinned_num_register_threads == 8
    assert s.pinned_reserve_segment_size == 16 * MIB
    assert s.graph_capture_record_stream_reuse and s.pinned_free_catch_all
    assert s.throw_on_cudamalloc_oom
    assert s.per_process_memory_fraction == 0.25


def test_cpu_skips_device_keys() -> None:
    s = parse_config("backend:whatever,per_process_memory_fraction:7,foo:bar", device="cpu")
    assert s == AllocatorSettings(device="cpu")


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        (
            "backend:foo",
            "backend",
            "Unknown allocator backend, options are native and cudaMallocAsync",
        ),
        ("backend:hipMallocAsync", "backend", "options are native and cudaMallocAsync"),
        ("per_process_memory_fraction:2", "per_process_memory_fraction", "set it in [0.0, 1.0]"),
        ("per_process_memory_fraction:-0.1", "per_process_memory_fraction", "[0.0, 1.0]"),
        ("per_process_memory_fraction:x", "per_process_memory_fraction", "not a number"),
        (
            "pinned_num_register_threads:3",
            "pinned_num_register_threads",
            "has to be power of 2, got 3",
        ),
        ("pinned_num_register_threads:0", "pinned_num_register_threads", "power of 2, got 0"),
        (
            "pinned_num_register_threads:256",
            "pinned_num_register_threads",
            "should be less than or equal to 128, got 256",
        ),
        ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb", "greater than 0"),
        (
            "release_lock_on_cudamalloc:yes",
            "release_lock_on_cudamalloc",
            "Expected 'True' or 'False' at index 2",
        ),
        ("throw_on_cudamalloc_oom:true", "throw_on_cudamalloc_oom", "but got 'true'"),
        ("foo:bar", "foo", "Unrecognized key 'foo' in Accelerator allocator config."),
        ("max_split_size_mb:100,bogus:1", "bogus", "Unrecognized key 'bogus'"),
    ],
)
def test_cuda_rules_for_device_keys(text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cuda")
    assert fragment in str(info.value)
    assert info.value.key == key
    assert isinstance(info.value, ValueError)


def test_core_errors_come_before_device_errors() -> None:
    # torch runs the whole common pass before the CUDA hook, whatever the order in the string.
    with pytest.raises(ConfigError, match="max_split_size_mb too small"):
        parse_config("backend:foo,max_split_size_mb:5", "cuda")


def test_hip_rules() -> None:
    assert parse_config("backend:hipMallocAsync", "hip").backend == "hipMallocAsync"
    assert parse_config("release_lock_on_hipmalloc:True", "hip").release_lock_on_cudamalloc
    with pytest.raises(ConfigError, match="native, cudaMallocAsync, and hipMallocAsync"):
        parse_config("backend:x", "hip")


def test_xpu_rejects_device_keys() -> None:
    assert parse_config("expandable_segments:True", "xpu").expandable_segments
    with pytest.raises(ConfigError, match="Unrecognized key 'backend'"):
        parse_config("backend:native", "xpu")


@pytest.mark.parametrize(
    "text,key",
    [
        (",", ","),
        ("a:b,,", ","),
        ("max_split_size_mb", "max_split_size_mb"),
        ("a:b:c", "c"),
        ("roundup_power2_divisions:[256:1", "roundup_power2_divisions"),
        (":", ":"),
    ],
)
def test_malformed_strings_get_a_clear_error(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cpu")
    assert info.value.key == key
    assert "key:value" in str(info.value)


def test_errors_name_what_is_legal() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("garbage_collection_threshold:1.5")
    assert "garbage_collection_threshold" in str(info.value)
    assert "strictly between 0.0 and 1.0" in str(info.value)
    with pytest.raises(ConfigError, match="exactly True or False"):
        parse_config("expandable_segments:true")


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        parse_config("", device="tpu")
    with pytest.raises(ConfigError):
        parse_config(b"max_split_size_mb:20")  # type: ignore[arg-type]


# --- canonical strings ----------------------------------------------------------------------

ROUND_TRIP = [
    "",
    "max_split_size_mb:100abc",
    "max_split_size_mb:-1",
    "large_segment_size_mb:32,max_split_size_mb:64,max_non_split_rounding_mb:48",
    "garbage_collection_threshold:0.123456789,expandable_segments:True",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "roundup_power2_divisions:[>:4]",
    "roundup_power2_divisions:[2:2,>:4,8:1]",
    "roundup_power2_divisions:[1:2,4:4]",
    "roundup_power2_divisions:[4:0,8:2,16:0,>:0]",
    "roundup_power2_divisions:16",
    "pinned_max_round_threshold_mb:17592186044416,pinned_max_cached_size_mb:0",
    "pinned_use_background_threads:True,backend:cudaMallocAsync,pinned_num_register_threads:4",
    "release_lock_on_hipmalloc:True,pinned_use_cuda_host_register:True,throw_on_cudamalloc_oom:True",
    "pinned_reserve_segment_size_mb:9,per_process_memory_fraction:0,graph_capture_record_stream_reuse:True",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_canonical_string_round_trips(text: str) -> None:
    s = parse_config(text)
    canonical = s.to_string()
    again = parse_config(canonical)
    assert again == s
    assert again.to_string() == canonical


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 4, 8, 16]), min_size=16, max_size=16))
def test_any_divisions_vector_round_trips(divs: list[int]) -> None:
    s = AllocatorSettings(roundup_power2_divisions=tuple(divs))
    assert parse_config(s.to_string()).roundup_power2_divisions == tuple(divs)


@needs_torch_parser
@pytest.mark.parametrize("text", ROUND_TRIP[:12])
def test_canonical_strings_are_accepted_by_torch(text: str) -> None:
    """Our canonical form of a string is accepted by the installed torch, read with that
    torch's rules; a string those rules refuse (torch 2.11 has no pinned_max_* keys) is refused
    by torch too."""
    try:
        canonical = parse_config(text, BUILD, torch=TORCH).to_string()
    except ValueError:
        assert torch_outcome(text) is not None, f"torch {TORCH} accepts {text!r}, our rules refuse it"
        return
    assert torch_outcome(canonical) is None


def test_snapshot_dict() -> None:
    d = parse_config("max_split_size_mb:200,roundup_power2_divisions:[>:4]").to_snapshot_dict()
    assert d["max_split_size"] == 200 * MIB
    assert d["roundup_power2_divisions"]["1"] == 0
    assert d["roundup_power2_divisions"]["32768"] == 4
    assert len(d["roundup_power2_divisions"]) == 16
    assert AllocatorSettings().to_snapshot_dict()["max_split_size"] == -1


def test_settings_from_snapshot_round_trip() -> None:
    s = parse_config("max_split_size_mb:300,roundup_power2_divisions:[256:1,>:4]")
    assert settings_from_snapshot(s.to_snapshot_dict()) == s
    fields_only = dict(s.to_snapshot_dict(), PYTORCH_CUDA_ALLOC_CONF="")
    rebuilt = settings_from_snapshot(fields_only)
    assert rebuilt.max_split_size == 300 * MIB
    assert rebuilt.roundup_power2_divisions == s.roundup_power2_divisions
    assert settings_from_snapshot({}) == AllocatorSettings()
    assert settings_from_snapshot({"max_split_size": -1}).max_split_size is None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_split_size": "big"},
        {"expandable_segments": 1},
        {"pinned_num_register_threads": True},
        {"roundup_power2_divisions": [1, 2]},
        {"roundup_power2_divisions": {"3": 1}},
        {"roundup_power2_divisions": {"1": -1}},
    ],
)
def test_settings_from_snapshot_rejects_wrong_types(bad: dict) -> None:
    with pytest.raises(ConfigError):
        settings_from_snapshot(bad)


# --- environment ----------------------------------------------------------------------------


def test_environment_precedence() -> None:
    env = {
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:200",
        "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:300",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    s, name = settings_from_environment(env)
    assert name == "PYTORCH_CUDA_ALLOC_CONF"
    assert s.expandable_segments and s.max_split_size is None  # nothing merged
    del env["PYTORCH_CUDA_ALLOC_CONF"]
    s, name = settings_from_environment(env)
    assert (name, s.max_split_size) == ("PYTORCH_HIP_ALLOC_CONF", 300 * MIB)
    del env["PYTORCH_HIP_ALLOC_CONF"]
    s, name = settings_from_environment(env)
    assert (name, s.max_split_size) == ("PYTORCH_ALLOC_CONF", 200 * MIB)
    assert settings_from_environment({}) == (AllocatorSettings(), None)


def test_environment_empty_variable_still_wins() -> None:
    s, name = settings_from_environment(
        {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}
    )
    assert name == "PYTORCH_CUDA_ALLOC_CONF" and s == AllocatorSettings()


def test_environment_error_names_variable() -> None:
    with pytest.raises(ConfigError, match="PYTORCH_ALLOC_CONF") as info:
        settings_from_environment({"PYTORCH_ALLOC_CONF": "max_split_size_mb:5"})
    assert info.value.key == "max_split_size_mb"


def test_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.7")
    s, name = settings_from_environment()
    assert name == "PYTORCH_ALLOC_CONF" and s.garbage_collection_threshold == 0.7


@needs_torch_parser
@pytest.mark.parametrize(
    "present",
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
        ("PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    ],
)
@pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
                    reason="this torch cannot print its allocator settings (no "
                           "torch._C._accelerator_getAllocatorSettings; torch 2.11)")
def test_environment_precedence_matches_torch(present: tuple[str, ...]) -> None:
    import os
    import subprocess
    import sys

    values = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:100",
        "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:300",
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:200",
    }
    env = {k: v for k, v in os.environ.items() if k not in values}
    env.update({k: values[k] for k in present})
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch._C._accelerator_getAllocatorSettings())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    settings, name = settings_from_environment(env)
    assert out.stdout.strip() == values[name]
    assert name == present[0]
