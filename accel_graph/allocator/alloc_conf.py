"""``PYTORCH_ALLOC_CONF`` strings: parse them exactly as torch 2.13 does, and format them back.

Contract:

- :func:`parse_config` accepts and rejects the same strings as torch 2.13's parser
  (``c10/core/AllocatorConfig.cpp`` plus, for ``device="cuda"``/``"hip"``, the CUDA parser hook),
  including its leniencies (``max_split_size_mb:100abc`` is 100; ``a:b:c:d`` is two skipped
  entries). Where torch raises a ``ValueError`` with a message, the :class:`ConfigError` we raise
  contains that message verbatim; where torch only says ``stoull``/``stod`` or trips an internal
  assert (a lone ``,``, a key without a value, ``a:b:c``), ours says what is wrong instead.
  Every error names the offending key (``err.key``) and what is legal.
- The result is what a fresh process started with that string would use: torch's stickiness
  across calls (``large_segment_size_mb`` survives later parses) is not modelled, because a
  config string is applied once, at process start, in the cases we simulate.
- ``device`` picks the rules: ``"cpu"`` mirrors the CPU build (device keys and unknown keys are
  skipped unchecked); ``"cuda"`` and ``"hip"`` add the CUDA hook's keys and reject unknown keys;
  ``"xpu"`` rejects every key outside the common set (no XPU-specific keys exist in 2.13).
- :meth:`AllocatorSettings.to_string` gives a canonical string (non-default keys only, fixed
  order) that parses back to equal settings on the same device.

The parse deliberately walks torch's token stream index by index, because torch's grammar is
defined by that walk (separators are skipped, not checked), not by a clean BNF.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from ..errors import ConfigError

__all__ = [
    "CONFIG_VARIABLES",
    "DEVICES",
    "AllocatorSettings",
    "parse_config",
    "settings_from_environment",
    "settings_from_snapshot",
]

MIB = 1 << 20
SIZE_MAX = (1 << 64) - 1
#: Number of roundup_power2_divisions intervals: [0] < 2 MiB, [i] = [2^(20+i), 2^(21+i)), [15] >= 32 GiB.
ROUNDUP_INTERVALS = 16
DEVICES = ("cuda", "hip", "xpu", "cpu")
#: Read in this order; the first one set (even to "") is used whole, the others are ignored.
CONFIG_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# Keys of c10::CachingAllocator::AcceleratorAllocatorConfig (every build parses these).
CORE_KEYS = (
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
# Keys the CUDA/ROCm hook registers (CUDAAllocatorConfig::getKeys in 2.13). Both spellings of
# the cuda/hip pairs are accepted on both builds: torch breaks the strings up to dodge hipify.
CUDA_KEYS = (
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
_MAX_PINNED_REGISTER_THREADS = 128

_LEGAL = {
    "large_segment_size_mb": "an integer number of MiB > 10 (default 20)",
    "max_split_size_mb": "an integer number of MiB >= large_segment_size_mb (20 by default); "
    "default unlimited",
    "max_non_split_rounding_mb": "an integer number of MiB >= large_segment_size_mb "
    "(20 by default); default = large_segment_size_mb",
    "garbage_collection_threshold": "a number strictly between 0.0 and 1.0; default 0 (off)",
    "roundup_power2_divisions": "a power of 2 for every interval, or a list [K:d,...,>:d] with "
    "K a power-of-2 MiB boundary and d a power of 2 or 0",
    "pinned_max_round_threshold_mb": "an integer number of MiB; default unlimited",
    "pinned_max_cached_size_mb": "an integer number of MiB; default unlimited",
    "backend": "native or cudaMallocAsync",
    "pinned_num_register_threads": "a power of 2 <= 128; default 1",
    "pinned_reserve_segment_size_mb": "an integer number of MiB > 0; default 0 (off)",
    "per_process_memory_fraction": "a number in [0.0, 1.0]; default 1.0",
}
_BOOL_LEGAL = "exactly True or False (case-sensitive)"
_SYNTAX = "entries are key:value separated by ',', list values are [a:b,c:d]"


def _legal(key: str, device: str) -> str:
    if key == "backend" and device == "hip":
        return "native, cudaMallocAsync or hipMallocAsync"
    return _LEGAL.get(key, _BOOL_LEGAL)


@dataclass(frozen=True)
class AllocatorSettings:
    """Parsed caching-allocator settings; sizes are bytes, ``None`` means unlimited.

    Field defaults are torch 2.13's defaults. ``max_non_split_rounding_size`` defaults to the
    large segment size. ``text`` is the string the settings came from (not compared).
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
    if _parse_list_for_check(text) != divs:  # belt and braces: never emit a lossy form
        text = "[" + ",".join(f"{1 << i}:{d}" for i, d in enumerate(divs)) + "]"
    return text


