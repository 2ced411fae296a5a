"""Parsed allocator settings (:class:`AllocatorSettings`) and how they print back as a string.

The grammar that builds them is :mod:`.grammar`; the fields and defaults are torch 2.13's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from ..devices import CONFIG_DIALECTS, torch_read_variables
from ..units import MIB
from .numbers import SIZE_MAX
from .tokens import ROUNDUP_INTERVALS, read_roundup_list

__all__ = [
    "CONFIG_VARIABLES",
    "DEVICES",
    "MIB",
    "ROUNDUP_INTERVALS",
    "SIZE_MAX",
    "AllocatorSettings",
]

#: ``parse_config``'s device vocabulary: the config dialects of :mod:`accel_graph.allocator.devices`.
DEVICES: tuple[str, ...] = tuple(CONFIG_DIALECTS)
#: Read in this order; the first one set (even to "") is used whole, the others are ignored.
CONFIG_VARIABLES: tuple[str, ...] = torch_read_variables()


@dataclass(frozen=True)
class AllocatorSettings:
    """Parsed caching-allocator settings; sizes are bytes, ``None`` means unlimited.

    Field defaults are torch 2.13's defaults. ``max_non_split_rounding_size`` defaults to the
    large segment size. ``text`` is the string the settings came from and ``rules`` the torch
    parser rules that read it (neither is compared).
    """

    device: str = "cuda"
    large_segment_size: int = 20 * MIB
    max_split_size: int | None = None
    max_non_split_rounding_size: int = 20 * MIB
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    pinned_use_background_threads: bool = False
    pinned_max_round_threshold: int | None = None
    pinned_max_cached_size: int | None = None
    backend: str = "native"
    release_lock_on_cudamalloc: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_reserve_segment_size: int = 0
    graph_capture_record_stream_reuse: bool = False
    per_process_memory_fraction: float = 1.0
    pinned_free_catch_all: bool = False
    throw_on_cudamalloc_oom: bool = False
    text: str = field(default="", compare=False)
    #: the torch parser rules (:mod:`.rules`) that produced these settings; not compared.
    rules: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise ConfigError(
                f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} entries, "
                f"got {len(self.roundup_power2_divisions)}"
            )

    def roundup_divisions(self, size: int) -> int:
        """The division count that applies to a request of ``size`` bytes (0 or 1: no rounding)."""
        index = max(size, 1).bit_length() - 1 - 20
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]

    def to_string(self) -> str:
        """A canonical config string: only non-default keys, in a fixed order.

        It parses back (with the same ``device``) to settings equal to these.
        """
        d = AllocatorSettings(device=self.device)
        out: list[str] = []
        if self.large_segment_size != d.large_segment_size:
            out.append(f"large_segment_size_mb:{self.large_segment_size // MIB}")
        if self.max_split_size is not None:
            out.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding_size != self.large_segment_size:
            out.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MIB}")
        if self.garbage_collection_threshold != 0.0:
            out.append(f"garbage_collection_threshold:{self.garbage_collection_threshold!r}")
        if any(self.roundup_power2_divisions):
            out.append(f"roundup_power2_divisions:{_format_roundup(self.roundup_power2_divisions)}")
        for name in ("expandable_segments", "pinned_use_background_threads"):
            if getattr(self, name):
                out.append(f"{name}:True")
        for name in ("pinned_max_round_threshold", "pinned_max_cached_size"):
            value = getattr(self, name)
            if value is not None:
                out.append(f"{name}_mb:{value // MIB}")
        if self.backend != "native":
            out.append(f"backend:{self.backend}")
        for name in (
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "graph_capture_record_stream_reuse",
            "pinned_free_catch_all",
            "throw_on_cudamalloc_oom",
        ):
            if getattr(self, name):
                out.append(f"{name}:True")
        if self.pinned_num_register_threads != 1:
            out.append(f"pinned_num_register_threads:{self.pinned_num_register_threads}")
        if self.pinned_reserve_segment_size:
            out.append(f"pinned_reserve_segment_size_mb:{self.pinned_reserve_segment_size // MIB}")
        if self.per_process_memory_fraction != 1.0:
            out.append(f"per_process_memory_fraction:{self.per_process_memory_fraction!r}")
        return ",".join(out)

    def to_snapshot_dict(self) -> dict[str, object]:
        """The ``allocator_settings`` entry of a PyTorch memory snapshot for these settings.

        ``max_split_size`` is -1 when unlimited; the divisions are keyed "1", "2", ... "32768"
        (the MiB boundary of each interval), as torch writes them.
        """
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.text or self.to_string(),
            "max_split_size": -1 if self.max_split_size is None else self.max_split_size,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": self.pinned_num_register_threads,
            "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
            "pinned_use_cuda_host_register": self.pinned_use_cuda_host_register,
            "roundup_power2_divisions": {
                str(1 << i): d for i, d in enumerate(self.roundup_power2_divisions)
            },
        }


def _format_roundup(divs: tuple[int, ...]) -> str:
    """Shortest list form we know that reproduces ``divs`` under torch's fill rules."""
    if len(set(divs)) == 1:
        return str(divs[0])
    n = len(divs)
    lead = 1  # first entry fills every lower interval
    while divs[lead] == divs[0]:
        lead += 1
    tail = n - 1  # '>' fills every interval above the last explicit one
    while divs[tail - 1] == divs[n - 1]:
        tail -= 1
    entries = [f"{1 << (lead - 1)}:{divs[0]}"]
    last = lead - 1
    for i in range(lead, tail):
        if divs[i] or i == tail - 1:
            entries.append(f"{1 << i}:{divs[i]}")
            last = i
    if last + 1 < n and divs[n - 1]:
        entries.append(f">:{divs[n - 1]}")
    text = "[" + ",".join(entries) + "]"
    if read_roundup_list(text) != divs:  # belt and braces: never emit a lossy form
        text = "[" + ",".join(f"{1 << i}:{d}" for i, d in enumerate(divs)) + "]"
    return text
