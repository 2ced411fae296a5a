"""Test helpers for code that captures graphs with accel-graph, on any backend.

- :mod:`accel_graph.testing.plugin`: the pytest plugin (``backend_name``/``device`` fixtures
  over every registered backend, the ``gpu`` marker).
- :mod:`accel_graph.testing.tolerances`: how replay is compared with eager, per dtype (the
  tolerances themselves live in :mod:`accel_graph.foundation.tolerances`);
  :func:`assert_replay_matches` is bitwise under interpreted replay and within tolerances under
  compiled replay (``ACCEL_GRAPH_COMPILE=inductor``, the plugin's ``+inductor`` cases).
- :func:`capture`: warm up, then capture a function the way real device-graph code does;
  :func:`capture_stream` for manual ``capture_begin``/``capture_end``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .tolerances import (
    TOLERANCES,
    Tolerance,
    assert_bitwise_equal,
    assert_close_for_dtype,
    assert_replay_matches,
    compiled_replay,
    tolerance_for,
)

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_bitwise_equal",
    "assert_close_for_dtype",
    "assert_replay_matches",
    "capture",
    "capture_stream",
    "compiled_replay",
    "synchronize",
    "tolerance_for",
]


def synchronize(g: Any) -> None:
    """Wait for all work on the device of graph ``g`` (a no-op on host devices)."""
    g.backend.synchronize(g.device_spec)


def capture_stream(g: Any) -> AbstractContextManager[Any]:
    """Make current the stream ``accel_graph.graph(g)`` would capture on.

    Wrap manual ``g.capture_begin()`` ... ``g.capture_end()`` in it: CUDA and HIP refuse to
    capture on the default stream. A no-op on devices without streams.
    """
    return g.backend.stream_context(g.backend.capture_stream(g.device_spec))


def capture(
    g: Any, fn: Callable[..., Any], *args: Any, warmup: int = 1, **graph_kwargs: Any
) -> Any:
    """Run ``fn(*args)`` eagerly ``warmup`` times, then capture it into ``g`` and return its outputs.

    This is the usual device-graph recipe: warm-up lets libraries pick algorithms and allocate
    workspaces outside the capture (under the backend's ``control_flow_warmup``); ``args`` are
    the static inputs to ``copy_`` fresh data into before each ``g.replay()``; the returned
    tensors are the static outputs that replay refreshes.
    ``graph_kwargs`` go to :func:`accel_graph.graph` (``pool=``, ``capture_error_mode=``).
    """
    from .. import graph

    # On native backends, both branches of every torch.cond are warmed up, not only the taken one.
    with g.backend.control_flow_warmup(g.device_spec):
        for _ in range(warmup):
            fn(*args)
    synchronize(g)
    with graph(g, **graph_kwargs):
        out = fn(*args)
    return out
