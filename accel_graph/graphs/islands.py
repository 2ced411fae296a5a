"""``accel_graph.eager_island``: code that runs eagerly between the captured pieces of a graph.

Router code that reads values on the host (``.item()``, ``nonzero``, a Python ``if`` on a
tensor: a mixture-of-experts router) cannot be captured. Marked as an island, it runs eagerly
at its point of every replay, and the graph is captured piecewise around it (vLLM's piecewise
and "breakable" graphs, SGLang's breakable graphs; here on every backend that supports islands,
with one API). What a capture does with an island is the backend's business
(:mod:`accel_graph.backends.capture_common.islands` is the meeting point; the recorder's is
``backends/recorder/islands.py``); this module only marks callables.

Outside a capture an island is a plain call: same arguments, same result, same exceptions.
An island called inside another island is a plain call too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..backends.capture_common.islands import MARK, IslandInfo, capture_runner, describe_callable

__all__ = ["eager_island", "is_eager_island"]

F = TypeVar("F")


def eager_island(obj: F) -> F:
    """Mark ``obj`` as an eager island and return it (usable as a decorator).

    - A function (or any callable that is not a class): returns a wrapper (``functools.wraps``)
      that is a plain call outside a capture. Decorating a method (``forward``) works too.
    - An ``nn.Module``: marks the module itself, so its ``forward`` becomes an island (hooks
      stay outside it: they are captured with the rest of the graph), and returns the same
      module. Marking twice is harmless; a deep copy is marked too.

    Inside a capture, calling the island ends the piece recorded so far: that piece runs once
    so the island sees real values, the island runs eagerly, its tensor outputs become static
    buffers in the graph's pool and capture goes on; every replay runs piece, island, piece, ...
    in order (docs/recorder.md "Eager islands"). Its outputs must be tensors or tuples, lists
    and dicts of them (None allowed). Raises ``TypeError`` for a class or a non-callable.
    """
    if isinstance(obj, torch.nn.Module):
        return _mark_module(obj)  # type: ignore[return-value]
    if isinstance(obj, type):
        raise TypeError(
            f"eager_island() takes a function or an nn.Module instance, not the class "
            f"{obj.__qualname__}: mark an instance (eager_island(model.layer)) or decorate the "
            f"class's forward method (@eager_island above def forward)")
    if not callable(obj):
        raise TypeError(f"eager_island() takes a function or an nn.Module, got {type(obj).__name__}")
    if isinstance(getattr(obj, MARK, None), IslandInfo):
        return obj  # already an island
    return _wrap(obj, describe_callable(obj))  # type: ignore[return-value]


def is_eager_island(obj: Any) -> bool:
    """Whether ``obj`` is an island (a wrapper made by :func:`eager_island`, or a marked module)."""
    if isinstance(obj, torch.nn.Module):
        return isinstance(obj.__dict__.get("forward"), _IslandForward)
    return isinstance(getattr(obj, MARK, None), IslandInfo)


def _wrap(fn: Callable[..., Any], info: IslandInfo) -> Callable[..., Any]:
    @functools.wraps(fn)
    def island(*args: Any, **kwargs: Any) -> Any:
        runner = capture_runner()
        if runner is None:
            return fn(*args, **kwargs)
        return runner(info, fn, args, kwargs)

    setattr(island, MARK, info)
    return island


class _IslandForward:
    """The ``forward`` of a marked module: the class's ``forward`` (or the forward the instance
    had when marked) run as an island.

    An object, not a closure, so that ``copy.deepcopy`` and pickling of the module carry it over
    bound to the copy (a closure would keep calling the original module's forward)."""

    # A real (empty) ``__dict__``: torch.compile guards on ``forward.__dict__``, which the
    # forwarding ``__getattr__`` would otherwise answer with a fresh dict per lookup.
    __slots__ = ("module", "inner", "__weakref__", "__dict__")

    def __init__(self, module: torch.nn.Module, inner: Any) -> None:
        self.module = module
        #: The instance's own ``forward`` at marking time (None: the class's).
        self.inner = inner

    @property
    def info(self) -> IslandInfo:
        fn = self.inner if self.inner is not None else type(self.module).forward
        return describe_callable(fn, f"{type(self.module).__qualname__}.forward")

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The forward it runs: ``inspect.signature(module.forward)`` shows its parameters
        (model code inspects forward signatures)."""
        return self._target()

    def _target(self) -> Callable[..., Any]:
        if self.inner is not None:
            return self.inner
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runner = capture_runner()
        if runner is None:
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            # The class's function called on the module, not a method bound by hand: Dynamo
            # (torch.compile of a model holding a marked module) resolves ``forward.__get__``
            # on the instance, i.e. to this object again, and recursed without end.
            return type(self.module).forward(self.module, *args, **kwargs)
        return runner(self.info, self._target(), args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "inner"):  # unpickling: slots not set yet
            raise AttributeError(name)
        if name == MARK:
            return self.info
        return getattr(self._target(), name)  # __name__, __doc__, ... of the forward

    def __getstate__(self) -> tuple[Any, Any]:
        return self.module, self.inner

    def __setstate__(self, state: tuple[Any, Any]) -> None:
        self.module, self.inner = state


def _mark_module(module: torch.nn.Module) -> torch.nn.Module:
    current = module.__dict__.get("forward")
    if isinstance(current, _IslandForward):
        return module
    # The instance dict wins over the class's forward in nn.Module.__call__'s ``self.forward``.
    module.forward = _IslandForward(module, current)  # type: ignore[method-assign]
    return module
