"""Baked host values: Python numbers a captured graph would freeze at their capture-time value.

A graph replays the arguments it recorded. When a function reads a Python number from mutable
state (``cache.get_seq_length()``, a step counter kept as an int) and passes it to an op (a
slice bound, a ``fill`` value, a size), the graph keeps the value it had at capture and replays
it forever: real CUDA graphs do the same, and nothing at capture can tell. Two recordings one
step apart can: an op whose non-tensor arguments changed between them reads host state.

:func:`find_baked_values` runs the function eagerly ``steps`` times under a dispatch mode that
logs each aten op with its non-tensor arguments and the user's source line, with an optional
``advance()`` between runs, and compares the logs op by op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from ..backends.capture_common import islands as island_marks
from ..backends.capture_common.control_flow import undo_dynamo_skip
from ..backends.capture_common.frames import user_frame
from ..errors import ConfigError

__all__ = ["BakedValue", "OpLog", "ProgramChange", "find_baked_values", "record_ops"]

_TENSOR = "<tensor>"


@dataclass(frozen=True)
class BakedValue:
    """One op whose Python arguments changed between two recordings of the same step."""

    op: str
    #: ``name=value`` per changed argument, first recording then later one.
    changes: tuple[tuple[str, Any, Any], ...]
    location: str
    #: Index of the op in the recording (its position in the program).
    index: int
    #: What the log's ``context`` said at the op in the later recording (None without one).
    context: Any = field(default=None, compare=False)

    @property
    def reason(self) -> str:
        parts = ", ".join(f"{name} was {a!r} then {b!r}" for name, a, b in self.changes)
        return (f"a Python value read at capture time changed between steps ({parts}); a graph "
                f"would replay the first value forever. Keep it in a tensor (e.g. a position "
                f"tensor input) or compute it from tensors on the device")


@dataclass(frozen=True)
class ProgramChange:
    """The op sequence itself differed between recordings (host-dependent control flow)."""

    index: int
    first: str
    later: str
    location: str
    #: What the log's ``context`` said at the op where the recordings part (None without one).
    context: Any = field(default=None, compare=False)

    @property
    def reason(self) -> str:
        return (f"the recorded program changed between steps at op {self.index} ({self.first} "
                f"then {self.later}): Python control flow depends on host state, so a graph "
                f"would replay the first step's path")


def _constants(func: Any, args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...]:
    """``(argument name, value)`` of the op's arguments with tensors replaced by a marker:
    what a graph would freeze."""
    out = []
    schema_args = func._schema.arguments
    for i, value in enumerate(args):
        name = schema_args[i].name if i < len(schema_args) else f"arg{i}"
        out.append((name, _frozen(value)))
    for name, value in kwargs.items():
        out.append((name, _frozen(value)))
    return tuple(out)


def _frozen(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _TENSOR
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(y) for y in x)
    if isinstance(x, torch.Generator):
        return "<generator>"
    if isinstance(x, torch.ScriptObject):
        # Handles (a profiler range's RecordFunction): an object, not a baked number, and one
        # torch gives no == for (it raises).
        return "<script object>"
    return x


def _same(a: Any, b: Any) -> bool:
    """Equal as a graph would see them (NaN equals NaN; nested tuples compared per item)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


class OpLog(TorchDispatchMode):
    """Logs every aten op with its non-tensor arguments and the user's source line.

    ``torch.cond`` / ``torch.while_loop`` are logged as one entry each (their name) and run
    whole without this log (modes below it, ``check_capturable``'s flagger, still see them): a graph reads their predicates at replay, so the branch taken may
    differ between steps without anything being baked. Ops inside their bodies are not
    compared (a limit of this check). Ops of an eager island (``accel_graph.eager_island``)
    are not logged: an island runs eagerly at every replay, so nothing in it is baked.

    ``context``: called at each op, its value logged with it (``check_capturable`` logs the
    module calls underway, to name the island for a baked value)."""

    #: Higher-order operators (cond, while_loop) arrive whole rather than failing in torch.
    supports_higher_order_operators = True

    def __init__(self, context: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[str, Any], ...], str, Any]] = []
        self.context = context

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        if island_marks.running():  # an eager island reads host state live at every replay
            return func(*args, **kwargs)
        ctx = self.context() if self.context is not None else None
        if isinstance(func, HigherOrderOperator):
            self.ops.append((func.name(), (), user_frame(), ctx))
            return func(*args, **kwargs)  # this mode is off here: modes below it still see it
        self.ops.append((str(func), _constants(func, args, kwargs), user_frame(), ctx))
        return func(*args, **kwargs)


def record_ops(fn: Callable[..., Any], args: tuple, kwargs: dict,
               context: Callable[[], Any] | None = None) -> tuple[list, Any]:
    """Run ``fn`` once eagerly under ``no_grad`` and return (its op log, its result);
    ``context`` as :class:`OpLog`'s."""
    log = OpLog(context)
    try:
        with torch.no_grad(), log:
            result = fn(*args, **kwargs)
    finally:
        # Eager torch.cond run under this mode leaves a TorchDynamo skip cached on its wrapper
        # (pytorch#163013): every later eager torch.cond of the process (a runner's warm-up)
        # then fails with Unsupported. Undo it, as the recorder and the runner's verify do.
        undo_dynamo_skip()
    return log.ops, result


def find_baked_values(fn: Callable[..., Any], args: tuple, kwargs: dict, *, steps: int,
                      advance: Callable[[], Any] | None = None,
                      first: tuple[list, Any] | None = None,
                      context: Callable[[], Any] | None = None) -> tuple[list[Any], Any]:
    """Run ``fn`` ``steps`` times (``advance()`` between runs) and return (what changed, the
    last result). What changed: a :class:`BakedValue` per op whose Python arguments differ from
    the first run's, or one :class:`ProgramChange` where the op sequences part. ``first``: the
    first run's (op log, result) when the caller made it already (under an :class:`OpLog`).
    ``context``: as :class:`OpLog`'s; each finding carries its value at the op (``context``).

    Each run is a real eager step: its side effects (a KV cache written, a counter advanced)
    are the point, since they are what moves the host state a graph would have frozen.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ConfigError(
            f"steps={steps!r}: the baked-value check compares recordings of at least 2 steps; "
            f"pass steps=2 (or more)"
        )
    if advance is not None and not callable(advance):
        raise ConfigError(f"advance must be a callable run between steps, got {type(advance).__name__}")
    first, result = first if first is not None else record_ops(fn, args, kwargs, context)
    found: list[Any] = []
    flagged: set[int] = set()
    for _ in range(steps - 1):
        if advance is not None:
            advance()
        later, result = record_ops(fn, args, kwargs, context)
        for i, (a, b) in enumerate(zip(first, later)):
            if a[0] != b[0]:
                found.append(ProgramChange(i, a[0], b[0], b[2], b[3]))
                return found, result
            if not _same(a[1], b[1]) and i not in flagged:
                flagged.add(i)
                changes = tuple((na, va, vb) for (na, va), (_, vb) in zip(a[1], b[1]) if not _same(va, vb))
                found.append(BakedValue(a[0], changes, b[2], i, b[3]))
        if len(first) != len(later):
            i = min(len(first), len(later))
            a_op = first[i][0] if i < len(first) else "<end>"
            b_op = later[i][0] if i < len(later) else "<end>"
            entry = later[i] if i < len(later) else first[i]
            found.append(ProgramChange(i, a_op, b_op, entry[2], entry[3]))
            return found, result
    return found, result
