"""``GraphRunner.plan_memory()``: the memory the runner's graphs will take, known before capture.

The plan walks the ladder as :func:`~accel_graph.runner.capture.capture_buckets` would (largest
bucket first, one shared pool, each bucket's outputs kept, ``share_outputs`` copied into the
first bucket's outputs) but records each bucket on metadata through the recorder's planning
machinery (``accel_graph.backends.memory_planner``): nothing is captured, no kernel runs, no
device memory is taken, and the runner's state (static inputs, pool, buckets) is untouched. Every
allocation the capture would make is booked, as it is made, on a fresh allocator engine under
the target device's rules (:func:`~accel_graph.graphs.memory_plan.plan_settings`), so the figures are the allocator's: segment
sizes, rounding, reuse of memory that died within the pool, expandable segments when set.

The warm-up's peak is predicted from the same allocation sequences on an ordinary (non-pool)
engine (:meth:`MemoryPlanner.warmup_peak`). Eager islands' outputs are planned; their own
temporaries are listed under ``unplanned``.

Schema ``accel_graph.runner.memory-plan/1`` (docs/runner.md "Memory plan").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends import memory_planner
from ..errors import ConfigError
from ..foundation.gc_pause import ImportCycles, gc_paused
from ..graphs.memory_plan import distinct_pool_bytes, plan_settings
from .runtime import RunnerRuntime
from .state import state_tensors
from .support import broadcast_outputs

__all__ = ["PLAN_SCHEMA", "plan_runner", "plan_shared_pool", "plan_steps"]

PLAN_SCHEMA = "accel_graph.runner.memory-plan/1"


def plan_steps(planner: Any, steps: list[tuple[str, Callable[[], Any], Callable[[Any], Any] | None]],
               ) -> list[dict[str, Any]]:
    """Plan ``steps`` in order into ``planner``'s pool: ``(label, call, keep)`` where ``call()``
    runs the step and ``keep(outputs)`` returns what stays alive after it (None: everything).
    Returns one row per step with ``incremental_bytes``, ``standalone_bytes``,
    ``pool_after_bytes`` and ``output_bytes``; kept outputs stay alive in ``planner.kept``."""
    rows = []
    kept: list[Any] = getattr(planner, "kept", [])
    planner.kept = kept
    cycles = ImportCycles()
    for label, call, keep in steps:
        cp = planner.plan(lambda c=call: c(), (), {})
        outs = cp.outputs if keep is None else keep(cp.outputs)
        leaves = [x for x in pytree.tree_leaves(cp.outputs) if isinstance(x, torch.Tensor)]
        rows.append({"label": label, "incremental_bytes": cp.incremental_bytes,
                     "standalone_bytes": cp.standalone_bytes,
                     "pool_after_bytes": cp.reserved_after_bytes,
                     "output_bytes": sum(x.numel() * x.element_size() for x in leaves)})
        cp.outputs = None
        kept.append(outs)
        del outs, leaves
        cycles.reclaim()  # as capture does between buckets
    return rows


def _ladder_steps(rt: RunnerRuntime, planner: Any, lazy_state: list[int], tag: str = "",
                  ) -> list[tuple[str, Callable[[], Any], Callable[[Any], Any] | None]]:
    """The plan steps of ``rt``'s ladder, largest bucket first (as capture), labelled
    ``tag + str(bucket)``; buckets whose state initialises itself lazily go into
    ``lazy_state``."""
    opts = rt.options
    region: list[Any] = []  # share_outputs: the first bucket's outputs, written by later ones
    dims: list[Any] = []

    def step_for(b: int) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
        args, kwargs = pytree.tree_unflatten([s.view(b) for s in rt.inputs], rt.in_spec)
        states = rt.states
        if states is not None and states.enabled:
            # A state not built yet is built for the plan alone and dropped after it: state
            # that initialises itself lazily on its first step (transformers' StaticCache)
            # would otherwise keep tensors of the plan's pool.
            assert states.factory is not None
            kwargs = {**kwargs, "state": states.built.get(b) or states.factory(b)}
        held = {id(t) for t in state_tensors(kwargs.get("state"))}

        def call() -> Any:
            with opts.islands.marking():
                out = opts.fn(*args, **kwargs)
            views = _region_views(region, dims, out, b)
            for dst, src in zip(views or (), pytree.tree_leaves(out)):
                dst.copy_(src)  # recorded as capture records it: a write, no allocation
            return out

        def keep(out: Any) -> Any:
            state = kwargs.get("state")
            grown = [t for t in state_tensors(state) if id(t) not in held and planner.pool.owns(t)]
            if grown:
                # The step made the state's tensors (lazy initialisation): the real warm-up
                # makes them outside the pool; here they were booked in it.
                lazy_state.append(b)
                if states is not None and states.built.get(b) is state:
                    del states.built[b]  # holds plan tensors now: rebuilt at capture
            if region and _region_views(region, dims, out, b) is not None:
                return None  # copied into the region: the graph's own outputs die
            if rt.share_outputs and not region:
                leaves, spec = pytree.tree_flatten(out)
                region.extend(leaves)
                dims.extend(broadcast_outputs(opts.output_batch_dim, spec))
            return out

        return call, keep

    steps: list[tuple[str, Callable[[], Any], Callable[[Any], Any] | None]] = []
    for bucket in reversed(rt.buckets):  # largest first, as capture
        call, keep = step_for(bucket.size)
        steps.append((tag + str(bucket.size), call, keep))
    return steps


def _plan(rts: list[RunnerRuntime], trace: str | None, alloc_conf: str | None,
          ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Plan the ladders of ``rts`` in order into one pool; the plan's common fields and the
    per-step rows (labels ``"<runner index>:<bucket>"``)."""
    t0 = time.perf_counter()
    rt = rts[0]
    opts = rt.options
    engine, policy, recycle, report = plan_settings(rt.backend.name, opts.device, alloc_conf)
    planner = memory_planner(opts.device, engine, policy, recycle=recycle,
                             record_events=trace is not None)
    lazy_state: list[int] = []
    steps = []
    for i, r in enumerate(rts):
        steps += _ladder_steps(r, planner, lazy_state, f"{i}:")
    with torch.no_grad(), gc_paused():
        rows = plan_steps(planner, steps)
        stats = planner.pool_stats()
        warm = planner.warmup_peak()
        out_bytes = distinct_pool_bytes(planner.kept, planner.pool.owns)
        planner.kept = []
    unplanned = list(planner.unplanned)
    if lazy_state:
        unplanned.append({"island": None, "reason": (
            f"the state of bucket(s) {sorted(lazy_state)} made its tensors inside the step "
            f"(lazy initialisation, as transformers' StaticCache): capture's eager warm-up makes "
            f"them outside the pool, but the plan booked them in it, so the pool figures are high "
            f"by their size. Initialise the state in the state= factory for an exact plan")})
    result = {
        "schema": PLAN_SCHEMA,
        "device": str(opts.device),
        "backend": rt.backend.name,
        "compile": opts.compile,
        "allocator_settings": report,
        "pool_reserved_bytes": stats["reserved"],
        "pool_peak_reserved_bytes": stats["peak_reserved"],
        "warmup_peak_bytes": warm,
        "static_input_bytes": sum(s.static.numel() * s.static.element_size()
                                  for r in rts for s in r.inputs),
        "static_output_bytes": out_bytes,
        "unplanned": unplanned,
        "planning_seconds": 0.0,
    }
    if trace is not None:
        ladders = " + ".join(str(list(r.options.ladder)) for r in rts)
        planner.write_trace(trace, report, what=f"GraphRunner ladder {ladders}")
        result["trace"] = str(trace)
    result["planning_seconds"] = time.perf_counter() - t0
    return result, rows


