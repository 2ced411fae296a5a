"""What the benchmarks read off a variant, without ever failing because of it.

Contract, shared by :mod:`accel_graph.bench.decode` and :mod:`accel_graph.bench.models`:

- :data:`UNAVAILABLE` are the errors that mean "this variant cannot run here" (its row says
  ``unavailable``); anything else is ``failed``. :func:`reason` is the one-line why of either.
- :func:`fxgraph_counters` / :func:`counter_delta`: Inductor's FX-graph cache hits and misses
  around a compile (a private torch API: empty, or None, rather than an error).
- :func:`ops_per_graph`, :func:`graph_bytes`, :func:`pool_reserved`, :func:`replay_mode`: what a
  captured graph says about itself, where its backend and this version say it (else None).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import BackendUnavailable

__all__ = [
    "UNAVAILABLE",
    "counter_delta",
    "fxgraph_counters",
    "graph_bytes",
    "ops_per_graph",
    "pool_reserved",
    "reason",
    "replay_mode",
]

#: Errors that mean "this variant cannot run here" (no backend yet, not built, not supported).
#: Anything else, a CaptureError included, is reported as "failed" with its message.
UNAVAILABLE = (BackendUnavailable, ImportError, NotImplementedError)


def reason(exc: BaseException) -> str:
    """``"<type>: <first line of the message>"``, or the type alone for an empty message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def fxgraph_counters() -> dict[str, int]:
    """Inductor's ``fxgraph_cache*`` counters of this process (empty where torch hides them)."""
    try:
        from torch._dynamo.utils import counters

        return {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    except Exception:  # private API: report nothing rather than fail
        return {}


def counter_delta(before: dict[str, int]) -> dict[str, int] | None:
    """The counters' change since ``before`` (a :func:`fxgraph_counters` result); None if none."""
    after = fxgraph_counters()
    return {k: after[k] - before.get(k, 0) for k in after} or None


def ops_per_graph(g: Any) -> int | None:
    """The number of ops the backend recorded, where it says (``num_ops``); else None."""
    value = getattr(getattr(g, "_impl", None), "num_ops", None)
    if callable(value):
        value = value()
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def graph_bytes(g: Any, what: str) -> int | None:
    """``g.<what>()`` (``memory_bytes``, ``standalone_bytes``) where it answers an int."""
    try:
        value = getattr(g, what)()
    except Exception:  # optional introspection: absent on some backends, or not filled yet
        return None
    return value if isinstance(value, int) else None


def pool_reserved(g: Any) -> int | None:
    """The bytes reserved by the pool ``g`` captured into, where its backend reports them."""
    try:
        stats = g.backend.pool_stats(g.pool())
    except Exception:  # optional introspection
        return None
    return None if stats is None else stats.reserved_bytes


def replay_mode(g: Any) -> Any:
    """``Graph.replay_mode()`` where this version has it (feature-detected), else None."""
    fn = getattr(g, "replay_mode", None)
    if not callable(fn):
        return None
    try:
        mode = fn()
    except Exception as exc:  # introspection must not break the benchmark
        return f"unknown ({reason(exc)})"
    if dataclasses.is_dataclass(mode) and not isinstance(mode, type):
        return dataclasses.asdict(mode)  # JSON-ready: mode, reason, medians, where decided
    return mode if isinstance(mode, (str, dict, type(None))) else str(mode)
