"""Eager islands in a recorder capture (``accel_graph.eager_island``): capture and replay.

An island ends the piece recorded so far. At capture, inside the capturing thread:

1. the steps recorded since the last island run once, as replay would run them (capture
   computes nothing, so this is what gives the island real values: a warm-up of that piece;
   its in-place writes to captured tensors and its random draws happen now, as in a warm-up);
2. the island runs eagerly, with the recording mode lifted off the dispatch stack and the
   capture's interceptions (host reads, generator state) letting it through: ``.item()``,
   ``nonzero`` and Python ``if`` on values work there;
3. its tensor outputs are copied into static buffers allocated in the graph's pool (shape,
   dtype, device and layout fixed now), and the caller gets those buffers, in the structure
   the island returned; capture goes on with them standing for the outputs;
4. a host step (:class:`IslandCall`) is recorded: at each replay it calls the island with the
   live values (pool tensors and tensors captured by reference, as they are at that point of
   the program), under the grad, inference and autocast modes of the capture, checks its
   outputs against the buffers and copies them in.

At replay a host step is a Python call between kernels, so interpreted replay runs piece,
island, piece, ... in order; compiled replay compiles each stretch between host steps
(:mod:`.compiled.segmented`). An island output of another shape, dtype, device or structure
raises :class:`~accel_graph.errors.ReplayError` naming the island before anything is copied,
so nothing after it runs and the graph stays usable.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import CaptureError
from ..capture_common.dispatch_stack import lifted
from ..capture_common.frames import user_frame
from ..capture_common.island_outputs import (
    IslandCall,
    autocast_state,
    awaited,
    check_argument_devices,
    check_outputs,
    held_storages,
)
from ..capture_common.islands import IslandInfo, Runner, check_not_refused, running_island
from . import ops as opinfo
from .program import build_replay, materialize
from .rng import HostCall
from .steps import Step

__all__ = ["IslandCall", "is_island_step", "make_runner"]

_WHY = ("eager island: runs eagerly at this point of each replay on the live values; its "
        "outputs are copied into the static buffers the rest of the graph reads")


class IslandCapture(Protocol):
    """What an island needs of a capture (:class:`~.capture.Capture`; typed by its surface so
    :mod:`.capture`, which installs the runner, and this module do not import each other)."""

    mode: Any
    over: str | None
    lock: Any
    device: torch.device
    pool: Any
    steps: list[Step]
    #: The capture's top-level step list (``steps`` is swapped for a cond branch's own).
    top_steps: list[Step]
    #: How many of ``top_steps`` have run (at the islands so far).
    ran_to: int
    #: Static output buffers held until the capture stops (no reuse of their memory in it).
    island_buffers: list[torch.Tensor]
    #: Pool tensors alive at the last island, held until the next one (or the capture stops).
    island_pins: list[torch.Tensor]

    def invalidate(self, func: Any, exc: BaseException) -> None: ...

    def sync_flags(self) -> None: ...

    def allocate_output(self, shape: Any, stride: Any, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor: ...

    def frozen_arg(self, x: Any) -> Any: ...

    def alive_tensors(self) -> list[torch.Tensor]: ...

    def freeze(self, x: Any) -> Any: ...


def is_island_step(step: Step) -> bool:
    """Whether ``step`` is an eager island's host step (its effects are the island's own:
    anything it writes is unknown to the program, unlike an aten op's schema)."""
    return step.kind == "host" and isinstance(step.extra, IslandCall)