def _parse_list_for_check(text: str) -> tuple[int, ...]:
    return parse_config(f"roundup_power2_divisions:{text}", device="cpu").roundup_power2_divisions


# --------------------------------------------------------------------------------------------
# Tokens and number conversions, mirroring c10::CachingAllocator::ConfigTokenizer.


class _Malformed(Exception):
    """Torch would trip an internal assert here; carries the index that was out of bounds."""


_C_SPACE = frozenset(" \t\n\v\f\r")
_SEPARATORS = frozenset(",:[]")


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in _SEPARATORS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch not in _C_SPACE:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


_ULL = re.compile(r"[+-]?[0-9]+")
_HEX = re.compile(r"([+-]?)0[xX]([0-9a-fA-F]*)(?:\.([0-9a-fA-F]*))?(?:[pP]([+-]?[0-9]+))?")
_DEC = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPECIAL = re.compile(r"([+-]?)(infinity|inf|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)
_MIN_NORMAL = 2.2250738585072014e-308


class _NumberError(Exception):
    def __init__(self, out_of_range: bool) -> None:
        super().__init__()
        self.out_of_range = out_of_range


def _stoull(token: str) -> int:
    """``std::stoull``: a decimal prefix, '-' wraps modulo 2**64, overflow is out of range."""
    m = _ULL.match(token)
    if not m:
        raise _NumberError(False)
    text = m.group()
    value = int(text.lstrip("+-"))
    if value > SIZE_MAX:
        raise _NumberError(True)
    return (-value) % (1 << 64) if text.startswith("-") else value


def _stod(token: str) -> float:
    """``std::stod`` (glibc strtod): longest numeric prefix; inexact under/overflow is out of range."""
    m = _SPECIAL.match(token)
    if m:
        value = math.inf if m.group(2).lower().startswith("inf") else math.nan
        return -value if m.group(1) == "-" else value
    m = _HEX.match(token)
    if m and (m.group(2) or m.group(3)):
        exact = _hex_fraction(m)
    else:
        m = _DEC.match(token)
        if not m:
            raise _NumberError(False)
        mant, _, exp = m.group().lower().partition("e")
        whole, _, frac = mant.lstrip("+-").partition(".")
        if not (whole + frac).strip("0"):
            return 0.0
        # Decimal magnitude of the value, so absurd exponents never reach Fraction's bignums.
        if whole.lstrip("0"):
            magnitude = len(whole.lstrip("0")) + (int(exp) if exp else 0)
        else:
            magnitude = (int(exp) if exp else 0) - (len(frac) - len(frac.lstrip("0")))
        if abs(magnitude) > 400:
            raise _NumberError(True)  # certain overflow, or underflow of a nonzero value
        exact = Fraction(m.group())
    if exact == 0:
        return 0.0
    try:
        value = float(exact)
    except OverflowError:
        raise _NumberError(True) from None
    if abs(value) < _MIN_NORMAL and Fraction(value) != exact:
        raise _NumberError(True)
    return value


def _hex_fraction(m: re.Match[str]) -> Fraction:
    sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or "", m.group(4)
    mantissa = int(whole + frac, 16)
    power = (int(exp) if exp else 0) - 4 * len(frac)
    if power > 5000:
        raise _NumberError(mantissa != 0)
    if power < -5000:
        if mantissa:
            raise _NumberError(True)
        return Fraction(0)
    value = Fraction(mantissa) * (Fraction(2) ** power)
    return -value if sign == "-" else value


class _Parser:
    """One parse of one string for one device: torch's token walk with our error messages."""

    def __init__(self, text: str, device: str) -> None:
        self.text = text
        self.device = device
        self.tokens = _tokenize(text)
        self.key = ""
        self.values: dict[str, object] = {}

    # -- token access: out-of-bounds is torch's internal assert, a malformed string for us
    def tok(self, i: int) -> str:
        if i >= len(self.tokens):
            raise _Malformed(i)
        return self.tokens[i]

    def check(self, i: int, token: str) -> bool:
        return self.tok(i) == token

    def error(self, message: str) -> ConfigError:
        key = self.key
        err = ConfigError(
            f"invalid allocator config {self.text!r}: {message.rstrip()} "
            f"(key '{key}': legal values are {_legal(key, self.device)})"
        )
        err.key = key  # type: ignore[attr-defined]
        return err

    def to_size(self, i: int) -> int:
        token = self.tok(i)
        try:
            return _stoull(token)
        except _NumberError as e:
            what = (
                "is out of range for a 64-bit unsigned integer"
                if e.out_of_range
                else ("is not a non-negative integer")
            )
            raise self.error(f"value '{token}' of {self.key} {what}") from None

    def to_double(self, i: int) -> float:
        token = self.tok(i)
        try:
            return _stod(token)
        except _NumberError as e:
            what = "is out of the range of a double" if e.out_of_range else "is not a number"
            raise self.error(f"value '{token}' of {self.key} {what}") from None

    def to_bool(self, i: int) -> bool:
        token = self.tok(i)
        if token == "True":
            return True
        if token == "False":
            return False
        raise self.error(
            f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{token}'"
        )

    def skip_key(self, i: int) -> int:
        self.check(i + 1, ":")  # result ignored, as in torch: only the bounds matter
        i += 2
        if self.tok(i) != "[":
            return i
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            i += 1
        if i >= len(self.tokens):
            raise _Malformed(i)
        return i

    # -- the core (AcceleratorAllocatorConfig) keys
    def parse_large_segment(self, i: int) -> int:
        self.key = "large_segment_size_mb"
        self.check(i + 1, ":")
        i += 2
        value = self.to_size(i)
        if not value > 10:
            raise self.error("CachingAllocator option large_segment_size_mb must be > 10 MB")
        self.values["large_segment_size"] = min(value, SIZE_MAX // MIB) * MIB
        return i

    def parse_mb_at_least_large(self, i: int, key: str, name: str) -> int:
        self.key = key
        self.check(i + 1, ":")
        i += 2
        value = self.to_size(i)
        minimum = self.values["large_segment_size"] // MIB  # type: ignore[operator]
        if value < minimum:
            raise self.error(f"CachingAllocator option {key} too small, must be >= {minimum}")
        self.values[name] = min(value, SIZE_MAX // MIB) * MIB
        return i

    def parse_gc(self, i: int) -> int:
        self.key = "garbage_collection_threshold"
        self.check(i + 1, ":")
        i += 2
        value = self.to_double(i)
        if not (value > 0 and value < 1.0):
            raise self.error("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
        self.values["garbage_collection_threshold"] = value
        return i

    def parse_roundup(self, i: int) -> int:
        self.key = "roundup_power2_divisions"
        self.check(i + 1, ":")
        i += 2
        divs = [0] * ROUNDUP_INTERVALS
        if self.tok(i) == "[":
            first_value = True
            last_index = 0
            i += 1
            while i < len(self.tokens) and self.tokens[i] != "]":
                boundary_index = i
                self.check(i + 1, ":")
                i += 2
                value = self.to_size(i)
                if not (value == 0 or _is_pow2(value)):
                    raise self.error(
                        "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
                    )
                if self.tokens[boundary_index] == ">":
                    for j in range(last_index + 1, ROUNDUP_INTERVALS):
                        divs[j] = value
                else:
                    boundary = self.to_size(boundary_index)
                    if not _is_pow2(boundary):
                        raise self.error("For roundups, the intervals have to be power of 2 ")
                    index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                    if first_value:
                        divs[:index] = [value] * index
                        first_value = False
                    divs[index] = value
                    last_index = index
                if self.tok(i + 1) != "]":
                    i += 1  # torch's checkToken(',') result is ignored
                i += 1
            if i >= len(self.tokens):
                raise _Malformed(i)
        else:
            value = self.to_size(i)
            if not _is_pow2(value):
                raise self.error("For roundups, the divisions has to be power of 2 ")
            divs = [value] * ROUNDUP_INTERVALS
        self.values["roundup_power2_divisions"] = tuple(divs)
        return i

    def parse_bool(self, i: int, key: str, name: str) -> int:
        self.key = key
        self.check(i + 1, ":")
        i += 2
        self.values[name] = self.to_bool(i)
        return i

    def parse_pinned_mb(self, i: int, key: str, name: str) -> int:
        self.key = key
        self.check(i + 1, ":")
        i += 2
        # torch multiplies in size_t without a check, so huge values wrap around.
        self.values[name] = (self.to_size(i) * MIB) % (1 << 64)
        return i

    def core_pass(self) -> None:
        n = len(self.tokens)
        # large_segment_size_mb is read first, wherever it appears (even inside another key's
        # list value): the minimums of max_split_size_mb and max_non_split_rounding_mb depend on it.
        i = 0
        while i < n:
            if self.tokens[i] == "large_segment_size_mb":
                i = self.parse_large_segment(i)
            i += 1
        self.values["max_non_split_rounding_size"] = self.values["large_segment_size"]
        known = set(CORE_KEYS)
        if self.device in ("cuda", "hip"):
            known.update(CUDA_KEYS)
        i = 0
        while i < n:
            key = self.tokens[i]
            self.key = key
            if key == "large_segment_size_mb":
                i = self.skip_key(i)
            elif key == "max_split_size_mb":
                i = self.parse_mb_at_least_large(i, key, "max_split_size")
            elif key == "max_non_split_rounding_mb":
                i = self.parse_mb_at_least_large(i, key, "max_non_split_rounding_size")
            elif key == "garbage_collection_threshold":
                i = self.parse_gc(i)
            elif key == "roundup_power2_divisions":
                i = self.parse_roundup(i)
            elif key in ("expandable_segments", "pinned_use_background_threads"):
                i = self.parse_bool(i, key, key)
            elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
                i = self.parse_pinned_mb(i, key, key[: -len("_mb")])
            else:
                if self.device != "cpu" and key not in known:
                    raise self.unrecognized(key)
                i = self.skip_key(i)
            if i + 1 < n:
                i += 1  # the ',' after an entry: torch skips it without checking it
            i += 1

    def unrecognized(self, key: str) -> ConfigError:
        keys = list(CORE_KEYS) + (list(CUDA_KEYS) if self.device in ("cuda", "hip") else [])
        hint = " (a stray separator where a key was expected)" if key in _SEPARATORS else ""
        err = ConfigError(
            f"invalid allocator config {self.text!r}: Unrecognized key '{key}' in Accelerator "
            f"allocator config.{hint} Keys accepted on {self.device}: {', '.join(keys)}"
        )
        err.key = key  # type: ignore[attr-defined]
        return err

    # -- the CUDA/ROCm hook (CUDAAllocatorConfig::parseArgs), run after the core pass
    def device_pass(self) -> None:
        n = len(self.tokens)
        i = 0
        while i < n:
            key = self.tokens[i]
            self.key = key
            if key == "backend":
                self.check(i + 1, ":")
                i += 2
                options = ("native", "cudaMallocAsync")
                message = "Unknown allocator backend, options are native and cudaMallocAsync"
                if self.device == "hip":
                    options += ("hipMallocAsync",)
                    message = (
                        "Unknown allocator backend, options are native, cudaMallocAsync, "
                        "and hipMallocAsync"
                    )
                if self.tok(i) not in options:
                    raise self.error(message)
                self.values["backend"] = self.tok(i)
            elif key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc"):
                i = self.parse_bool(i, key, "release_lock_on_cudamalloc")
            elif key in ("pinned_use_cuda_host_register", "pinned_use_hip_host_register"):
                i = self.parse_bool(i, key, "pinned_use_cuda_host_register")
            elif key in (
                "graph_capture_record_stream_reuse",
                "pinned_free_catch_all",
                "throw_on_cudamalloc_oom",
            ):
                i = self.parse_bool(i, key, key)
            elif key == "pinned_num_register_threads":
                self.check(i + 1, ":")
                i += 2
                value = self.to_size(i)
                if not _is_pow2(value):
                    raise self.error(
                        f"Number of register threads has to be power of 2, got {value}"
                    )
                if value > _MAX_PINNED_REGISTER_THREADS:
                    raise self.error(
                        "Number of register threads should be less than or equal to "
                        f"{_MAX_PINNED_REGISTER_THREADS}, got {value}"
                    )
                self.values["pinned_num_register_threads"] = value
            elif key == "pinned_reserve_segment_size_mb":
                self.check(i + 1, ":")
                i += 2
                value = self.to_size(i)
                if not value > 0:
                    raise self.error("Pinned reserve segment size has to be greater than 0")
                self.values["pinned_reserve_segment_size"] = value * MIB
            elif key == "per_process_memory_fraction":
                self.check(i + 1, ":")
                i += 2
                value = self.to_double(i)
                if not (value >= 0.0 and value <= 1.0):
                    raise self.error("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
                self.values["per_process_memory_fraction"] = value
            else:
                i = self.skip_key(i)  # core keys; unknown keys were refused by the core pass
            if i + 1 < n:
                i += 1
            i += 1

    def malformed(self, index: int) -> ConfigError:
        key = self.key
        if key in _SEPARATORS:
            what = f"a stray '{key}' where a key was expected (empty entry?)"
        elif any(t == "[" for t in self.tokens) and index >= len(self.tokens):
            what = f"the string ends inside the value of '{key}' (missing value or ']'?)"
        else:
            what = f"key '{key}' has no value (expected '{key}:<value>')"
        err = ConfigError(
            f"malformed allocator config {self.text!r}: {what}; {_SYNTAX}. "
            "(torch itself fails here with an internal assert, "
            "'Index out of bounds in ConfigTokenizer'.)"
        )
        err.key = key  # type: ignore[attr-defined]
        return err

    def run(self) -> AllocatorSettings:
        self.values["large_segment_size"] = 20 * MIB
        try:
            self.core_pass()
            if self.device in ("cuda", "hip"):
                self.device_pass()
        except _Malformed as e:
            raise self.malformed(e.args[0]) from None
        return AllocatorSettings(device=self.device, text=self.text, **self.values)  # type: ignore[arg-type]


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def parse_config(text: str, device: str = "cuda") -> AllocatorSettings:
    """Parse an allocator config string the way torch 2.13 does on a ``device`` build.

    Raises :class:`ConfigError` (a ``ValueError``) naming the offending key (also as
    ``err.key``) and the legal values; nothing is partially applied.
    """
    if not isinstance(text, str):
        raise ConfigError(f"an allocator config must be a str, got {type(text).__name__}")
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    return _Parser(text, device).run()


def settings_from_environment(
    environ: Mapping[str, str] | None = None, device: str = "cuda"
) -> tuple[AllocatorSettings, str | None]:
    """Settings from the first of ``CONFIG_VARIABLES`` that is set, and that variable's name.

    The first variable that is present wins whole, even when empty; the others are not read
    and nothing is merged (checked on torch 2.13). Returns default settings and ``None`` when
    none is set. A bad string raises :class:`ConfigError` naming the variable.
    """
    env = os.environ if environ is None else environ
    for name in CONFIG_VARIABLES:
        if name in env:
            try:
                return parse_config(env[name], device), name
            except ConfigError as e:
                err = ConfigError(f"{name}: {e}")
                err.key = getattr(e, "key", None)  # type: ignore[attr-defined]
                raise err from None
    return AllocatorSettings(device=device), None


def settings_from_snapshot(
    allocator_settings: Mapping[str, object], device: str = "cuda"
) -> AllocatorSettings:
    """The settings a memory snapshot says it was recorded with.

    Uses the recorded raw string (``"PYTORCH_CUDA_ALLOC_CONF"``) when it is there and parses;
    otherwise the individual fields torch writes (``max_split_size`` with -1 for unlimited, the
    divisions keyed "1" ... "32768", ...). Fields torch does not write keep their defaults.
    Raises :class:`ConfigError` for values of the wrong type.
    """
    raw = allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(raw, str) and raw:
        try:
            return parse_config(raw, device)
        except ConfigError:
            pass  # a string torch accepted on another build; fall back to the fields
    values: dict[str, object] = {}

    def get(key: str, kind: type | tuple[type, ...]) -> object:
        value = allocator_settings.get(key)
        if value is not None and (not isinstance(value, kind) or (
            kind is not bool and isinstance(value, bool))):  # fmt: skip
            raise ConfigError(f"snapshot allocator_settings[{key!r}] has the wrong type: {value!r}")
        return value

    max_split = get("max_split_size", int)
    if isinstance(max_split, int) and max_split >= 0:
        values["max_split_size"] = max_split
    gc = get("garbage_collection_threshold", (int, float))
    if gc is not None:
        values["garbage_collection_threshold"] = float(gc)  # type: ignore[arg-type]
    for key in (
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
    ):
        if get(key, bool) is not None:
            values[key] = allocator_settings[key]
    threads = get("pinned_num_register_threads", int)
    if threads is not None:
        values["pinned_num_register_threads"] = threads
    divisions = allocator_settings.get("roundup_power2_divisions")
    if divisions is not None:
        if not isinstance(divisions, Mapping):
            raise ConfigError(
                "snapshot allocator_settings['roundup_power2_divisions'] is not a dict"
            )
        divs = [0] * ROUNDUP_INTERVALS
        for k, v in divisions.items():
            boundary = int(k) if str(k).isdigit() else 0
            index = boundary.bit_length() - 1 if _is_pow2(boundary) else -1
            if not 0 <= index < ROUNDUP_INTERVALS or type(v) is not int or v < 0:
                raise ConfigError(
                    f"snapshot roundup_power2_divisions entry {k!r}: {v!r} is invalid"
                )
            divs[index] = v
        values["roundup_power2_divisions"] = tuple(divs)
    return AllocatorSettings(device=device, text=raw if isinstance(raw, str) else "", **values)  # type: ignore[arg-type]
