"""``PYTORCH_ALLOC_CONF`` strings: parse them exactly as a given torch does, and format them back.

Contract:

- :func:`parse_config` takes the torch version whose rules to apply (``torch="2.13"``,
  ``"2.14.1+cu130"``; default: the newest, :data:`NEWEST_RULES`); :mod:`.rules` holds one
  :class:`ParserRules` per measured torch (today 2.13 and 2.14, which parse identically) and
  :func:`rules_for` picks one, with a clear :class:`ConfigError` for an unreadable version.
- :func:`parse_config` accepts and rejects the same strings as that torch's parser
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

Modules, lowest first: ``numbers`` (torch-exact ``stoull``/``stod`` and the tokenizer),
``tokens`` (the token walk every key handler stands on: token access, value conversions, the
roundup list, the error messages), ``settings`` (:class:`AllocatorSettings` and the constants),
``rules`` (the parser rules per torch version), ``grammar`` (the keys of each pass,
:func:`parse_config`), ``sources`` (settings from the environment or from a memory snapshot).
"""

from __future__ import annotations

from .grammar import CORE_KEYS, CUDA_KEYS, parse_config
from .rules import NEWEST_RULES, RULES, ParserRules, parse_torch_version, rules_for
from .settings import (
    CONFIG_VARIABLES,
    DEVICES,
    MIB,
    ROUNDUP_INTERVALS,
    SIZE_MAX,
    AllocatorSettings,
)
from .sources import settings_from_environment, settings_from_snapshot

__all__ = [
    "CONFIG_VARIABLES",
    "CORE_KEYS",
    "CUDA_KEYS",
    "DEVICES",
    "MIB",
    "NEWEST_RULES",
    "ROUNDUP_INTERVALS",
    "RULES",
    "SIZE_MAX",
    "AllocatorSettings",
    "ParserRules",
    "parse_config",
    "parse_torch_version",
    "rules_for",
    "settings_from_environment",
    "settings_from_snapshot",
]