def make_runner(cap: IslandCapture) -> Runner:
    """The island runner of ``cap`` (held weakly: an island called after the capture is gone,
    or over, is a plain call, as every op then runs eagerly)."""
    ref = weakref.ref(cap)

    def run(info: IslandInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        c = ref()
        if c is None or c.over is not None:
            return fn(*args, **kwargs)
        with c.lock:
            if c.over is not None:  # ended from another thread (relaxed) meanwhile
                return fn(*args, **kwargs)
            try:
                return _capture_island(c, info, fn, args, kwargs)
            except CaptureError as exc:
                c.invalidate(f"eager island {info.name}", exc)  # the capture is over, as at an op
                raise

    return run


def check_island_call(cap: IslandCapture, info: IslandInfo, where: str, during: str) -> None:
    """Refuse an island call the recorder cannot honour ``during`` a capture or a memory plan
    (``CaptureError``): islands refused on this thread, or a call inside a cond branch or
    while_loop body."""
    check_not_refused(info, where, during)
    if cap.steps is not cap.top_steps:
        raise CaptureError(
            f"eager island {info} called inside a torch.cond branch or a torch.while_loop body "
            f"during {during} (at {where}): a branch or body is recorded whole, without "
            f"running, and replay picks it on values the capture never sees, so there are no "
            f"real values to run the island on. Call the island outside the cond/while_loop "
            f"(an island may branch on values in Python itself)")


def _capture_island(cap: IslandCapture, info: IslandInfo, fn: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
    where = user_frame()
    check_island_call(cap, info, where, f"a capture on {cap.device}")
    check_argument_devices(info, (args, kwargs), where, cap.device)
    cap.sync_flags()  # settings changed since the last op belong to the piece before the island
    _run_piece(cap)
    # Hold every pool tensor alive here until the next island: one that dies in the stretch
    # after this island would otherwise have its memory reused there by a tensor that stretch
    # writes, while the stretch also reads the dead one's value. A compiled stretch cannot
    # alias its inputs and outputs (static shapes in AOT), so segmented.py replays such a
    # stretch interpreted; held, every stretch compiles. What dies in the stretch becomes
    # reusable at the next island (the following stretches cannot read it), so the pool
    # grows by at most one stretch's dead tensors.
    cap.island_pins = []  # the last island's first: what died since must not count as alive
    cap.island_pins = cap.alive_tensors()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = autocast_state(cap.device.type)
    with lifted(cap.mode), running_island():
        out = fn(*args, **kwargs)
    leaves, spec = pytree.tree_flatten(out)
    leaves = [awaited(x) for x in leaves]
    check_outputs(info, leaves, (args, kwargs), where, cap.device, grad and not inference,
                  cap.pool.owns, held_storages(fn))
    # Not under inference mode: pool tensors made there would be inference tensors (the pool
    # caches the tensors it makes views of), which compiled replay and users cannot write.
    with _disable_current_modes(), torch.no_grad():
        buffers = []
        slots: list[int | None] = []
        for x in leaves:
            if x is None:
                slots.append(None)
                continue
            stride = torch.empty_like(x, device="meta").stride()  # dense layouts kept, as empty_like
            buf = cap.allocate_output(x.shape, stride, x.dtype, x.device)
            buf.copy_(x)
            slots.append(len(buffers))
            buffers.append(buf)
    cap.island_buffers.extend(buffers)
    call = IslandCall(info, fn, spec, tuple(slots), grad, inference, where, autocast)
    fargs = cap.frozen_arg(args)
    fkwargs = cap.frozen_arg(kwargs)
    out_refs = tuple([cap.freeze(b) for b in buffers])
    cap.steps.append(Step(HostCall(f"eager_island {info}", call, (fargs, fkwargs), _WHY), "host",
                          (fargs, fkwargs), {}, out_refs, opinfo.Strategy("host", why=_WHY), call))
    cap.ran_to = len(cap.steps)
    result = pytree.tree_unflatten([None if s is None else buffers[s] for s in slots], spec)
    del leaves, out
    return result


def _run_piece(cap: IslandCapture) -> None:
    """Run the steps recorded since the last island once, as replay runs them, so the island
    sees real values (the recording mode and every other mode off, as at replay)."""
    piece = cap.steps[cap.ran_to:]
    cap.ran_to = len(cap.steps)
    if not any(s.kind not in ("view", "none") for s in piece):
        return
    with _disable_current_modes():
        # Materialized outside inference mode (the pool caches the tensors it makes views of:
        # inference tensors there could not be written outside it later); run as replay runs.
        run = build_replay(materialize(piece, cap.pool), [])
        with torch.inference_mode():
            run()
