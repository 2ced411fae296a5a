"""Collectives inside a recorder capture: what is recorded, what is refused, how it replays.

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
cheaply (:func:`first_replay_check`): one ``all_gather`` per process group of a hash of the
graph's collective sequence on that group; a mismatch raises
:class:`~accel_graph.errors.ReplayError` on every rank naming the rank and the op, instead of a
hang or a silent wrong result.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError, ReplayError
from .pool_protocol import PoolRef

#: Namespaces of the collective ops.
C10D = "c10d"
FUNCTIONAL = "_c10d_functional"
_NAMESPACES = frozenset({C10D, FUNCTIONAL, "c10d_functional"})

_P2P = ("point-to-point transfers differ between ranks (one sends, the other receives), so the "
        "ranks' recorded programs could not be checked against each other; keep send/recv "
        "outside the capture, or use a collective (all_to_all_single, broadcast)")
_ROOTED = ("its tensor lists differ between the root and the other ranks; use "
           "all_gather_into_tensor / broadcast / reduce_scatter_tensor, which capture")

#: Collective ops refused at capture, by ``namespace::name``, with the reason.
REFUSED_OPS: dict[str, str] = {
    "c10d::barrier": "a barrier synchronises the host with other ranks, which a device graph "
    "cannot replay; call dist.barrier() before capture or after replay",
    "c10d::monitored_barrier_": "a barrier synchronises the host with other ranks, which a "
    "device graph cannot replay; call it outside the capture",
    "c10d::check_for_nan": "it reads tensor values on the host (a sync); check after replay",
    "c10d::send": _P2P,
    "c10d::recv_": _P2P,
    "c10d::recv_any_source_": _P2P,
    "c10d::gather_": _ROOTED,
    "c10d::scatter_": _ROOTED,
    "_c10d_functional::isend": _P2P,
    "_c10d_functional::irecv": _P2P,
    "_c10d_functional::batch_p2p_ops": _P2P,
}

#: ``torch.distributed`` functions refused when a collective is issued from inside them
#: (found on the Python stack), with the reason.
_OBJECT = ("it pickles Python objects and sizes tensors from their values on the host, which a "
           "device graph cannot replay; exchange objects before capture, or exchange tensors")
REFUSED_CALLERS: dict[str, str] = {
    "all_gather_object": _OBJECT,
    "gather_object": _OBJECT,
    "broadcast_object_list": _OBJECT,
    "scatter_object_list": _OBJECT,
    "send_object_list": _OBJECT,
    "recv_object_list": _OBJECT,
    "barrier": REFUSED_OPS["c10d::barrier"],
    "monitored_barrier": REFUSED_OPS["c10d::barrier"],
    "new_group": "process groups must exist before capture (group creation talks to the "
    "store and other ranks on the host); create groups first, then capture",
    "new_subgroups": "process groups must exist before capture; create groups first",
    "new_subgroups_by_enumeration": "process groups must exist before capture; create groups first",
    "batch_isend_irecv": _P2P,
    "isend": _P2P,
    "irecv": _P2P,
    "send": _P2P,
    "recv": _P2P,
    "gather": _ROOTED,
    "scatter": _ROOTED,
}

#: Ops that pass their argument through at capture and record nothing.
_IDENTITY = frozenset({"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
                       "c10d_functional::wait_tensor"})

#: Roles of collective ops (:func:`role`).
IDENTITY, INPLACE, ISSUE = "identity", "inplace", "issue"

_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


@functools.lru_cache(maxsize=1024)
def is_collective(func: OpOverload) -> bool:
    """Whether ``func`` is a c10d or functional collective op (including ``wait_tensor``)."""
    return func.namespace in _NAMESPACES


def refusal(func: OpOverload) -> str | None:
    """Why capture refuses ``func`` (a collective op), or None."""
    return REFUSED_OPS.get(func._schema.name)


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


def refused_caller() -> tuple[str, str] | None:
    """``(function, reason)`` of a refused ``torch.distributed`` function on the Python stack
    (``all_gather_object``, ``barrier``, ``new_group``, ...), or None. Walked only when a
    collective op is captured, so its cost is paid per collective, never per op."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D_FILE) and code.co_name in REFUSED_CALLERS:
            found = code.co_name  # keep walking: the outermost one is what the user called
        frame = frame.f_back
    return None if found is None else (found, REFUSED_CALLERS[found])


# -- process groups -----------------------------------------------------------------------------
def _c10d() -> Any:
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
    group = group_of(func, args, kwargs)
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


# -- what a collective is, for the first-replay check -----------------------------------------
def _meta(x: Any) -> Any:
    if isinstance(x, PoolRef):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(str(_meta(y)) for y in x) + "]"
    if isinstance(x, torch.ScriptObject) or isinstance(x, torch._C._distributed_c10d.ProcessGroup):
        return None  # the group is named separately; reduce ops are opaque script objects
    return repr(x)


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


def _device_of(x: Any) -> torch.device | None:
    if isinstance(x, torch.Tensor):
        return x.device
    if isinstance(x, (list, tuple)):
        for y in x:
            d = _device_of(y)
            if d is not None:
                return d
    return None


class Signature:
    """The collectives of one graph, per process group in order of first use: what the first
    replay compares across ranks. ``entries`` holds ``(group, description)`` in capture order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[tuple[Any, str]] = []
        self.groups: dict[str, Any] = {}

    def add(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        if role(func) == IDENTITY:
            return
        group = group_of(func, args, kwargs)
        self.groups.setdefault(group.group_name, group)
        self.entries.append((group, describe(func, args, kwargs)))

    def __len__(self) -> int:
        return len(self.entries)

    def on(self, name: str) -> list[str]:
        """Descriptions of the collectives on group ``name``, in order."""
        return [d for g, d in self.entries if g.group_name == name]


def _hash64(items: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _collective_device(group: Any, fallback: torch.device) -> torch.device:
    """The device whose tensors ``group``'s backend takes (CPU for gloo)."""
    try:
        name = str(torch.distributed.get_backend(group)).lower()
    except Exception:
        return fallback
    return torch.device("cpu") if name in ("gloo", "mpi") else fallback


