"""``Graph(compile="inductor", compile_options={...})``: the options of compiled replay.

Parsed once, at ``Graph`` construction, so a misspelt key or a bad value fails there with the
list of what is accepted, before anything is captured. The recorder backend reads the parsed
:class:`CompileOptions`; native backends ignore compiled replay altogether (their graphs are
already launch-free).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from . import config

__all__ = ["REPLAY_CHOICES", "CompileOptions", "parse_compile_options", "resolve_compile"]

#: ``replay``: ``"auto"`` times the compiled and the interpreted program and keeps the faster
#: (at instantiation where extra runs cannot be observed, else on the first real replays; see
#: docs/recorder.md); ``"compiled"`` and ``"interpreted"`` force one (``"interpreted"`` compiles
#: nothing).
REPLAY_CHOICES = ("auto", "compiled", "interpreted")


@dataclass(frozen=True)
class CompileOptions:
    """What ``compile_options=`` may set (every field has a default).

    Attributes:
        replay: which program replays: ``"auto"`` (the faster one, measured without
            observable effects), ``"compiled"`` or ``"interpreted"``. ``Graph.replay_mode()``
            says which replays and why.
        freeze: compile captured parameters as constants (Inductor's freezing). Opt-in: an
            in-place update of a frozen tensor after instantiation is then not seen by replay.
        cpp_wrapper: compile Inductor's wrapper (the code calling the kernels) as C++ instead
            of Python: less per-call overhead, much longer cold compilation (docs/recorder.md,
            "Compiled replay"). A program the C++ wrapper cannot build compiles with the Python
            wrapper instead.
    """

    replay: str = "auto"
    freeze: bool = False
    cpp_wrapper: bool = False


def parse_compile_options(value: Mapping[str, Any] | CompileOptions | None,
                          default_replay: str | None = None) -> CompileOptions:
    """``value`` as :class:`CompileOptions`; raises :class:`ConfigError` naming what is accepted.

    ``default_replay`` (``ACCEL_GRAPH_COMPILE_REPLAY``, passed by ``Graph``) replaces ``"auto"``
    as the ``replay`` of a ``value`` that sets none (a dict without the key, or None); a
    :class:`CompileOptions` is taken as given."""
    if isinstance(value, CompileOptions):
        return value
    if default_replay is not None and default_replay not in REPLAY_CHOICES:
        raise ConfigError(
            f"ACCEL_GRAPH_COMPILE_REPLAY={default_replay!r}; use one of "
            f"{', '.join(map(repr, REPLAY_CHOICES))} (or leave it unset)")
    if value is None:
        return CompileOptions(replay=default_replay or "auto")
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"compile_options must be a dict (or CompileOptions), not {type(value).__name__}")
    known = {f.name for f in fields(CompileOptions)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"unknown compile_options key(s) {', '.join(map(repr, unknown))}; accepted: "
            f"{', '.join(sorted(known))}")
    replay = value.get("replay", default_replay or "auto")
    if replay not in REPLAY_CHOICES:
        raise ConfigError(
            f"compile_options['replay']={replay!r}; use one of {', '.join(map(repr, REPLAY_CHOICES))}")
    flags = {}
    for name in ("freeze", "cpp_wrapper"):
        flag = value.get(name, False)
        if not isinstance(flag, bool):
            raise ConfigError(f"compile_options[{name!r}] must be True or False, not {flag!r}")
        flags[name] = flag
    return CompileOptions(replay=replay, **flags)


def resolve_compile(compile: str | None,
                    compile_options: Mapping[str, Any] | CompileOptions | None
                    ) -> tuple[str | None, CompileOptions | None]:
    """``compile=`` and ``compile_options=`` as a Graph (or every Graph of a runner) uses them:
    ``compile=None`` takes ``ACCEL_GRAPH_COMPILE``, options need ``compile="inductor"`` and take
    ``ACCEL_GRAPH_COMPILE_REPLAY`` as the default ``replay``. Raises :class:`ConfigError`."""
    if compile is None:
        compile = config.default_compile()
    if compile not in (None, "inductor"):
        raise ConfigError(f"unknown compile={compile!r}; use None (replay as captured) or 'inductor'")
    if compile is None:
        if compile_options is not None:
            raise ConfigError("compile_options apply to compiled replay only; pass compile='inductor' too")
        return None, None
    return compile, parse_compile_options(compile_options, default_replay=config.default_compile_replay())
