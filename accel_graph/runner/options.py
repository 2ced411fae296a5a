"""The settings of one :class:`~accel_graph.runner.GraphRunner`, checked once at construction.

:class:`RunnerOptions` is what the user chose and never changes afterwards (the step, the
ladder, the device, compiled replay, the fallback and capture modes); it is frozen and held by
the runner's :class:`~accel_graph.runner.runtime.RunnerRuntime` as ``runtime.options``, apart
from the state that capture and serving change. The behaviour flags the user may change later
(``verify``, ``strict``, ``copy_outputs``, ``memory_budget``, ``progress``) are not here: they
live on the runtime, as settable runner attributes.

``compile=``/``compile_options=`` are resolved here once
(:func:`~accel_graph.foundation.compile_options.resolve_compile`): ``graph_compile`` is what
every bucket's ``Graph`` gets, so the environment is not read again per bucket.

The checks run in the order ``GraphRunner`` has always run them, so the first bad argument is
the one reported: :func:`check_settings` first, then the inputs and routing (``core``), then
:func:`verify_checks`, and compiled replay last (:meth:`RunnerOptions.resolve`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..foundation.compile_options import CompileOptions, resolve_compile
from .dynamic import resolve_ladder
from .islands import RunnerIslands

__all__ = ["FALLBACKS", "RunnerOptions", "check_settings", "verify_checks"]

#: The values of ``GraphRunner(fallback=...)`` (:mod:`.fallback`).
FALLBACKS = ("padded", "live")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """The user's settings of one runner, validated (``runtime.options``)."""

    #: The step served, ``fn(*args, **kwargs)``; also what runs on eager fallback.
    fn: Callable[..., Any]
    #: The bucket sizes, ascending (``runner.buckets``).
    ladder: list[int]
    #: The ``output_batch_dim`` argument, broadcast against the outputs at capture.
    output_batch_dim: Any
    #: The runner's device: where inputs must be, and the ``device=`` of every Graph it makes.
    device: torch.device
    #: ``compile=`` as given (None or ``"inductor"``; ``runner.compile`` and the reports show it).
    compile: str | None
    #: ``compile_options=`` as given.
    compile_options: Any
    #: ``compile``/``compile_options`` resolved once (``ACCEL_GRAPH_COMPILE`` and
    #: ``ACCEL_GRAPH_COMPILE_REPLAY`` read at construction): None, no compiled replay; else the
    #: options of ``compile="inductor"``. What every bucket's Graph gets.
    graph_compile: CompileOptions | None
    #: How a bucket that is not serving runs its batches: ``"padded"`` (at the bucket's padded
    #: shape, with the bucket's state) or ``"live"`` (at the batch's own size).
    fallback: str = "padded"
    #: ``"eager"``: ``capture()`` captures every bucket; ``"lazy"``: each bucket is captured on
    #: its first call.
    capture_mode: str = "eager"
    #: Seconds capture may spend in all (None: no limit); buckets not captured when it is spent
    #: run as fallback.
    capture_time_budget: float | None = None
    #: The caller declared ``fn`` row-independent: verification skips the live-rows check
    #: (:mod:`.rows`).
    rows_independent: bool = False
    #: Debug mode: warn when a call's outputs are still referenced at the next call.
    debug: bool = False
    #: ``islands=`` resolved (:mod:`.islands`): the modules and functions that run as eager
    #: islands in every capture of the runner (empty: none beyond those marked for good).
    islands: RunnerIslands = RunnerIslands(())

    @classmethod
    def resolve(cls, *, compile: str | None, compile_options: Any, **settings: Any) -> RunnerOptions:
        """The options, with ``compile=``/``compile_options=`` resolved as ``Graph(...)``
        resolves them (the same ``ConfigError`` messages), so a bad pair fails at construction,
        not at the first (lazy) capture."""
        return cls(compile=compile, compile_options=compile_options,
                   graph_compile=resolve_compile(compile, compile_options), **settings)


def check_settings(fn: Any, buckets: Sequence[int] | None, max_batch: int | None, dynamic: Any,
                   memory_budget: Any, fallback: Any, capture: Any,
                   capture_time_budget: Any) -> list[int]:
    """Check the scalar settings of ``GraphRunner(...)`` (``ConfigError`` naming the first bad
    one) and return the bucket ladder (:func:`.dynamic.resolve_ladder`)."""
    if not callable(fn):
        raise ConfigError(f"fn must be callable, got {type(fn).__name__}")
    ladder = resolve_ladder(buckets, max_batch, dynamic)
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
    ):
        raise ConfigError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if capture not in ("eager", "lazy"):
        raise ConfigError(f"capture must be 'eager' or 'lazy', got {capture!r}")
    if capture_time_budget is not None and (
        isinstance(capture_time_budget, bool) or not isinstance(capture_time_budget, (int, float))
        or not capture_time_budget > 0
    ):
        raise ConfigError(
            f"capture_time_budget must be a positive number of seconds, got {capture_time_budget!r}"
        )
    return ladder


def verify_checks(verify: Any) -> int:
    """``verify=`` as the number of replays per bucket to check (True: 2, False: 0)."""
    if isinstance(verify, bool):
        return 2 if verify else 0
    if not isinstance(verify, int) or verify < 0:
        raise ConfigError(f"verify must be True, False or a number of checked replays >= 0, got {verify!r}")
    return verify
