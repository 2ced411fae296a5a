"""Collectives inside a recorder capture: what is recorded and how it replays (which ops are
collectives and which a capture refuses: :mod:`accel_graph.backends.capture_common.collective_rules`).

Two families of ops reach the dispatcher when user code communicates through
``torch.distributed``:

- the in-place c10d ops behind ``dist.all_reduce``, ``dist.all_gather_into_tensor``,
  ``dist.reduce_scatter_tensor``, ``dist.broadcast``, ``dist.all_to_all_single``, ... (namespace
  ``c10d``: ``allreduce_``, ``_allgather_base_``, ...). They take a ``ProcessGroup`` script object,
  mutate their first argument and return it with a ``Work`` handle (or only the handle);
- the functional collectives (namespace ``_c10d_functional``: ``all_reduce``,
  ``all_gather_into_tensor``, ..., their ``_coalesced``, in-place and ``_out`` forms) that return
  new tensors whose completion ``wait_tensor`` awaits.

At capture nothing is communicated. An in-place op is recorded as called and its ``Work`` is a
handle that is already complete (``work.wait()`` inside the capture is a no-op); a functional
op gets its outputs from the graph's pool like any functional op; ``wait_tensor`` and
``_wrap_tensor_autograd`` (the ``AsyncCollectiveTensor`` wrapper) return their argument and
record nothing. At replay every collective is issued in capture order and waited for at once,
before the next op runs: the program never leaves work in flight, so a graph's outputs are
complete when ``replay()`` returns.

Every rank must capture the same collectives in the same order and replay the same graphs in
the same order (the rule NCCL imposes on CUDA graphs). The first replay of a graph checks that
cheaply (:func:`.collective_check.first_replay_check`): one ``all_gather`` per process group of a hash of the
graph's collective sequence on that group; a mismatch raises
:class:`~accel_graph.errors.ReplayError` on every rank naming the rank and the op, instead of a
hang or a silent wrong result.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError
from ..capture_common.collective_rules import C10D, refused_caller
from .pool_protocol import PoolRef

#: Ops that pass their argument through at capture and record nothing.
_IDENTITY = frozenset({"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
                       "c10d_functional::wait_tensor"})

#: Roles of collective ops (:func:`role`).
IDENTITY, INPLACE, ISSUE = "identity", "inplace", "issue"


@functools.lru_cache(maxsize=1024)
def role(func: OpOverload) -> str:
    """How capture treats a collective op: ``identity`` (returns its argument, records nothing),
    ``inplace`` (recorded as called, mutates its arguments at replay: every c10d op and the
    functional in-place / ``_out`` forms) or ``issue`` (a functional collective: new outputs
    from the pool, filled at replay)."""
    name = func._schema.name
    if name in _IDENTITY:
        return IDENTITY
    if func.namespace == C10D or func._schema.is_mutable:
        return INPLACE
    return ISSUE


# -- process groups -----------------------------------------------------------------------------
def _c10d() -> Any:
    # On first use: builds without torch.distributed lack the module, and capture without
    # collectives never needs it.
    import torch.distributed.distributed_c10d as c10d

    return c10d


def known_groups() -> frozenset[str]:
    """Names of the process groups that exist now (empty when torch.distributed is not
    initialized). Capture notes them at begin: a group created during a capture is refused."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return frozenset()
    return frozenset(_c10d()._world.pg_names.values())


