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
