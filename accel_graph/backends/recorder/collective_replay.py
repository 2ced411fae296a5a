"""Replay of one recorded collective: issue it on its group, wait for it, fill the outputs.

The common collectives are issued through the ``ProcessGroup`` methods that
``torch.distributed`` itself calls (``pg.allreduce(tensors, opts)``, ``pg._allgather_base``,
...): they reach the same c10d dispatcher op from C++, so the collective is identical, but a
boxed call of the c10d op from Python converts its script-object arguments on every call
(measured on gloo, one rank, 1x256 fp32: 60 us a call against 17 us through the method, and
``dist.all_reduce`` itself 26 us). Everything else replays through the recorded op.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import ReplayError
from .collectives import C10D, INPLACE, ISSUE, functional_ops, group_of, reduce_op_name, role

__all__ = ["allocates", "replay_fn"]

#: Functional collectives replayed in place on their captured output (after a copy of the input).
_IN_PLACE_TWIN = {"_c10d_functional::all_reduce": "all_reduce_",
                  "_c10d_functional::broadcast": "broadcast_"}
#: Functional collectives replayed through their ``_out`` form into the captured output.
_OUT_FORM = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor")
#: Reductions a functional collective names by string, as c10d ``ReduceOp`` names.
_REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def allocates(func: OpOverload) -> bool:
    """Whether replay of this collective allocates (a functional collective with neither an
    in-place twin nor an ``_out`` form: computed, then copied into the captured outputs)."""
    name = func._schema.name
    return role(func) == ISSUE and name not in _IN_PLACE_TWIN and name not in _OUT_FORM


def _wait_all(x: Any, wait: Callable[[Any], Any]) -> None:
    if isinstance(x, torch.Tensor):
        wait(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _wait_all(y, wait)


def _bound(func: OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    return {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
            for i, a in enumerate(func._schema.arguments)}


def _reduce_op(value: Any) -> Any:
    """The Python ``ReduceOp`` of a c10d reduce-op script object or a functional reduction
    string; None when it cannot be rebuilt (PREMUL_SUM carries a factor)."""
    name = value.upper() if isinstance(value, str) else reduce_op_name(value)
    if name not in _REDUCTIONS:
        return None
    return getattr(torch.distributed.ReduceOp, name)


def _options(cls: Any, bound: dict[str, Any], **fields: Any) -> Any:
    opts = cls()
    for k, v in fields.items():
        setattr(opts, k, v)
    if isinstance(bound.get("async_op"), bool):
        opts.asyncOp = bound["async_op"]
    timeout = bound.get("timeout")
    if isinstance(timeout, int) and timeout >= 0:
        opts.timeout = timedelta(milliseconds=timeout)
    return opts


def _direct(func: OpOverload, args: tuple, kwargs: dict, outputs: tuple) -> Callable[[], None] | None:
    """The collective as the ``ProcessGroup`` method call ``torch.distributed`` makes, or None
    when there is none here (the recorded op replays then)."""
    c = torch._C._distributed_c10d
    name = func._schema.name
    b = _bound(func, args, kwargs)
    pg = group_of(func, args, kwargs)
    copy = torch.ops.aten.copy_.default._op
    if name == "c10d::allreduce_" and b["sparse_indices"] is None:
        red = _reduce_op(b["reduce_op"])
        if red is None:
            return None
        tensors, opts = b["tensors"], _options(c.AllreduceOptions, b, reduceOp=red)
        return lambda: pg.allreduce(tensors, opts).wait()
    if name == "c10d::broadcast_":
        tensors = b["tensors"]
        opts = _options(c.BroadcastOptions, b, rootRank=b["root_rank"], rootTensor=b["root_tensor"])
        return lambda: pg.broadcast(tensors, opts).wait()
    if name == "c10d::_allgather_base_":
        out, src, opts = b["output_tensor"], b["input_tensor"], _options(c.AllgatherOptions, b)
        return lambda: pg._allgather_base(out, src, opts).wait()
    if name == "c10d::_reduce_scatter_base_":
        red = _reduce_op(b["reduce_op"])
        if red is None:
            return None
        out, src = b["output_tensor"], b["input_tensor"]
        opts = _options(c.ReduceScatterOptions, b, reduceOp=red)
        return lambda: pg._reduce_scatter_base(out, src, opts).wait()
    if name == "c10d::alltoall_base_":
        out, src, opts = b["output"], b["input"], _options(c.AllToAllOptions, b)
        osplit, isplit = list(b["output_split_sizes"]), list(b["input_split_sizes"])
        return lambda: pg.alltoall_base(out, src, osplit, isplit, opts).wait()
    if name == "_c10d_functional::all_reduce" and not kwargs:
        red = _reduce_op(b["reduce_op"])
        if red is None:
            return None
        out, src, opts = outputs[0], b["input"], _options(c.AllreduceOptions, b, reduceOp=red)
        dst = [out]

        def run() -> None:
            copy(out, src)
            pg.allreduce(dst, opts).wait()

        return run
    if name == "_c10d_functional::all_gather_into_tensor" and not kwargs:
        out, src, opts = outputs[0], b["input"], _options(c.AllgatherOptions, b)
        return lambda: pg._allgather_base(out, src, opts).wait()
    if name == "_c10d_functional::reduce_scatter_tensor" and not kwargs:
        red = _reduce_op(b["reduce_op"])
        if red is None:
            return None
        out, src = outputs[0], b["input"]
        opts = _options(c.ReduceScatterOptions, b, reduceOp=red)
        return lambda: pg._reduce_scatter_base(out, src, opts).wait()
    return None


def _recorded(func: OpOverload, args: tuple, kwargs: dict, outputs: tuple) -> Callable[[], None]:
    """The collective through the recorded op (boxed), waited for."""
    f = functional_ops()
    wait_tensor = f.wait_tensor.default._op
    name = func._schema.name
    op = func._op
    if role(func) == INPLACE and func.namespace == C10D:
        def run() -> None:
            res = op(*args, **kwargs)
            (res[-1] if isinstance(res, tuple) else res).wait()
    elif role(func) == INPLACE:
        def run() -> None:
            _wait_all(op(*args, **kwargs), wait_tensor)
    elif name in _IN_PLACE_TWIN and not kwargs and len(args) == 3:
        # In place on the captured output: no allocation, the same collective on the same data.
        out, (src, arg, group) = outputs[0], args
        inplace = getattr(f, _IN_PLACE_TWIN[name]).default._op
        copy = torch.ops.aten.copy_.default._op

        def run() -> None:
            copy(out, src)
            wait_tensor(inplace(out, arg, group))
    elif name in _OUT_FORM and not kwargs:
        out_op = (f.all_gather_into_tensor_out if "gather" in name else f.reduce_scatter_tensor_out)
        out_op = out_op.default._op
        out = outputs[0]

        def run() -> None:
            wait_tensor(out_op(*args, out=out))
    else:
        copy = torch.ops.aten.copy_.default._op

        def run() -> None:
            res = op(*args, **kwargs)
            flat = [res] if isinstance(res, torch.Tensor) else list(res)
            for out, value in zip(outputs, flat):
                copy(out, wait_tensor(value))
    return run


def replay_fn(func: OpOverload, args: tuple, kwargs: dict, outputs: tuple, index: int,
              description: str) -> Callable[[], None]:
    """The replay of one recorded collective, with materialized arguments and outputs: issue
    it, wait for it, and (functional ops) leave the result in the captured outputs. A failure
    (a timeout, a broken group) raises ReplayError naming this rank, the op and its index."""
    run = _direct(func, args, kwargs, outputs) or _recorded(func, args, kwargs, outputs)

    def guarded() -> None:
        try:
            run()
        except Exception as exc:
            raise ReplayError(_failure_message(index, description, exc)) from exc

    return guarded


def _failure_message(index: int, description: str, exc: BaseException) -> str:
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return (
        f"rank {rank}: collective #{index} of the graph, {description}, failed at replay: "
        f"{first}. A timeout means another rank did not issue the same collective (every rank "
        f"must replay the same graphs in the same order); the process group may be unusable "
        f"after a failure, destroy and recreate it."
    )
