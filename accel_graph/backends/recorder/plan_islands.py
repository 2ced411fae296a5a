"""Eager islands in a memory plan: their outputs sized on metadata, nothing run.

A real capture runs the piece before an island and the island itself eagerly
(:mod:`.islands`), then copies the island's outputs into static pool buffers. A memory plan runs
no kernels, so here:

- the piece before the island is not run (its steps are only counted as done);
- the island's code runs on metadata: every tensor argument of every aten op it calls is turned
  into a ``meta`` tensor of the same shape, strides and dtype (parameters and caches it holds
  included), and the op runs on the meta device. Host reads and data-dependent ops, which an
  island may use (that is why it is an island), get stand-in answers: ``.item()`` and
  ``bool(t)`` read 0 / False, ``nonzero`` / ``masked_select`` / ``unique`` / ``bincount`` return
  no rows, ``.tolist()`` a list of zeros. The island's outputs must have the same shape at every
  replay (replay checks it: a ``ReplayError`` otherwise), so a shape that its data decides is
  already refused; these answers only steer its Python control flow to *some* path, whose
  output shapes are those of every path;
- the outputs get static buffers from the plan's pool exactly as in capture (and the pool
  tensors alive at the island are pinned until the next island, as in capture), so the plan
  books the same memory;
- the island's own temporaries, allocated by its code at each replay on the device's general
  allocator, are not planned: the plan lists the island under ``unplanned``.

An island whose code cannot run on metadata at all (a Python read the stand-ins do not cover, a
custom kernel without a meta implementation) raises :class:`~accel_graph.errors.CaptureError`
naming the island and the failure.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...errors import CaptureError
from ..capture_common.dispatch_stack import lifted
from ..capture_common.frames import user_frame
from ..capture_common.islands import IslandInfo, Runner, running_island
from ..capture_common.pytree import tree_map
from . import validate
from .islands import IslandCapture, check_island_call

__all__ = ["make_plan_runner"]

_aten = torch.ops.aten


def _empty_rows(func: Any, args: tuple, kwargs: dict) -> Any:
    """The answer of a data-dependent op on no selected data (a stand-in: see the module)."""
    x = args[0] if args else next(iter(kwargs.values()))
    name = func.overloadpacket.__name__
    if name in ("nonzero", "argwhere"):
        return torch.empty((0, x.dim()), dtype=torch.int64, device="meta")
    if name == "masked_select":
        return torch.empty((0,), dtype=x.dtype, device="meta")
    if name == "bincount":
        return torch.empty((0,), dtype=torch.int64, device="meta")
    # the unique family: (values, inverse, counts) as the overload returns them
    values = torch.empty((0,), dtype=x.dtype, device="meta")
    n = len(func._schema.returns)
    rest = [torch.empty((0,), dtype=torch.int64, device="meta") for _ in range(n - 1)]
    return values if n == 1 else tuple([values, *rest])


_DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "bincount", "_unique",
                             "_unique2", "unique_dim", "unique_consecutive",
                             "unique_dim_consecutive"})


def _scalar_zero(t: torch.Tensor) -> Any:
    if t.dtype is torch.bool:
        return False
    return 0.0 if (t.dtype.is_floating_point or t.dtype.is_complex) else 0


class _OnMetadata(TorchDispatchMode):
    """Runs every aten op of an island on meta stand-ins of its tensors (see the module)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):
            return _scalar_zero(args[0])
        if name == "is_nonzero":
            return False
        if name in ("equal", "allclose"):
            return False
        if name in _DATA_DEPENDENT:
            return _empty_rows(func, args, kwargs)
        m_args = tree_map(_meta, args)
        m_kwargs = tree_map(_meta, kwargs)
        if "device" in m_kwargs:
            m_kwargs["device"] = "meta"
        return func(*m_args, **m_kwargs)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return validate.standin(x, "meta")
    return x


class _HostReads(TorchFunctionMode):
    """``.tolist()`` of a meta tensor (which torch cannot copy out): zeros of its shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and args and args[0].device.type == "meta":
            return _nested(args[0].shape, _scalar_zero(args[0]))
        return func(*args, **kwargs)


def _nested(shape: torch.Size, value: Any) -> Any:
    if not shape:
        return value
    return [_nested(shape[1:], value) for _ in range(shape[0])]


def make_plan_runner(cap: IslandCapture, unplanned: list[dict[str, str]]) -> Runner:
    """The island runner of a memory plan's capture ``cap``: each island is planned on metadata
    and noted in ``unplanned`` (its temporaries are not planned)."""
    ref = weakref.ref(cap)

    def run(info: IslandInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        c = ref()
        if c is None or c.over is not None:
            return fn(*args, **kwargs)
        with c.lock:
            try:
                out = _plan_island(c, info, fn, args, kwargs)
            except CaptureError as exc:
                c.invalidate(f"eager island {info.name}", exc)
                raise
        entry = {"island": str(info), "reason": (
            "eager island: its outputs are planned (static buffers in the graph pool); the "
            "temporaries its own code allocates at each replay come from the device's general "
            "allocator, outside the pool, and depend on the data, so they are not planned")}
        if entry not in unplanned:
            unplanned.append(entry)
        return out

    return run


def _plan_island(cap: IslandCapture, info: IslandInfo, fn: Callable[..., Any], args: tuple,
                 kwargs: dict) -> Any:
    where = user_frame()
    check_island_call(cap, info, where, f"a memory plan on {cap.device}")
    cap.sync_flags()
    cap.ran_to = len(cap.steps)  # the piece before is not run: a plan computes nothing
    cap.island_pins = []
    cap.island_pins = cap.alive_tensors()  # as capture pins them (same pool reuse)
    try:
        with lifted(cap.mode), running_island(), _HostReads(), _OnMetadata():
            out = fn(*args, **kwargs)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"eager island {info} (called at {where}) could not be planned: its code failed on "
            f"metadata ({type(exc).__name__}: {exc}). plan_memory runs islands on meta tensors "
            f"to size their outputs; capture() and memory_report() measure them instead") from exc
    leaves, spec = pytree.tree_flatten(out)
    with _disable_current_modes(), torch.no_grad():
        buffers: list[torch.Tensor] = []
        slots: list[int | None] = []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                slots.append(None)
                continue
            stride = torch.empty_like(x, device="meta").stride()  # dense layouts, as capture
            buffers.append(cap.allocate_output(x.shape, stride, x.dtype, cap.device))
            slots.append(len(buffers) - 1)
    cap.island_buffers.extend(buffers)
    return pytree.tree_unflatten(
        [x if s is None else buffers[s] for x, s in zip(leaves, slots)], spec)
