"""Which torch's ``PYTORCH_ALLOC_CONF`` rules a parse applies: one :class:`ParserRules` per
torch version whose parser was measured, chosen by :func:`rules_for`.

Contract:

- :data:`RULES` maps a rules name (``"2.11"``, ``"2.13"``, ``"2.14"``) to the key sets and
  evidence of that torch's parser; each covers an inclusive ``(major, minor)`` range, and
  together they cover every torch 2.x. The newest (:data:`NEWEST_RULES`) is the default
  everywhere. A range is wider than what was measured (``measured_on``): versions in it that
  were not run (2.0-2.10, 2.12) are *assumed* to parse like the measured one, and
  :meth:`ParserRules.measured` says which case a version is.
- :func:`rules_for` takes a torch version (``"2.14.1+cu130"``, ``"2.13"``, ``(2, 14)``), a
  rules object, or None (newest) and never guesses silently: a version it cannot read, or one
  outside torch 2.x, raises :class:`~accel_graph.errors.ConfigError` saying what to pass.
- The rules differ only where a real torch was seen to differ. torch 2.14.1's parser accepts
  and rejects exactly what 2.13's does (docs/allocator-config.md "torch 2.14 vs 2.13" gives
  the evidence; tests/allocator/data/ holds the outcomes recorded from each real torch), so
  those two share their keys. torch 2.11.0 lacks four keys (two common, two CUDA-hook ones)
  and otherwise parses alike; a future difference lands here, in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import ConfigError

__all__ = ["NEWEST_RULES", "RULES", "ParserRules", "parse_torch_version", "rules_for"]

Version = tuple[int, int]

# Keys of c10::CachingAllocator::AcceleratorAllocatorConfig (every build parses these).
_CORE_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
# torch 2.11.0's common keys (its shipped c10/core/AllocatorConfig.h getMutableKeys(), and
# measured: 2.11 refuses the two pinned_max_* keys as unknown).
_CORE_KEYS_211 = tuple(k for k in _CORE_KEYS
                       if k not in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"))
# Keys the CUDA/ROCm hook registers (CUDAAllocatorConfig::getKeys). Both spellings of the
# cuda/hip pairs are accepted on both builds: torch breaks the strings up to dodge hipify.
_CUDA_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)

# torch 2.11.0's hook keys (c10/cuda/CUDAAllocatorConfig.h getKeys() of that wheel; measured).
_CUDA_KEYS_211 = tuple(k for k in _CUDA_KEYS
                       if k not in ("pinned_free_catch_all", "throw_on_cudamalloc_oom"))


@dataclass(frozen=True)
class ParserRules:
    """One torch version's config parser: its keys, the versions it covers, the evidence."""

    name: str
    #: inclusive ((major, minor), (major, minor)) range of torch versions these rules describe.
    torch_versions: tuple[Version, Version]
    core_keys: tuple[str, ...]
    cuda_keys: tuple[str, ...]
    #: the real torch builds the rules were checked against (frozen tables in tests/allocator/data).
    measured_on: tuple[str, ...]
    notes: str = ""

    def covers(self, version: Version) -> bool:
        lo, hi = self.torch_versions
        return lo <= version <= hi

    def measured(self, version: Version) -> bool:
        """Whether a torch of this ``(major, minor)`` was run to record these rules (else the
        rules are applied to it by assumption)."""
        return any(parse_torch_version(m) == version for m in self.measured_on)

    def range_text(self) -> str:
        (a, b), (c, d) = self.torch_versions
        return f"{a}.{b} and later" if d >= 99 else f"{a}.{b}-{c}.{d}"


RULES: dict[str, ParserRules] = {
    "2.11": ParserRules(
        name="2.11",
        torch_versions=((2, 0), (2, 11)),
        core_keys=_CORE_KEYS_211,
        cuda_keys=_CUDA_KEYS_211,
        measured_on=("2.11.0+cu130",),
        notes="torch 2.11's token walk: the 2.13 grammar, values and messages, without "
        "pinned_max_round_threshold_mb, pinned_max_cached_size_mb, pinned_free_catch_all and "
        "throw_on_cudamalloc_oom ('Unrecognized key ... in Accelerator allocator config.'). "
        "Measured on 2.11.0+cu130 only; 2.0-2.10 were not run and are read with these rules "
        "by assumption (an older torch may know fewer keys still).",
    ),
    "2.13": ParserRules(
        name="2.13",
        torch_versions=((2, 12), (2, 13)),
        core_keys=_CORE_KEYS,
        cuda_keys=_CUDA_KEYS,
        measured_on=("2.13.0+cpu",),
        notes="torch 2.13's token walk (c10/core/AllocatorConfig.cpp + the CUDA hook). "
        "Measured on 2.13.0+cpu; the device keys on the 2.14.1 CUDA build, which parses alike. "
        "2.12 was not run and is read with these rules by assumption (it may lack keys that "
        "2.11 lacks).",
    ),
    "2.14": ParserRules(
        name="2.14",
        torch_versions=((2, 14), (2, 99)),
        core_keys=_CORE_KEYS,
        cuda_keys=_CUDA_KEYS,
        measured_on=("2.14.1+cu130",),
        notes="Same grammar, keys, values and messages as 2.13 on every recorded string (the "
        "shipped AllocatorConfig.h is byte-identical; CUDAAllocatorConfig.h changes only the "
        "expandable-segments handle default). Releases after 2.14 are assumed to match.",
    ),
}
NEWEST_RULES = "2.14"

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:[.+a-z0-9]*)?\s*$", re.IGNORECASE)


def parse_torch_version(text: str | tuple[int, int]) -> Version:
    """``"2.14.1+cu130"``, ``"2.14"``, ``"2.15.0.dev20260101"`` or ``(2, 14)`` -> ``(2, 14)``.

    Raises :class:`ConfigError` for anything else, saying what form to use.
    """
    if isinstance(text, tuple):
        if len(text) >= 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in text[:2]):
            return (text[0], text[1])
        raise ConfigError(f"a torch version tuple must be (major, minor) ints, got {text!r}")
    m = _VERSION.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(
            f"cannot read torch version {text!r}: give MAJOR.MINOR, e.g. 2.14 or 2.13 "
            "(a full version such as 2.14.1+cu130 works too)"
        )
    return (int(m.group(1)), int(m.group(2)))


def rules_for(torch: str | tuple[int, int] | ParserRules | None = None) -> ParserRules:
    """The parser rules of ``torch`` (a version, a rules object, or None: the newest).

    Raises :class:`ConfigError` naming the known rules when the version is unreadable or
    outside every rules range (anything but torch 2.x).
    """
    if isinstance(torch, ParserRules):
        return torch
    if torch is None:
        return RULES[NEWEST_RULES]
    if isinstance(torch, str) and torch.strip() in RULES:
        return RULES[torch.strip()]
    version = parse_torch_version(torch)
    for rules in RULES.values():
        if rules.covers(version):
            return rules
    known = "; ".join(f"{r.name} (torch {r.range_text()})" for r in RULES.values())
    raise ConfigError(
        f"no allocator-config rules for torch {version[0]}.{version[1]}: known rules are "
        f"{known}; pass a torch 2.x version"
    )
