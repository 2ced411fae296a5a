"""Engine settings and the pure policy helpers: what the C core is told, checked on the way in.

:class:`EngineSettings` holds already-parsed allocator settings (bytes, not config strings: the
grammar lives in :mod:`accel_graph.allocator.alloc_conf`); :func:`fill_settings` checks them and
fills the C ``ag_settings`` struct every engine is created from. :func:`round_size`,
:func:`rp2_next_division` and :func:`allocation_size` are the C core's rounding rules, callable
without an engine (for tests and for explaining decisions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from operator import index
from typing import Any

from ...errors import ConfigError
from ..alloc_conf.settings import ROUNDUP_INTERVALS
from ..devices import RUNTIME_KINDS, runtime_device_kind
from ..units import MIB, U64_MAX
from .loader import load_core

__all__ = [
    "MIB",
    "POLICIES",
    "POLICY_KEYS",
    "POLICY_MODELS",
    "U64_MAX",
    "UPSTREAMS",
    "EngineSettings",
    "allocation_size",
    "bool_arg",
    "fill_settings",
    "fraction_arg",
    "int_arg",
    "round_size",
    "rp2_next_division",
]

POLICIES = ("native", "xpu", "bfc")  # index = AG_POLICY_* in _core.h
#: The allocator config keys each policy acts on; the others parse and change nothing (the C
#: core: the max_split rules and the GC threshold are native-only, roundup divisions need the
#: CUDA rounding, bfc honours only the memory limit; docs/allocator.md).
POLICY_KEYS: dict[str, frozenset[str]] = {
    "native": frozenset({
        "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
        "garbage_collection_threshold", "per_process_memory_fraction", "expandable_segments",
        "large_segment_size_mb",
    }),
    "xpu": frozenset({"per_process_memory_fraction", "expandable_segments",
                      "large_segment_size_mb"}),
    "bfc": frozenset({"per_process_memory_fraction"}),
}  # fmt: skip
#: What each policy models, in a few words (the CLI's ``--policy`` help, the OOM message).
POLICY_MODELS: dict[str, str] = {
    "native": "PyTorch's caching allocator",
    "xpu": "PyTorch's XPU caching allocator",
    "bfc": "TensorFlow's BFC allocator",
}
UPSTREAMS = ("host", "counting", "device")
#: Inclusive ranges of the C integer types the engine's entry points take.
I32 = (-(1 << 31), (1 << 31) - 1)
I64 = (-(1 << 63), (1 << 63) - 1)
U64 = (0, U64_MAX)


@dataclass(frozen=True)
class EngineSettings:
    """Already-parsed allocator settings (sizes in bytes; ``None`` = torch's default).

    Names follow :class:`accel_graph.allocator.alloc_conf.AllocatorSettings`; build one from those
    with :meth:`from_allocator_settings`.

    - ``max_split_size``: ``None`` = unlimited. Must be >= ``large_segment_size``.
    - ``max_non_split_rounding_size``: ``None`` = ``large_segment_size``.
    - ``roundup_power2_divisions``: one int for every interval, or 16 ints (interval 0 = sizes
      below 2 MiB, interval i = [2^(20+i), 2^(21+i)), interval 15 = 32 GiB and up); each 0 or a
      power of two.
    - ``garbage_collection_threshold``: 0 = off; acts only with ``memory_fraction`` < 1.
    - ``memory_fraction``: ``None`` = never set; needs a known capacity.
    - ``cap``: the upstream refuses to hold more than this many bytes (simulated device size).
    - ``capacity``: total device memory for the fraction, the OOM message and the expandable
      address range; ``None`` = ``cap``, else host RAM or the driver's figure.
    - ``device_kind`` and ``device_libs``: which runtime the device upstream loads, and the
      library names or paths to try (default: the usual sonames).
    - ``round_extra``: bytes added to every request before rounding (torch_npu adds 32:
      block = ceil((size + 32) / 512) * 512, and roundup_power2_divisions sees size + 32).
      The requested size recorded in stats and events stays the caller's.
    - ``expandable_head_align``: 0 = off; else (a power of two, 512 B .. 2 MiB), with
      expandable segments, a request of 2 MiB or more whose block does not start on this
      alignment starts at the next multiple, and the skipped head stays a free block
      (torch_npu's ``base_addr_aligned_kb``, default 16 KiB).
    - ``expandable_oversize_rule``: ``get_free_block`` applies the ``max_split_size`` oversize
      rules to cached blocks of expandable segments too (torch >= 2.12, the behaviour behind
      pytorch#193400). False: torch 2.9-2.11, where those blocks are reused freely.
    """

    max_split_size: int | None = None
    max_non_split_rounding_size: int | None = None
    large_segment_size: int = 20 * MIB
    roundup_power2_divisions: int | Sequence[int] = 0
    garbage_collection_threshold: float = 0.0
    memory_fraction: float | None = None
    expandable_segments: bool = False
    cap: int | None = None
    capacity: int | None = None
    device_kind: str = "cuda"
    device_libs: tuple[str, ...] = field(default=())
    round_extra: int = 0
    expandable_head_align: int = 0
    expandable_oversize_rule: bool = True

    def divisions(self) -> tuple[int, ...]:
        """The 16 per-interval division counts."""
        d = self.roundup_power2_divisions
        if isinstance(d, int):
            return (d,) * ROUNDUP_INTERVALS
        d = tuple(int(x) for x in d)
        if len(d) != ROUNDUP_INTERVALS:
            raise ConfigError(
                f"roundup_power2_divisions needs one int or {ROUNDUP_INTERVALS} ints, got {len(d)}"
            )
        return d

    @classmethod
    def from_allocator_settings(cls, parsed: Any, **overrides: Any) -> EngineSettings:
        """Build from a parsed config (``config.AllocatorSettings`` or anything shaped like it).

        ``per_process_memory_fraction`` of 1.0 (torch's default) means "not set".
        """
        fraction = getattr(parsed, "per_process_memory_fraction", 1.0)
        values: dict[str, Any] = {
            "max_split_size": parsed.max_split_size,
            "max_non_split_rounding_size": parsed.max_non_split_rounding_size,
            "large_segment_size": parsed.large_segment_size,
            "roundup_power2_divisions": tuple(parsed.roundup_power2_divisions),
            "garbage_collection_threshold": parsed.garbage_collection_threshold,
            "memory_fraction": fraction if fraction < 1.0 else None,
            "expandable_segments": parsed.expandable_segments,
        }
        values.update(overrides)
        return cls(**values)


def _shown(value: Any) -> str:
    """``repr(value)``, bounded: a huge int's repr is slow, and over 4,300 digits it raises."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bound(n: int) -> str:
    for k in (31, 32, 63, 64):
        if n == (1 << k) - 1:
            return f"2**{k} - 1"
        if n == -(1 << k):
            return f"-2**{k}"
    return str(n)


def int_arg(call: str, name: str, value: Any, bounds: tuple[int, int]) -> int:
    """``value`` as a Python int within ``bounds`` (inclusive), for argument ``name`` of
    ``call``; else :class:`ConfigError`. ``bool`` is refused (it is never a size, address,
    stream or pool), numpy integers are accepted (anything with ``__index__``).

    The one check every engine entry point uses, so a bad argument never reaches cffi (whose
    ``OverflowError``/``TypeError`` would escape) and the C core sees only in-range values.
    """
    lo, hi = bounds
    if not isinstance(value, bool):
        try:
            n = index(value)
        except TypeError:
            pass
        else:
            if lo <= n <= hi:
                return n
    raise ConfigError(
        f"{call}: {name} must be an int in [{_bound(lo)}, {_bound(hi)}], got {_shown(value)}"
    )


def bool_arg(call: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool (a flag), else :class:`ConfigError`: ``"yes"`` or ``2`` is
    more likely a misplaced argument than a flag."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{call}: {name} must be True or False, got {_shown(value)}")


def fraction_arg(call: str, value: Any) -> float:
    """A memory fraction as a float in [0, 1], else :class:`ConfigError`.

    torch's ``set_per_process_memory_fraction`` takes the same range (its C++ check,
    ``0 <= fraction && fraction <= 1``, refuses NaN too); 0 is allowed and lets nothing be
    allocated. torch's Python wrapper also refuses ints; we accept any real number but bool.
    """
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            f = float(value)
        except OverflowError:  # an int past float's range
            f = math.inf
        if 0.0 <= f <= 1.0:  # False for NaN
            return f
    raise ConfigError(
        f"{call}: the memory fraction must be a number in [0, 1] (None: unset), "
        f"got {_shown(value)}"
    )


def _nonneg(name: str, value: int | None, default: int) -> int:
    return default if value is None else int_arg("EngineSettings", name, value, U64)



def fill_settings(ffi: Any, s: EngineSettings, policy: str, upstream: str) -> Any:
    """A new C ``ag_settings *`` for ``policy`` over ``upstream`` from ``s``.

    Raises :class:`ConfigError` for an unknown policy, upstream or device kind, or a size or
    division out of the C core's range; nothing is created then.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if upstream not in UPSTREAMS:
        raise ConfigError(f"upstream must be one of {', '.join(UPSTREAMS)}; got {upstream!r}")
    if s.device_kind not in RUNTIME_KINDS:
        raise ConfigError(f"device_kind must be {' or '.join(map(repr, RUNTIME_KINDS))}; "
                          f"got {s.device_kind!r}")
    c = ffi.new("ag_settings *")
    c.policy = POLICIES.index(policy)
    c.upstream = UPSTREAMS.index(upstream)
    large = _nonneg("large_segment_size", s.large_segment_size, 20 * MIB)
    c.large_segment_size = large
    c.max_split_size = _nonneg("max_split_size", s.max_split_size, U64_MAX)
    c.max_non_split_rounding_size = _nonneg(
        "max_non_split_rounding_size", s.max_non_split_rounding_size, large
    )
    for i, d in enumerate(s.divisions()):
        if d < 0 or d > 1 << 31:
            raise ConfigError(f"roundup_power2_divisions[{i}] out of range: {d}")
        c.roundup_power2_divisions[i] = d
    c.garbage_collection_threshold = float(s.garbage_collection_threshold)
    c.memory_fraction = (
        -1.0 if s.memory_fraction is None else fraction_arg("EngineSettings", s.memory_fraction)
    )
    c.expandable_segments = 1 if s.expandable_segments else 0
    c.device_kind = runtime_device_kind(s.device_kind).runtime_code or 0  # _core.h AG_DEVICE_*
    c.cap = _nonneg("cap", s.cap, 0)
    c.capacity = _nonneg("capacity", s.capacity, 0)
    c.round_extra = _nonneg("round_extra", s.round_extra, 0)
    c.expandable_head_align = _nonneg("expandable_head_align", s.expandable_head_align, 0)
    c.expandable_oversize_rule = 1 if s.expandable_oversize_rule else 0
    return c


# ----------------------------------------------------------------------------------------------



# ----------------------------------------------------------------------------------------------
# pure policy helpers (the C functions, for tests and for explaining decisions)


def round_size(size: int, settings: EngineSettings | None = None, policy: str = "native") -> int:
    """The block size a request of ``size`` bytes gets (torch's ``round_size``)."""
    core = load_core()
    c = fill_settings(core.ffi, settings or EngineSettings(), policy, "counting")
    return int(core.lib.ag_round_size(c, size))


def rp2_next_division(size: int, divisions: int) -> int:
    """torch's ``roundup_power2_next_division`` (e.g. 1200 with 4 divisions gives 1280)."""
    return int(load_core().lib.ag_rp2_next_division(size, divisions))


def allocation_size(size: int, settings: EngineSettings | None = None) -> int:
    """The segment size a (rounded) request of ``size`` bytes asks the upstream for."""
    core = load_core()
    c = fill_settings(core.ffi, settings or EngineSettings(), "native", "counting")
    return int(core.lib.ag_allocation_size(c, size))
