"""The allocator profiles themselves: the :class:`Profile` record and the catalogue
:data:`PROFILES`, one row per torch version range x device, with the notes and references that
say what each row is based on.

Data only: how requests are rounded, and how a name or a torch version picks a row, live in
:mod:`.profiles` (the module the rest of the package imports). A device's newest profiles are
listed in its :data:`~accel_graph.allocator.devices.DEVICE_KINDS` row; tests/
test_allocator_devices.py keeps the two in step. Sources: see :mod:`.profiles`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..devices import ROUNDING_RULES
from ..units import MIB

__all__ = ["PROFILES", "Profile"]

_CORE_KEYS = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
    }
)

_CUDA_KEYS = _CORE_KEYS | {
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
}
#: What torch 2.11.0+cu130's parser accepts on top (measured: tests/allocator/data/
#: alloc_conf_torch-2.11.json); the four 2.13 keys below it refuses as unknown.
_CUDA_211_KEYS = _CUDA_KEYS | {
    "large_segment_size_mb",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
}
_CUDA_213_KEYS = _CUDA_211_KEYS | {
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
}


@dataclass(frozen=True)
class Profile:
    """One allocator behaviour set. Versions are ``(major, minor)`` pairs, inclusive bounds."""

    name: str
    #: inclusive (low, high) torch version range, e.g. ((2, 12), (2, 99)).
    torch_versions: tuple[tuple[int, int], tuple[int, int]]
    device: str  # cuda | rocm | npu | xpu
    policy: str  # engine policy: native | xpu
    rounding: str = "cuda"  # one of ROUNDING_RULES
    #: config keys this build honours (others are rejected or ignored by that build).
    settings_keys: frozenset[str] = _CUDA_213_KEYS
    #: kLargeBuffer / large_segment_size default, bytes; configurable only when
    #: "large_segment_size_mb" is in settings_keys (2.13+).
    large_segment_size: int = 20 * MIB
    #: Expandable segments available on this build.
    expandable_segments: bool = True
    #: get_free_block still applies the max_split oversize rule to blocks inside expandable
    #: segments (pytorch#193400): with max_split_size_mb + ES, reserved grows without bound.
    max_split_blocks_expandable_reuse: bool = True
    #: ``roundup_power2_divisions:[...,>:d]`` fills from last_index+1 (True) or last_index (False).
    roundup_gt_fills_after_last: bool = True
    #: roundup_power2_divisions applied at all (PR #160666's backed-out refactor did not).
    roundup_applied: bool = True
    #: ``throw_on_cudamalloc_oom`` exists (2.13+).
    throw_on_cudamalloc_oom: bool = True
    #: expandable-segment page size of the large pool (bytes) on builds without
    #: large_segment_size_mb; 2.13+ builds use large_segment_size. Small pool pages are 2 MiB.
    es_page_size: int = 20 * MIB
    #: with expandable segments, blocks of 2 MiB or more start on multiples of this, the skipped
    #: head staying a free block (torch_npu's base_addr_aligned_kb, default 16 KiB;
    #: EngineSettings.expandable_head_align). 512 = no extra alignment.
    expandable_large_align: int = 512
    notes: str = ""
    references: tuple[str, ...] = field(default=())

    def covers(self, version: tuple[int, int]) -> bool:
        lo, hi = self.torch_versions
        return lo <= version <= hi


_ES_NOTE = (
    "max_split_size_mb + expandable_segments: get_free_block applies the oversize rule to "
    "expandable blocks, so cached expandable memory is not reused and reserved grows (pytorch#193400; "
    "782 MiB on 2.9.1 vs 16,000 MiB on 2.12-2.14 on the same reproducer). "
)
_ENGINE_213 = "The C engine implements this behaviour (torch 2.13 CUDA). "
_ENGINE_FLAG = (
    "The C engine has no flag for {what}; it always simulates the 2.13 behaviour, so replays "
    "under this profile differ there. "
)
_ENGINE_ES_FLAG = (
    "The engine simulates this with EngineSettings(expandable_oversize_rule=False). "
)

PROFILES: dict[str, Profile] = {}


def _add(p: Profile) -> None:
    if p.rounding not in ROUNDING_RULES:  # devices.ROUNDING_RULES
        raise ValueError(f"unknown rounding rule {p.rounding!r}")
    PROFILES[p.name] = p


_add(
    Profile(
        name="cuda-2.9",
        torch_versions=((2, 0), (2, 10)),
        device="cuda",
        policy="native",
        settings_keys=_CUDA_KEYS,
        max_split_blocks_expandable_reuse=False,
        roundup_gt_fills_after_last=False,
        throw_on_cudamalloc_oom=False,
        notes=(
            "Before 2.12: max_split_size with expandable segments does not block reuse of expandable "
            "blocks (782 MiB peak on the pytorch#193400 reproducer; measured on 2.9.1, 2.10 "
            "not measured and assumed the same). Config keys: the pre-2.11 set from the "
            "reference, not measured here (torch 2.11 already has large_segment_size_mb, see "
            "cuda-2.11); kLargeBuffer taken as a fixed 20 MiB. An older revision filled the roundup '>' entry from "
            "last_index instead of last_index+1 (torch-internals.md section 4); the exact release is "
            "not pinned down. No throw_on_cudamalloc_oom / pinned_free_catch_all (2.13+). "
            "2.9 -> 2.10 increased start-up fragmentation under vLLM (vllm#41158); not modelled. "
            + _ENGINE_ES_FLAG
            + _ENGINE_FLAG.format(what="the old '>' fill (a config-parsing difference)")
        ),
        references=(
            "pytorch/pytorch#193400",
            "vllm-project/vllm#41158",
            "allocator-semantics.md 4.3",
            "torch-internals.md 4",
        ),
    )
)
_add(
    Profile(
        name="cuda-2.11",
        torch_versions=((2, 11), (2, 11)),
        device="cuda",
        policy="native",
        settings_keys=_CUDA_211_KEYS,
        max_split_blocks_expandable_reuse=False,
        throw_on_cudamalloc_oom=False,
        notes=(
            "Config keys measured on torch 2.11.0+cu130 only (its parser on 1,249 strings, "
            "tests/allocator/data/alloc_conf_torch-2.11.json): it accepts large_segment_size_mb, "
            "per_process_memory_fraction, pinned_reserve_segment_size_mb and "
            "graph_capture_record_stream_reuse, and refuses pinned_max_round_threshold_mb, "
            "pinned_max_cached_size_mb, pinned_free_catch_all and throw_on_cudamalloc_oom as "
            "unknown. large_segment_size_mb sizes large segments as in 2.13 (assumed: 2.11's "
            "shipped AllocatorConfig.h has the large_segment_size() accessor; the allocator's "
            ".cpp is not shipped). Allocator behaviour not measured (no GPU here): expandable "
            "blocks are reused regardless of max_split_size as measured on 2.9.1 "
            "(pytorch#193400 has 782 MiB there, 16,000 MiB on 2.12-2.14); 2.11 assumed like "
            "2.9.1. The roundup '>' fill is the 2.13 one (2.11 has 2.13's parser: the same "
            "messages on every recorded string). " + _ENGINE_ES_FLAG
        ),
        references=(
            "tests/allocator/data/alloc_conf_torch-2.11.json",
            "torch 2.11.0 wheel: include/c10/core/AllocatorConfig.h, c10/cuda/CUDAAllocatorConfig.h",
            "pytorch/pytorch#193400",
        ),
    )
)
_add(
    Profile(
        name="cuda-2.12",
        torch_versions=((2, 12), (2, 12)),
        device="cuda",
        policy="native",
        settings_keys=_CUDA_211_KEYS,
        throw_on_cudamalloc_oom=False,
        notes=(
            _ES_NOTE + "Config keys not measured on 2.12: taken as 2.11's (measured), which "
            "2.13 also has; the four keys 2.11 lacks (throw_on_cudamalloc_oom, "
            "pinned_free_catch_all, pinned_max_round_threshold_mb, pinned_max_cached_size_mb) "
            "are counted from 2.13, where they were measured. " + _ENGINE_213
        ),
        references=("pytorch/pytorch#193400", "allocator-semantics.md 4.3",
                    "tests/allocator/data/alloc_conf_torch-2.11.json"),
    )
)
_add(
    Profile(
        name="cuda-2.13",
        torch_versions=((2, 13), (2, 13)),
        device="cuda",
        policy="native",
        notes=(
            _ES_NOTE
            + "large_segment_size_mb replaces kLargeBuffer (default 20 MiB, must be > 10); "
            "throw_on_cudamalloc_oom and pinned_free_catch_all added. " + _ENGINE_213
        ),
        references=("pytorch/pytorch#193400", "torch-internals.md 4"),
    )
)
_add(
    Profile(
        name="cuda-2.14",
        torch_versions=((2, 14), (2, 99)),
        device="cuda",
        policy="native",
        notes=(
            _ES_NOTE
            + "torch 2.14.1's caching allocator as read off its wheel: the same config keys, "
            "values and errors as 2.13 (1,249 strings recorded from both, "
            "docs/allocator-config.md), and a byte-identical shipped AllocatorConfig.h, which "
            "holds the sizing constants (kMinBlockSize, kSmallSize, kSmallBuffer, kMinLargeAlloc, "
            "kRoundLarge). The allocator's .cpp is not in the wheel: the algorithm is assumed "
            "unchanged from 2.13 (the pytorch#193400 numbers above include 2.14). "
            "What 2.14 adds is outside the replay: an 'annotate' trace action and "
            "host_segments/host_traces (pinned host memory) in snapshots, per-thread memory "
            "metadata, and the expandable-segments handle type now defaulting to UNSPECIFIED on "
            "every CUDA version. Releases after 2.14 are assumed to match. " + _ENGINE_213
        ),
        references=(
            "docs/allocator-config.md (torch 2.14 vs 2.13)",
            "torch 2.14.1 wheel: include/c10/cuda/CUDAAllocatorConfig.h, CUDACachingAllocator.h",
            "pytorch/pytorch#193400",
        ),
    )
)
_add(
    Profile(
        name="cuda-2.13-rp2-ignored",
        torch_versions=((2, 13), (2, 99)),
        device="cuda",
        policy="native",
        roundup_applied=False,
        notes=(
            "What-if profile for builds where roundup_power2_divisions is not applied (PR #160666's "
            "backed-out AcceleratorAllocatorConfig refactor; #161139: value 1 effectively ignored). "
            "replay_trace under this profile runs the engine with divisions 0 (round_request "
            "agrees)."
        ),
        references=("pytorch/pytorch#160666", "pytorch/pytorch#161139"),
    )
)
_add(
    Profile(
        name="rocm-2.13",
        torch_versions=((2, 12), (2, 99)),
        device="rocm",
        policy="native",
        settings_keys=(
            _CUDA_213_KEYS - {"release_lock_on_cudamalloc", "pinned_use_cuda_host_register"}
        )
        | {"release_lock_on_hipmalloc", "pinned_use_hip_host_register"},
        notes=(
            "Same allocator as CUDA (HIP). Expandable segments need ROCm >= 7.0; on older ROCm "
            "torch logs a warning and runs without them (use profile rocm-6). backend also accepts "
            "hipMallocAsync. pytorch#193400 was measured on ROCm. " + _ENGINE_213
        ),
        references=("torch-internals.md 2 (ROCm)", "pytorch/pytorch#193400"),
    )
)
_add(
    Profile(
        name="rocm-6",
        torch_versions=((2, 0), (2, 99)),
        device="rocm",
        policy="native",
        expandable_segments=False,
        notes="ROCm < 7.0: expandable_segments:True is ignored (warning); simulate with it off.",
        references=("torch-internals.md 2 (ROCm)",),
    )
)
_add(
    Profile(
        name="npu",
        torch_versions=((2, 1), (2, 99)),
        device="npu",
        policy="native",
        rounding="npu",
        settings_keys=_CORE_KEYS | {"base_addr_aligned_kb", "page_size", "segment_size_mb"},
        max_split_blocks_expandable_reuse=False,
        throw_on_cudamalloc_oom=False,
        expandable_large_align=16 * 1024,
        notes=(
            "Ascend torch_npu (measured on torch 2.6 fixtures): block size = ceil((request + 32) / "
            "512) * 512 (a multiple of 512 comes out 512 bytes bigger; 1 MiB requests land in the "
            "large pool). Segments: 2 MiB small, ceil(size/2 MiB) large (18-42 MiB seen), 20 MiB "
            "expandable pages; with expandable segments, blocks >= 2 MiB start on 16 KiB "
            "boundaries (base_addr_aligned_kb, default 16; the skipped head stays free). The engine rounds with EngineSettings(round_extra=32). "
            "Read with PYTORCH_NPU_ALLOC_CONF; max_split_size_mb must be > 20. Whether torch_npu "
            "has the pytorch#193400 behaviour is unknown (flag False is a guess)."
        ),
        references=("allocator-semantics.md 3.1", "shared/traces/npu", "codeasier/MemSnapDump"),
    )
)
_add(
    Profile(
        name="xpu",
        torch_versions=((2, 11), (2, 99)),
        device="xpu",
        policy="xpu",
        rounding="xpu",
        settings_keys=_CORE_KEYS | {"large_segment_size_mb"},
        max_split_blocks_expandable_reuse=False,
        throw_on_cudamalloc_oom=False,
        notes=(
            "XPUCachingAllocator: 512-byte rounding only (no roundup_power2_divisions), no max_split "
            "oversize rules, same large_segment_size and expandable segments (PR #166292). "
            "Simulated by the engine's 'xpu' policy. Read from PYTORCH_ALLOC_CONF."
        ),
        references=("torch-internals.md 4 (Other knobs)",),
    )
)
