"""Replay: the recorded steps turned into one straight-line Python function.

Every operation becomes a direct call of a pre-bound aten kernel with pre-bound arguments (no
loop, no tuple unpacking, no dispatch mode), preceded by a cheap check that each input still
has the storage, shape and stride it had at capture. Functional ops write into their captured
outputs through ``.out`` overloads, fills, in-place random draws or ``copy_``; only ops without
any such form allocate (and the debug dump says which).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...errors import ReplayError
from ..capture_common.island_outputs import IslandCall
from . import collective_replay, collectives
from .pool_protocol import GraphPool, PoolRef
from .steps import InputRecord, Step

aten = torch.ops.aten

_ZERO = aten.zero_.default._op
_FILL = aten.fill_.Scalar._op
_COPY = aten.copy_.default._op
_RANDOM = {
    "normal_": aten.normal_.default._op,
    "uniform_": aten.uniform_.default._op,
    "random_": getattr(aten.random_, "from")._op,
}


_CODE_CACHE: dict[str, Any] = {}


class _Emitter:
    """Collects generated source lines and the objects they refer to by name."""

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {}
        self.lines: list[str] = []
        self._n = 0
        #: Collectives emitted so far (their index in error messages).
        self.collectives = 0

    def bind(self, obj: Any) -> str:
        name = f"v{self._n}"
        self._n += 1
        self.ns[name] = obj
        return name

    def call(self, fn: Any, args: tuple, kwargs: dict, target: str | None = None) -> str:
        parts = [self.bind(a) for a in args]
        parts += [f"{k}={self.bind(v)}" for k, v in kwargs.items()]
        expr = f"{self.bind(fn)}({', '.join(parts)})"
        self.lines.append(f"    {target} = {expr}" if target else f"    {expr}")
        return expr


def replayed(steps: list[Step]) -> int:
    """Number of steps interpreted replay actually runs (views run only at capture); a
    control-flow step counts as one plus the steps of its sub-programs."""
    n = 0
    for s in steps:
        if s.kind in CONTROL_KINDS:
            n += 1 + sum(replayed(sub) for sub in s.extra[1:])
        elif s.kind not in ("view", "none"):
            n += 1
    return n


#: Step kinds whose ``extra`` is ``(predicate, sub-program, sub-program)`` (control_flow.py).
CONTROL_KINDS = ("cond", "while")


def allocates_at_replay(step: Step) -> bool:
    return step.kind == "compute" or (step.kind == "collective" and collective_replay.allocates(step.func))


def materialize(steps: list[Step], pool: GraphPool) -> list[Step]:
    """``steps`` with every pool location turned into a tensor over the pool's memory."""
    return _materialized_steps(steps, pool, {})


def _materialized_steps(steps: list[Step], pool: GraphPool, cache: dict[PoolRef, torch.Tensor]) -> list[Step]:
    # Steps that replay runs nothing for (views, empty factories) need no tensors.
    out = []
    for s in steps:
        if s.kind in ("view", "none"):
            continue
        if s.kind in CONTROL_KINDS:
            pred, *subs = s.extra
            extra = (_materialized(pred, pool, cache), *[_materialized_steps(x, pool, cache) for x in subs])
        else:
            extra = _materialized(s.extra, pool, cache)
        out.append(Step(s.func, s.kind, _materialized(s.args, pool, cache),
                        _materialized(s.kwargs, pool, cache) if s.kwargs else {},
                        tuple([_materialized(o, pool, cache) for o in s.outputs]), s.strategy,
                        extra, s.positions, s.grad))
    return out


def _materialized(x: Any, pool: GraphPool, cache: dict[PoolRef, torch.Tensor]) -> Any:
    """``x`` with pool locations as tensors, one per distinct location (module level: a nested
    recursive function would be a reference cycle, freed only by the cyclic collector)."""
    if x.__class__ is PoolRef:
        t = cache.get(x)
        if t is None:
            t = cache[x] = pool.materialize(x)
        return t
    if isinstance(x, tuple):
        return tuple([_materialized(y, pool, cache) for y in x])
    if isinstance(x, list):
        return [_materialized(y, pool, cache) for y in x]
    if isinstance(x, dict):
        return {k: _materialized(v, pool, cache) for k, v in x.items()}
    return x


def build_replay(steps: list[Step], inputs: list[InputRecord]) -> Callable[[], None]:
    """Compile materialized ``steps`` into a function that replays them (module docstring)."""
    em = _Emitter()
    em.ns["_stale"] = _stale_raiser(inputs)
    for i, rec in enumerate(inputs):
        x = em.bind(rec.tensor)
        shape, stride = em.bind(rec.shape), em.bind(rec.stride)
        ptr = em.bind(rec.data_ptr)
        em.lines.append(
            f"    if {x}.data_ptr() != {ptr} or {x}.shape != {shape} "
            f"or {x}.stride() != {stride}: _stale({i})"
        )
    for step in steps:
        _emit_step(em, step)
    body = "\n".join(em.lines) or "    pass"
    src = f"def replay():\n{body}\n"
    # Every value is a bound name, so programs of the same shape share one source text and
    # one code object (repeated captures, buckets) instead of compiling and interning anew.
    code = _CODE_CACHE.get(src)
    if code is None:
        if len(_CODE_CACHE) >= 512:
            _CODE_CACHE.clear()
        code = _CODE_CACHE[src] = compile(src, "<accel_graph recorder replay>", "exec")
    exec(code, em.ns)  # the namespace holds only objects bound above; no user text is compiled
    # pop: the function's globals are ns, so leaving it there would make a reference cycle
    # that only the cyclic GC frees (graphs must go away by reference counting alone).
    fn = em.ns.pop("replay")
    fn.__accel_graph_source__ = src
    return fn