def first_replay_check(sig: Signature) -> None:
    """Check that every rank of each group the graph uses recorded the same collectives on it.

    One ``all_gather`` of ``(count, hash)`` per group (two int64 per rank); only on a mismatch
    the descriptions themselves are exchanged to name the rank and the op. Raises ReplayError;
    a rank that never joins the check makes it fail after the group's timeout, not hang.
    """
    dist = torch.distributed
    me = dist.get_rank()
    for name, group in sig.groups.items():
        mine = sig.on(name)
        device = _collective_device(group, sig.device)
        local = torch.tensor([len(mine), _hash64(mine)], dtype=torch.int64, device=device)
        size = dist.get_world_size(group)
        gathered = torch.empty(2 * size, dtype=torch.int64, device=device)
        try:
            dist.all_gather_into_tensor(gathered, local, group=group)
        except Exception as exc:
            raise ReplayError(
                f"rank {me}: the first replay's check that every rank of process group {name!r} "
                f"(size {size}) captured the same collectives failed before collective #0 "
                f"({mine[0]}): {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}. "
                f"A rank of the group did not replay a graph with collectives on this group (it "
                f"captured a different program, or replays graphs in another order), or the group "
                f"timed out. Every rank must capture the same collectives and replay the same "
                f"graphs in the same order."
            ) from exc
        rows = gathered.view(size, 2).tolist()
        if all(row == rows[0] for row in rows):
            continue
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        raise ReplayError(_mismatch_message(me, name, group, everyone))


def _mismatch_message(me: int, name: str, group: Any, everyone: list[list[str]]) -> str:
    """Which ranks' collective sequences on ``group`` differ from group rank 0's, at which op."""
    dist = torch.distributed
    ref = everyone[0]
    ref_rank = dist.get_global_rank(group, 0)
    lines = []
    for r, seq in enumerate(everyone):
        if seq == ref:
            continue
        rank = dist.get_global_rank(group, r)
        i = next((k for k, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq), len(ref)))
        theirs = seq[i] if i < len(seq) else "nothing (its graph ends there)"
        ours = ref[i] if i < len(ref) else "nothing (its graph ends there)"
        lines.append(f"rank {rank} records collective #{i} as {theirs}, but rank {ref_rank} "
                     f"records {ours}")
    return (
        f"rank {me}: the ranks of process group {name!r} captured different collectives, "
        f"detected at the first replay: {'; '.join(lines)}. Every rank must capture the same "
        f"collectives (same ops, shapes, dtypes, groups, order) and replay the same graphs in the "
        f"same order; recapture on every rank."
    )


# -- replay --------------------------------------------------------------------------------------
_F = None  # torch.ops._c10d_functional, bound on first use


def _functional_ops() -> Any:
    global _F
    if _F is None:
        _F = torch.ops._c10d_functional
    return _F


def _wait_all(x: Any, wait: Callable[[Any], Any]) -> None:
    if isinstance(x, torch.Tensor):
        wait(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _wait_all(y, wait)


def replay_fn(func: OpOverload, args: tuple, kwargs: dict, outputs: tuple, index: int,
              description: str) -> Callable[[], None]:
    """The replay of one recorded collective, with materialized arguments and outputs: issue
    it, wait for it, and (functional ops) leave the result in the captured outputs. A failure
    (a timeout, a broken group) raises ReplayError naming this rank, the op and its index."""
    f = _functional_ops()
    wait_tensor = f.wait_tensor.default
    r = role(func)
    name = func._schema.name
    op = func._op
    if r == INPLACE and func.namespace == C10D:
        def run() -> None:
            res = op(*args, **kwargs)
            (res[-1] if isinstance(res, tuple) else res).wait()
    elif r == INPLACE:
        def run() -> None:
            _wait_all(op(*args, **kwargs), wait_tensor)
    elif name == "_c10d_functional::all_reduce" and not kwargs:
        # In place on the captured output: no allocation, the same collective on the same data.
        out, (src, reduce_op, group) = outputs[0], args
        inplace, copy = f.all_reduce_.default._op, torch.ops.aten.copy_.default._op

        def run() -> None:
            copy(out, src)
            wait_tensor(inplace(out, reduce_op, group))
    elif name in ("_c10d_functional::all_gather_into_tensor",
                  "_c10d_functional::reduce_scatter_tensor") and not kwargs:
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


def signature_of(steps: list[Any], device: torch.device) -> Signature:
    """The :class:`Signature` of recorded steps (those of kind ``collective``)."""
    sig = Signature(device)
    for s in steps:
        if s.kind == "collective":
            sig.add(s.func, s.args, s.kwargs)
    return sig


def with_first_replay_check(run: Callable[[], None], sig: Signature) -> Callable[[], None]:
    """``run`` preceded, on its first call only, by :func:`first_replay_check`. A failed check
    is repeated on the next call (every rank fails it together)."""
    done = False

    def replay() -> None:
        nonlocal done
        if not done:
            first_replay_check(sig)
            done = True
        run()

    return replay


__all__ = [
    "IDENTITY", "INPLACE", "ISSUE", "REFUSED_CALLERS", "REFUSED_OPS", "Signature",
    "capture_result", "check_call", "completed_work", "describe", "first_replay_check",
    "group_of", "is_collective", "known_groups", "refusal", "refused_caller", "replay_fn",
    "role", "signature_of", "with_first_replay_check",
]
