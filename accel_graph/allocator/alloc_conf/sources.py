"""Where allocator settings come from besides a string: the environment, a memory snapshot."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...errors import ConfigError
from .grammar import parse_config
from .numbers import is_pow2
from .rules import ParserRules, rules_for
from .settings import CONFIG_VARIABLES, ROUNDUP_INTERVALS, AllocatorSettings

__all__ = ["settings_from_environment", "settings_from_snapshot"]


def settings_from_environment(
    environ: Mapping[str, str] | None = None,
    device: str = "cuda",
    torch: str | tuple[int, int] | ParserRules | None = None,
) -> tuple[AllocatorSettings, str | None]:
    """Settings from the first of ``CONFIG_VARIABLES`` that is set, and that variable's name.

    The first variable that is present wins whole, even when empty; the others are not read
    and nothing is merged (checked on torch 2.13). Returns default settings and ``None`` when
    none is set. A bad string raises :class:`ConfigError` naming the variable. ``torch``
    chooses the parser rules as in :func:`~.grammar.parse_config`.
    """
    env = os.environ if environ is None else environ
    for name in CONFIG_VARIABLES:
        if name in env:
            try:
                return parse_config(env[name], device, torch), name
            except ConfigError as e:
                err = ConfigError(f"{name}: {e}")
                err.key = getattr(e, "key", None)  # type: ignore[attr-defined]
                raise err from None
    return AllocatorSettings(device=device, rules=rules_for(torch).name), None


def settings_from_snapshot(
    allocator_settings: Mapping[str, object],
    device: str = "cuda",
    torch: str | tuple[int, int] | ParserRules | None = None,
) -> AllocatorSettings:
    """The settings a memory snapshot says it was recorded with.

    Uses the recorded raw string (``"PYTORCH_CUDA_ALLOC_CONF"``) when it is there and parses;
    otherwise the individual fields torch writes (``max_split_size`` with -1 for unlimited, the
    divisions keyed "1" ... "32768", ...). Fields torch does not write keep their defaults.
    Raises :class:`ConfigError` for values of the wrong type. ``torch`` chooses the parser
    rules for the recorded string as in :func:`~.grammar.parse_config`.
    """
    raw = allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(raw, str) and raw:
        try:
            return parse_config(raw, device, torch)
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
            index = boundary.bit_length() - 1 if is_pow2(boundary) else -1
            if not 0 <= index < ROUNDUP_INTERVALS or type(v) is not int or v < 0:
                raise ConfigError(
                    f"snapshot roundup_power2_divisions entry {k!r}: {v!r} is invalid"
                )
            divs[index] = v
        values["roundup_power2_divisions"] = tuple(divs)
    return AllocatorSettings(device=device, text=raw if isinstance(raw, str) else "",
                             rules=rules_for(torch).name, **values)  # type: ignore[arg-type]
