"""How a test compares replay with eager under the active replay mode.

The per-dtype tolerances and the two comparisons (:data:`TOLERANCES`, :func:`tolerance_for`,
:func:`assert_bitwise_equal`, :func:`assert_close_for_dtype`) live in
:mod:`accel_graph.foundation.tolerances` (the foundation layer, so the runner can use them) and are
re-exported here unchanged. This module adds what depends on the replay mode a test runs under:
:func:`compiled_replay` and :func:`assert_replay_matches`, which picks bitwise equality under
interpreted replay and the per-dtype tolerances under compiled replay, so one test body serves
both modes.
"""

from __future__ import annotations

from typing import Any

from ..foundation import config
from ..foundation.tolerances import (
    TOLERANCES,
    Tolerance,
    assert_bitwise_equal,
    assert_close_for_dtype,
    tolerance_for,
)

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_bitwise_equal",
    "assert_close_for_dtype",
    "assert_replay_matches",
    "compiled_replay",
    "tolerance_for",
]


def compiled_replay() -> bool:
    """Whether graphs made without ``compile=`` replay compiled code (``ACCEL_GRAPH_COMPILE``).

    The plugin sets it per case (``recorder+inductor``); native backends ignore it.
    """
    return config.default_compile() is not None


def assert_replay_matches(
    actual: Any, expected: Any, *, msg: str = "", compiled: bool | None = None
) -> None:
    """Assert a graph's replay results match eager's, as DESIGN.md asks of the replay mode.

    Bitwise (:func:`assert_bitwise_equal`) under interpreted replay; within the per-dtype
    :data:`TOLERANCES` (:func:`assert_close_for_dtype`, exact for integers and bool) under
    compiled replay. ``compiled`` defaults to :func:`compiled_replay`; pass it for a graph made
    with an explicit ``compile=``.
    """
    if compiled is None:
        compiled = compiled_replay()
    if compiled:
        assert_close_for_dtype(actual, expected, msg=msg)
    else:
        assert_bitwise_equal(actual, expected, msg=msg)
