"""Every environment variable accel-graph reads, in one place.

Values are read when a function here is called, never at import, and never on a hot path
(replay and allocate take their settings from objects built at capture time).
"""

from __future__ import annotations

import os

#: Forces the backend (a registered name or alias), like ``TRITON_ACTIVE_DRIVER``.
BACKEND_VAR = "ACCEL_GRAPH_BACKEND"
#: "1" fills recorder outputs with a poison value at capture, so reads before replay stand out.
POISON_VAR = "ACCEL_GRAPH_POISON"


def backend_override() -> str | None:
    """The backend named by ``ACCEL_GRAPH_BACKEND``, or None when unset or empty."""
    value = os.environ.get(BACKEND_VAR, "").strip()
    return value or None


def poison_outputs() -> bool:
    """Whether ``ACCEL_GRAPH_POISON`` asks for poisoned capture outputs."""
    return os.environ.get(POISON_VAR, "").strip().lower() in {"1", "true", "yes", "on"}

#: Upper bound, in bytes, on the memory of one recorder graph pool (unset: unbounded).
POOL_LIMIT_VAR = "ACCEL_GRAPH_POOL_LIMIT"


def pool_limit() -> int | None:
    """The recorder pool limit from ``ACCEL_GRAPH_POOL_LIMIT`` (bytes; K/M/G suffixes allowed)."""
    from ..errors import ConfigError

    raw = os.environ.get(POOL_LIMIT_VAR, "").strip()
    if not raw:
        return None
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1].upper(), 1)
    digits = raw[:-1] if scale != 1 else raw
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ConfigError(
            f"{POOL_LIMIT_VAR}={raw!r} is not a size; use bytes or a K/M/G suffix, e.g. 512M"
        ) from None
    if value <= 0:
        raise ConfigError(f"{POOL_LIMIT_VAR} must be positive, got {raw!r}")
    return value

#: Default ``compile=`` for graphs that do not pass one ("inductor" or empty).
COMPILE_VAR = "ACCEL_GRAPH_COMPILE"


def default_compile() -> str | None:
    """The ``compile=`` a Graph uses when given none (``ACCEL_GRAPH_COMPILE``), or None."""
    value = os.environ.get(COMPILE_VAR, "").strip().lower()
    return value or None

#: "0" keeps the control-flow mode out of native captures (docs/backends.md "Control flow").
NATIVE_CONTROL_FLOW_VAR = "ACCEL_GRAPH_NATIVE_CONTROL_FLOW"


def native_control_flow() -> bool:
    """Whether native captures run under the control-flow mode (``torch.cond`` as conditional
    nodes, clear refusals). On unless ``ACCEL_GRAPH_NATIVE_CONTROL_FLOW`` is 0/false/no/off:
    the mode costs a Python call per captured op (tools/bench_native_cf_mode.py), at capture only."""
    return os.environ.get(NATIVE_CONTROL_FLOW_VAR, "").strip().lower() not in {"0", "false", "no", "off"}


#: Default ``compile_options["replay"]`` for graphs that do not set it ("auto", "compiled" or
#: "interpreted"; empty: "auto"). The conformance suite's compiled cases set "compiled", so they
#: test compiled code whatever the timing would pick.
COMPILE_REPLAY_VAR = "ACCEL_GRAPH_COMPILE_REPLAY"


def default_compile_replay() -> str | None:
    """The ``replay`` compiled graphs use when ``compile_options`` sets none
    (``ACCEL_GRAPH_COMPILE_REPLAY``), or None when unset or empty; values are checked by
    :func:`accel_graph.foundation.compile_options.parse_compile_options`."""
    value = os.environ.get(COMPILE_REPLAY_VAR, "").strip().lower()
    return value or None