def group_of(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The Python ``ProcessGroup`` a collective op runs on (from its ``process_group`` script
    object or its ``group_name``)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("process_group", "group_name"):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            break
    else:  # pragma: no cover - every collective op names its group
        raise CaptureError(f"{func}: cannot tell which process group it runs on")
    dist_c10d = torch._C._distributed_c10d
    if isinstance(value, torch.ScriptObject):
        return dist_c10d.ProcessGroup.unbox(value)
    if isinstance(value, dist_c10d.ProcessGroup):
        return value
    return _c10d()._resolve_process_group(value)


def check_call(func: OpOverload, args: tuple, kwargs: dict, groups_at_begin: frozenset[str],
               where: str) -> None:
    """Refusals that depend on the call, not only on the op: a collective issued by an object
    collective, a barrier or group creation (found on the stack), and a collective on a process
    group created during the capture. Raises CaptureError naming the call and ``where``."""
    caller = refused_caller()
    if caller is not None:
        raise CaptureError(
            f"torch.distributed.{caller[0]} is not allowed during graph capture (called at "
            f"{where}, reached as {func}): {caller[1]}."
        )
    if role(func) == IDENTITY:
        return
    try:
        group = group_of(func, args, kwargs)
    except Exception as exc:  # a group name of no group, a destroyed group, no init
        raise CaptureError(
            f"{func} at {where}: its process group cannot be resolved ({exc}). Initialize "
            f"torch.distributed and create the group, on every rank, before capture."
        ) from exc
    if group.group_name not in groups_at_begin:
        raise CaptureError(
            f"{func} at {where} runs on process group {group.group_name!r}, which did not exist "
            f"when the capture began: process groups must be created (on every rank) before "
            f"capture, as on CUDA. Create the group first, then capture."
        )


# -- capture -----------------------------------------------------------------------------------
def completed_work() -> Any:
    """A ``Work`` handle (as the dispatcher returns it) that is already complete: what an
    in-place collective returns at capture, so ``work.wait()`` inside the capture is a no-op."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut).boxed()


def capture_result(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """What an in-place collective returns at capture: per its schema, the tensors it mutates
    (its first argument) and a completed ``Work``; a functional in-place op, its first argument."""
    first = args[0] if args else kwargs[func._schema.arguments[0].name]
    rets = []
    for ret in func._schema.returns:
        rets.append(completed_work() if isinstance(ret.type, torch.ClassType) else first)
    if not rets:
        return None
    return rets[0] if len(rets) == 1 else tuple(rets)


# -- what a collective is (the first-replay check compares these) ------------------------------
def _meta(x: Any) -> Any:
    if isinstance(x, PoolRef):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(str(_meta(y)) for y in x) + "]"
    if isinstance(x, torch.ScriptObject):
        return reduce_op_name(x)  # None for the group, which is named separately
    if isinstance(x, torch._C._distributed_c10d.ProcessGroup):
        return None
    return repr(x)


def reduce_op_name(x: Any) -> str | None:
    """``"SUM"``, ``"MAX"``, ... for a c10d ``ReduceOp`` script object (the form the dispatcher
    gives it in), else None."""
    try:
        if not str(x._type()).endswith(".ReduceOp"):
            return None
        return torch.distributed.ReduceOp.RedOpType(int(x.op())).name
    except Exception:  # an opaque object of another torch version: leave it out of descriptions
        return None


def describe(func: OpOverload, args: tuple, kwargs: dict) -> str:
    """A rank-independent description of one recorded collective: the op and its arguments'
    dtypes, shapes and values, without the group (named separately) or ``timeout``."""
    parts = []
    for i, a in enumerate(func._schema.arguments):
        if a.name in ("process_group", "group_name", "timeout", "async_op"):
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        shown = _meta(value)
        if shown is not None:
            parts.append(f"{a.name}={shown}")
    return f"{func._schema.name}({', '.join(parts)})"


def functional_ops() -> Any:
    """``torch.ops._c10d_functional`` (looked up on first use, not at import)."""
    return torch.ops._c10d_functional


def as_functional(func: OpOverload, args: tuple, kwargs: dict) -> tuple[Any, tuple, Any] | None:
    """``(op, args, tensor)``: the functional collective that computes what the c10d op ``func``
    writes with these (frozen or FX) arguments, and the tensor it writes, for compiled replay
    (which copies the waited result back into that tensor); None when there is none (several
    tensors, sparse, a reduction without a functional name)."""
    name = func._schema.name
    f = functional_ops()
    bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
             for i, a in enumerate(func._schema.arguments)}
    pg = bound.get("process_group")
    if not isinstance(pg, torch.ScriptObject):
        return None
    group_name = torch._C._distributed_c10d.ProcessGroup.unbox(pg).group_name
    if name == "c10d::allreduce_":
        tensors, op = bound["tensors"], reduce_op_name(bound["reduce_op"])
        if len(tensors) != 1 or bound.get("sparse_indices") is not None or op is None:
            return None
        if op.lower() not in ("sum", "avg", "product", "min", "max"):
            return None
        return f.all_reduce.default, (tensors[0], op.lower(), group_name), tensors[0]
    if name in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
        size = torch._C._distributed_c10d.ProcessGroup.unbox(pg).size()
        out, src = bound["output_tensor"], bound["input_tensor"]
        if name == "c10d::_allgather_base_":
            return f.all_gather_into_tensor.default, (src, size, group_name), out
        op = reduce_op_name(bound["reduce_op"])
        if op is None or op.lower() not in ("sum", "avg", "product", "min", "max"):
            return None
        return f.reduce_scatter_tensor.default, (src, op.lower(), size, group_name), out
    if name == "c10d::broadcast_":
        tensors = bound["tensors"]
        if len(tensors) != 1 or bound["root_tensor"] != 0:
            return None
        root = torch.distributed.get_global_rank(
            torch._C._distributed_c10d.ProcessGroup.unbox(pg), bound["root_rank"])
        return f.broadcast.default, (tensors[0], root, group_name), tensors[0]
    return None


__all__ = [
    "IDENTITY", "INPLACE", "ISSUE", "as_functional", "capture_result", "check_call",
    "completed_work", "describe", "functional_ops", "group_of", "known_groups", "reduce_op_name",
    "role",
]