def _bucket_rows(rows: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        i, _, size = r["label"].partition(":")
        if int(i) == index:
            out.append({"bucket": int(size), "incremental_bytes": r["incremental_bytes"],
                        "standalone_bytes": r["standalone_bytes"],
                        "pool_after_bytes": r["pool_after_bytes"],
                        "output_bytes": r["output_bytes"], "status": "planned"})
    return sorted(out, key=lambda r: r["bucket"])


def plan_runner(rt: RunnerRuntime, *, trace: str | None = None, alloc_conf: str | None = None,
                ) -> dict[str, Any]:
    """The memory plan of ``rt``'s ladder (schema :data:`PLAN_SCHEMA`); see the module.

    ``trace``: also write the planned pool's allocations as a memory-snapshot trace there
    (``accel-alloc tune`` ranks settings on it). Raises the CaptureError capture would raise
    (a refused op, a data-dependent size), with the op and its line; nothing of the runner
    changes either way.
    """
    result, rows = _plan([rt], trace, alloc_conf)
    result["buckets"] = _bucket_rows(rows, 0)
    return result


def plan_shared_pool(runners: Sequence[Any], *, trace: str | None = None,
                     alloc_conf: str | None = None) -> dict[str, Any]:
    """The memory plan of several runners that capture, in this order, into one shared pool
    (an executor's token-bucket and decode graphs): the plan of :func:`plan_runner` for them
    all, its pool figures the shared pool's, ``buckets`` the first runner's and ``runners``
    one ``{"buckets": [...]}`` per runner. Each runner must be built with the same ``pool=``
    and device (ConfigError otherwise, as the figures would not describe one pool)."""
    rts = [r.runtime for r in runners]
    if not rts:
        raise ConfigError("plan_shared_pool needs at least one runner")
    first = rts[0]
    for rt in rts[1:]:
        if rt.pool is not first.pool or rt.pool is None or rt.options.device != first.options.device:
            raise ConfigError("plan_shared_pool plans runners built with one pool= handle on one "
                              "device; plan runners with their own pools one by one "
                              "(GraphRunner.plan_memory())")
    result, rows = _plan(rts, trace, alloc_conf)
    result["buckets"] = _bucket_rows(rows, 0)
    result["runners"] = [{"buckets": _bucket_rows(rows, i)} for i in range(len(rts))]
    return result


def _region_views(region: list[Any], dims: list[Any], out: Any, b: int) -> list[Any] | None:
    """Views of the shared output region for bucket ``b``'s outputs, or None (as the runner's
    ``_region_for``: no region, another structure, or outputs the region cannot hold)."""
    if not region:
        return None
    leaves = pytree.tree_leaves(out)
    if len(leaves) != len(region):
        return None
    views = []
    for x, d, y in zip(region, dims, leaves):
        v = x if d is None else (x.narrow(d, 0, b) if x.shape[d] >= b else None)
        if v is None or v.shape != y.shape or v.dtype != y.dtype:
            return None
        views.append(v)
    return views
