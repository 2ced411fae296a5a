"""``assert_capturable``: a portability suite's check, on CPU CI, that a model is capturable.

::

    from accel_graph.testing.capturable import assert_capturable

    def test_decoder_is_capturable():
        model = MyModel()
        assert_capturable(model.decode_step, tokens, positions, target="cuda")

On failure the message lists every capture-illegal operation with its source line (see
:func:`accel_graph.check_capturable`), not just the first, and the modules to mark as eager
islands for them (``mark model.layers.0.mlp.experts (MixtralExperts) as an eager island``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..graphs.capturable import CapturabilityReport, check_capturable

__all__ = ["assert_capturable"]


def assert_capturable(fn: Callable[..., Any], *args: Any, target: Any = None,
                      **kwargs: Any) -> CapturabilityReport:
    """Run ``fn(*args, **kwargs)`` eagerly; fail with every capture-illegal op if any.

    ``target`` is passed to :func:`~accel_graph.check_capturable` (e.g. ``"cuda"`` to count CPU
    tensors as host memory). Returns the report (``report.result`` is ``fn``'s result).
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not this helper's
    report = check_capturable(fn, *args, target=target, **kwargs)
    if not report.ok:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise AssertionError(f"{name} is not capturable: {report.format()}")
    return report
