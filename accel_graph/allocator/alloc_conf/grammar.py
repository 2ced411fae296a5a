"""The ``PYTORCH_ALLOC_CONF`` grammar: torch's token walk, with messages that say what is wrong.

:func:`parse_config` is the entry point (the package docstring states the contract);
:class:`ConfigParser` is one parse of one string for one device under one torch version's
:class:`~.rules.ParserRules` (the keys each version knows).
"""

from __future__ import annotations

from ...errors import ConfigError
from ..devices import config_dialect
from .numbers import SEPARATORS, Malformed, is_pow2
from .rules import NEWEST_RULES, RULES, ParserRules, rules_for
from .settings import MIB, SIZE_MAX, AllocatorSettings
from .tokens import TokenWalk

__all__ = ["CORE_KEYS", "CUDA_KEYS", "ConfigParser", "parse_config"]

#: The newest rules' keys (per-version key sets live in :mod:`.rules`).
CORE_KEYS = RULES[NEWEST_RULES].core_keys
CUDA_KEYS = RULES[NEWEST_RULES].cuda_keys
_MAX_PINNED_REGISTER_THREADS = 128


class ConfigParser(TokenWalk):
    """One parse of one string for one device: torch's token walk with our error messages."""

    def __init__(self, text: str, device: str, rules: ParserRules | None = None) -> None:
        super().__init__(text, device)
        self.rules = rules_for(rules)
        self.dialect = config_dialect(device)

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
        known = set(self.rules.core_keys)
        if self.dialect.cuda_hook:
            known.update(self.rules.cuda_keys)
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
            elif (key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
                  and key in self.rules.core_keys):  # torch 2.11 does not know them
                i = self.parse_pinned_mb(i, key, key[: -len("_mb")])
            else:
                if self.dialect.refuses_unknown_keys and key not in known:
                    raise self.unrecognized(key)
                i = self.skip_key(i)
            if i + 1 < n:
                i += 1  # the ',' after an entry: torch skips it without checking it
            i += 1

    def unrecognized(self, key: str) -> ConfigError:
        keys = list(self.rules.core_keys) + (
            list(self.rules.cuda_keys) if self.dialect.cuda_hook else []
        )
        hint = " (a stray separator where a key was expected)" if key in SEPARATORS else ""
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
                options = self.dialect.backends
                if self.tok(i) not in options:
                    # torch's words: "a and b", or "a, b, and c"
                    *first, last = options
                    listed = (f"{first[0]} and {last}" if len(first) == 1
                              else f"{', '.join(first)}, and {last}")
                    raise self.error(f"Unknown allocator backend, options are {listed}")
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
                if not is_pow2(value):
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


    def run(self) -> AllocatorSettings:
        self.values["large_segment_size"] = 20 * MIB
        try:
            self.core_pass()
            if self.dialect.cuda_hook:
                self.device_pass()
        except Malformed as e:
            raise self.malformed(e.args[0]) from None
        return AllocatorSettings(
            device=self.device, text=self.text, rules=self.rules.name, **self.values  # type: ignore[arg-type]
        )


def parse_config(
    text: str, device: str = "cuda", torch: str | tuple[int, int] | ParserRules | None = None
) -> AllocatorSettings:
    """Parse an allocator config string the way torch ``torch`` does on a ``device`` build.

    ``torch``: a version (``"2.13"``, ``"2.14.1+cu130"``, ``(2, 14)``), a
    :class:`~.rules.ParserRules`, or None for the newest rules (:func:`~.rules.rules_for`);
    the result's ``rules`` field names the rules applied. Raises :class:`ConfigError` (a
    ``ValueError``) naming the offending key (also as ``err.key``) and the legal values, or
    saying which torch versions have rules; nothing is partially applied.
    """
    if not isinstance(text, str):
        raise ConfigError(f"an allocator config must be a str, got {type(text).__name__}")
    config_dialect(device)  # raises ConfigError naming the devices
    return ConfigParser(text, device, rules_for(torch)).run()