def _emit_step(em: _Emitter, step: Step) -> None:
    if step.grad:
        # Replay runs under inference mode; this kernel's outputs depend on grad mode, which
        # was on at capture (mkldnn_rnn_layer's workspace): run it with grad mode on.
        em.lines.append(f"    with {em.bind(torch.enable_grad)}():")
        start = len(em.lines)
        _emit_call(em, step)
        em.lines[start:] = ["    " + line for line in em.lines[start:]]
        return
    _emit_call(em, step)


def _emit_call(em: _Emitter, step: Step) -> None:
    kind = step.kind
    if kind == "mutate":
        em.call(step.func._op, step.args, step.kwargs)
    elif kind == "out":
        strategy = step.strategy
        assert strategy is not None and strategy.op is not None
        kwargs = dict(step.kwargs)
        names = strategy.out_names
        if len(names) == 1:
            kwargs[names[0]] = step.outputs[0] if len(step.outputs) == 1 else list(step.outputs)
        else:
            kwargs.update(zip(names, step.outputs))
        args = step.extra if step.extra is not None else step.args  # numbers pre-wrapped
        em.call(strategy.op._op, args, kwargs)
    elif kind == "fill":
        for out in step.outputs:
            # zero_() only for a true zero: fill_(-0.0) keeps the sign, as eager's full() does.
            if _is_zero(step.extra):
                em.call(_ZERO, (out,), {})
            else:
                em.call(_FILL, (out, step.extra), {})
    elif kind == "random":
        method, args, kwargs = step.extra
        for out in step.outputs:
            em.call(_RANDOM[method], (out, *args), kwargs)
    elif kind == "copy":
        em.call(_COPY, (step.outputs[0], step.extra), {})
    elif kind == "compute":
        em.call(step.func._op, step.args, step.kwargs, target="r")
        returns = step.func._schema.returns
        if len(step.outputs) == 1 and len(returns) == 1 and not isinstance(returns[0].type, torch.ListType):
            em.lines.append(f"    {em.bind(_COPY)}({em.bind(step.outputs[0])}, r)")
        else:
            em.lines.append("    r = [x for x in (r if isinstance(r, (list, tuple)) else (r,)) "
                            "if isinstance(x, _Tensor)]")
            em.ns["_Tensor"] = torch.Tensor
            for i, out in enumerate(step.outputs):
                em.lines.append(f"    {em.bind(_COPY)}({em.bind(out)}, r[{i}])")
    elif kind == "cond":
        pred, true_steps, false_steps = step.extra
        em.call(_run_cond, (pred, build_replay(true_steps, []), build_replay(false_steps, [])), {})
    elif kind == "while":
        pred, cond_steps, body_steps = step.extra
        em.call(_run_while, (pred, build_replay(cond_steps, []), build_replay(body_steps, [])), {})
    elif kind == "host":  # a Python call: generator state (rng.HostCall), an eager island
        # An island's host step writes static outputs (islands.IslandCall): passed last.
        # (An island with no tensor outputs gets an empty tuple: a generator call gets none.)
        island = isinstance(step.extra, IslandCall)
        em.call(step.extra, (*step.args, step.outputs) if step.outputs or island else step.args, {})
    elif kind == "collective":
        fn = collective_replay.replay_fn(step.func, step.args, step.kwargs, step.outputs,
                                         em.collectives,
                                         collectives.describe(step.func, step.args, step.kwargs))
        em.collectives += 1
        em.call(fn, (), {})
    elif kind in ("none", "view"):
        return  # nothing runs: contents undefined (empty), or an alias made at capture (view)
    else:  # pragma: no cover - a kind added to ops.Strategy must be handled here
        raise AssertionError(f"unknown step kind {kind}")


def _run_cond(pred: torch.Tensor, if_true: Callable[[], None], if_false: Callable[[], None]) -> None:
    """torch.cond at replay: the predicate is read now, from the tensor the program wrote."""
    if pred.item():
        if_true()
    else:
        if_false()


def _run_while(pred: torch.Tensor, cond: Callable[[], None], body: Callable[[], None]) -> None:
    """torch.while_loop at replay: run ``cond``'s program, read its predicate, run the body
    (which copies its results into the carry buffers), until the predicate is false."""
    cond()
    while pred.item():
        body()
        cond()


def _is_zero(value: Any) -> bool:
    """Whether ``value`` is a Python 0 or +0.0 (not -0.0, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0:
        return False
    return math.copysign(1.0, value) > 0


def _stale_raiser(inputs: list[InputRecord]) -> Callable[[int], None]:
    def stale(i: int) -> None:
        rec = inputs[i]
        t = rec.tensor
        raise ReplayError(
            f"input {i} of the graph ({rec.name or 'a tensor captured by reference'}, captured with "
            f"shape {tuple(rec.shape)}, stride {rec.stride}, data_ptr {rec.data_ptr:#x}) now has "
            f"shape {tuple(t.shape)}, stride {t.stride()}, data_ptr {t.data_ptr():#x}: it was "
            f"resized or re-pointed after capture, so replay would read or write stale memory. "
            f"Copy new data into the captured tensor with .copy_() instead of replacing or "
            f"resizing it, or reset() and capture again."
        )

    return stale
