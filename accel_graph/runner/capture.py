"""Capture for :class:`~accel_graph.runner.GraphRunner`, as functions over its
:class:`~accel_graph.runner.runtime.RunnerRuntime`: warm-up, largest-first capture into one
shared pool, the memory budget, and the per-batch-size routes the hot path reads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import AccelGraphError, CaptureError, ConfigError, OutOfMemoryError
from ..foundation.gc_pause import ImportCycles, gc_paused
from ..graphs.graph import Graph, graph, resolved_graph
from .group import CODE_FAILED, CODE_OK, CODE_RAISED, check_same_setup, exchange
from .islands import IslandProbe
from .rows import rows_apply
from .runtime import Bucket, RunnerRuntime
from .state import state_tensors
from .support import broadcast_outputs, progress_bar, reason_of
from .verify import UndoLog

__all__ = ["capture_buckets", "capture_lazily", "disable_bucket", "output_region_bytes"]

log = logging.getLogger("accel_graph")

#: Capture failures that disable one bucket (the others keep serving). Anything else is a bug
#: in the function or the inputs and propagates.
_BUCKET_FAILURES = (CaptureError, OutOfMemoryError, torch.OutOfMemoryError, MemoryError)


def capture_buckets(rt: RunnerRuntime) -> None:
    """Warm up and capture every bucket of ``rt``, largest first, into one shared pool.

    A bucket whose capture fails (``CaptureError``, out of memory) or that pushes the pool over
    ``rt.memory_budget`` or the capture time over ``rt.options.capture_time_budget`` is left out with
    its reason (``rt.strict`` raises instead); its batches run eagerly. With
    ``rt.options.capture_mode == "lazy"`` nothing is captured here: each bucket is captured on its first
    call (:func:`capture_lazily`). Raises AccelGraphError when ``rt`` was captured before,
    ConfigError when the budget cannot hold even the smallest bucket, or when ``rt.options.fn`` returns
    something other than tensors. ``rt.captured`` is set and the routes built even when capture
    raises half-way.
    """
    if rt.captured:
        raise AccelGraphError("GraphRunner.capture() already ran; build a new runner to recapture")
    if rt.pool is None:
        rt.pool = rt.backend.graph_pool_handle(rt.device_spec)
    if rt.options.capture_mode == "lazy":
        rt.captured = True
        rt.build_routes()
        return
    if rt.group is not None:
        check_same_setup(rt.group, rt.options.ladder, rt.verify)
    strict = rt.strict
    # With a process group a rank must not raise alone (the others would wait in their next
    # collective): strict raises after the ranks agree, on every rank (_capture_agreed).
    rt.strict = strict and rt.group is None
    bar = progress_bar(len(rt.buckets), rt.progress)
    try:
        with gc_paused():
            cycles = ImportCycles()
            for bucket in reversed(rt.buckets):  # largest first: smaller ones reuse its memory
                if bar is not None:
                    bar.set_postfix_str(f"bucket {bucket.size}")
                if rt.group is not None:
                    _capture_agreed(rt, bucket, strict)
                elif not _over_time_budget(rt, bucket):
                    _capture_one(rt, bucket)
                cycles.reclaim()  # what a first-time import pinned goes back to the pool
                if bar is not None:
                    reserved, _ = rt.pool_bytes()
                    mib = "?" if reserved is None else f"{reserved / 2**20:.1f}"
                    bar.set_postfix_str(f"bucket {bucket.size} | pool {mib} MiB")
                    bar.update(1)
    finally:
        rt.strict = strict
        if bar is not None:
            bar.close()
        rt.captured = True
        rt.build_routes()
    smallest = rt.buckets[0]
    if smallest.status == "over_budget":
        raise ConfigError(
            f"memory_budget={rt.memory_budget} bytes is too small for the smallest bucket "
            f"({smallest.size}), which needs {smallest.pool_after_bytes} bytes of pool "
            f"({smallest.standalone_bytes} standalone); raise the budget or drop it. Every "
            f"call runs eagerly until then."
        )


def capture_lazily(rt: RunnerRuntime, bucket: Bucket) -> None:
    """Capture ``bucket`` on its first call (``capture="lazy"``), then rebuild the routes.

    The warm-up runs ``fn`` once more than eager capture would, while the server already holds
    state: every tensor it writes in place (a KV cache, a counter) is put back afterwards, so the
    call that triggered the capture sees the state as it was. Failures leave the bucket out,
    as in :func:`capture_buckets`.
    """
    try:
        if rt.pool is None:
            rt.pool = rt.backend.graph_pool_handle(rt.device_spec)
        if not _over_time_budget(rt, bucket):
            with gc_paused():
                _capture_one(rt, bucket, undo_warmup=True)
    finally:
        rt.captured = True
        rt.build_routes()


def _over_time_budget(rt: RunnerRuntime, bucket: Bucket) -> bool:
    """Leave ``bucket`` out (True) when capture has used up ``rt.options.capture_time_budget``."""
    budget = rt.options.capture_time_budget
    if budget is None or rt.capture_seconds < budget:
        return False
    disable_bucket(rt, bucket, "over_time_budget",
                   f"left out by capture_time_budget={budget} s: {rt.capture_seconds:.2f} s "
                   f"already spent capturing", None, raise_strict=False)
    return True


def _capture_one(rt: RunnerRuntime, bucket: Bucket, undo_warmup: bool = False) -> None:
    t_start = time.perf_counter()
    try:
        _warm_and_capture(rt, bucket, undo_warmup)
    finally:
        rt.capture_seconds += time.perf_counter() - t_start
        bucket.captured_at_call = rt.calls_served()


def _warm_and_capture(rt: RunnerRuntime, bucket: Bucket, undo_warmup: bool) -> None:
    b = bucket.size
    opts = rt.options
    for s, x in zip(rt.inputs, rt.examples):
        s.fill_bucket(x, b)
    args, kwargs = rt.bucket_args(b)
    backend = rt.backend
    spec = backend.device_spec(opts.device)
    # Warm-up on the stream capture will use (per-stream library handles, e.g. hipBLASLt, must
    # exist before capture): workspaces, lazy init, algorithm choice; and, on native backends,
    # both branches of every torch.cond (control_flow_warmup), not only the one taken. The
    # probe says whether the step calls eager islands (islands= or marked for good).
    undo = UndoLog() if undo_warmup else None
    probe = IslandProbe()
    try:
        with torch.no_grad(), backend.stream_context(backend.capture_stream(spec)), \
                (undo if undo is not None else contextlib.nullcontext()), \
                backend.control_flow_warmup(spec), opts.islands.marking(), probe.watching():
            warm = opts.fn(*args, **kwargs)
    except (OutOfMemoryError, torch.OutOfMemoryError, MemoryError) as exc:
        disable_bucket(rt, bucket, "failed", f"eager warm-up ran out of memory: {reason_of(exc)}", exc)
        return
    finally:
        if undo is not None:
            undo.restore()
    _check_outputs(rt, warm, b)
    warm_leaves, warm_spec = pytree.tree_flatten(warm)
    warm_shapes = [(x.shape, x.dtype) for x in warm_leaves]
    del warm, warm_leaves
    if probe.seen and undo is None:
        undo = _writes_of_step(rt, args, kwargs)
    try:
        _capture(rt, bucket, args, kwargs, warm_spec, warm_shapes)
    finally:
        if probe.seen and undo is not None:
            # Capture with islands ran each piece and island once for real (the islands'
            # warm-up): put back every tensor they wrote, as a step from this same state
            # writes (the log's), so capture leaves state as the warm-up left it.
            undo.restore()


def _writes_of_step(rt: RunnerRuntime, args: tuple, kwargs: dict) -> UndoLog:
    """Run the step once more, eagerly, logging every tensor it writes, and put them back: the
    tensors a capture with islands will write for real from this same state, and their values
    now. (Only for a step with islands, whose warm-up was not logged: ``capture="eager"``.)"""
    undo = UndoLog()
    try:
        with torch.no_grad(), undo:
            rt.options.fn(*args, **kwargs)
    finally:
        undo.restore()
    return undo


def _capture(rt: RunnerRuntime, bucket: Bucket, args: tuple, kwargs: dict, warm_spec: Any,
             warm_shapes: list[tuple[torch.Size, torch.dtype]]) -> None:
    b = bucket.size
    opts = rt.options
    backend = rt.backend
    spec = backend.device_spec(opts.device)
    backend.synchronize(spec)
    # compile= resolved once, at construction (RunnerOptions): not read again per bucket.
    g = resolved_graph(device=opts.device, pool=rt.pool, compile=opts.graph_compile)
    t0 = time.perf_counter()
    region = _region_for(rt, warm_spec, warm_shapes, b)
    try:
        with torch.no_grad(), graph(g, pool=rt.pool):
            with opts.islands.marking():
                out = opts.fn(*args, **kwargs)
            if region is not None:  # write the outputs into the shared region, in the graph
                for dst, src in zip(region, pytree.tree_leaves(out)):
                    dst.copy_(src)
    except _BUCKET_FAILURES as exc:
        disable_bucket(rt, bucket, "failed", f"capture failed: {reason_of(exc)}", exc)
        return
    bucket.capture_ms = (time.perf_counter() - t0) * 1e3
    _record_compile(rt, bucket, g)
    bucket.graph = g
    bucket.incremental_bytes = g.memory_bytes()
    bucket.standalone_bytes = g.standalone_bytes()
    reserved, _ = rt.pool_bytes()
    bucket.pool_after_bytes = reserved
    if rt.memory_budget is not None:
        used = reserved
        if used is None:  # backend cannot count its pool: sum of graphs' growth
            used = sum(x.incremental_bytes or 0 for x in rt.buckets if x.graph is not None)
        if used > rt.memory_budget:
            del out
            g.reset()  # roll back: the pool drops what only this graph used
            bucket.graph = None
            disable_bucket(rt, bucket, "over_budget",
                           f"left out by memory_budget={rt.memory_budget}: the pool would hold "
                           f"{used} bytes with it", None, raise_strict=False)
            return
    leaves, out_spec = pytree.tree_flatten(out)
    if rt.out_spec is None:
        rt.out_spec = out_spec
        rt.out_dims = broadcast_outputs(opts.output_batch_dim, out_spec)
    bucket.output_bytes = sum(x.numel() * x.element_size() for x in leaves)
    if region is not None:
        leaves = region  # the graph copied its outputs there; its own die with ``out``
    elif rt.share_outputs and rt.output_region is None and not _aliases_inputs(rt, leaves):
        rt.output_region = leaves  # the first bucket captured owns the region
    del out
    bucket.out_leaves = leaves
    bucket.replay = g.replay
    bucket.status = "captured"
    bucket.ready = rt.verify == 0
    bucket.rows_checked = not rows_apply(rt, bucket)  # nothing to check: padded sizes route hot


def _record_compile(rt: RunnerRuntime, bucket: Bucket, g: Graph) -> None:
    """Split the compile time out of ``bucket.capture_ms`` (which includes it): the graph's
    ``compile_info()`` says how long instantiation spent compiling, or reusing a cached module."""
    info = g.compile_info()
    if not info:
        return
    seconds = info.get("compile_s")
    if isinstance(seconds, (int, float)):
        bucket.compile_ms = seconds * 1e3
        rt.compile_seconds += seconds
    bucket.compile_cache = "fallback" if info.get("fallback") else info.get("cache")


def _aliases_inputs(rt: RunnerRuntime, leaves: list[torch.Tensor]) -> bool:
    """Whether an output is (a view of) a static input or per-bucket state: such memory must
    never become the shared region, or smaller buckets would write their outputs into it."""
    assert rt.states is not None
    held = {s.static.untyped_storage().data_ptr() for s in rt.inputs}
    for obj in rt.states.built.values():
        held.update(t.untyped_storage().data_ptr() for t in state_tensors(obj))
    hit = [k for k, x in enumerate(leaves) if x.untyped_storage().data_ptr() in held]
    if hit:
        log.warning("GraphRunner: share_outputs is off: outputs %s are views of static inputs "
                    "or per-bucket state, not graph memory", hit)
        rt.share_outputs = False
    return bool(hit)


def _region_for(rt: RunnerRuntime, spec: Any, shapes: list[tuple[torch.Size, torch.dtype]],
                b: int) -> list[torch.Tensor] | None:
    """Views of the shared output region for bucket ``b``'s outputs (``share_outputs``), or
    None: sharing is off, no region exists yet (this bucket will own it), or the region cannot
    hold these outputs (a larger bucket captured after a smaller one, or outputs whose
    non-batch shape depends on the bucket), which then keep their own memory."""
    region = rt.output_region
    if region is None or spec != rt.out_spec:
        return None
    views = []
    for x, d, (shape, dtype) in zip(region, rt.out_dims, shapes):
        v = x if d is None else (x.narrow(d, 0, b) if x.shape[d] >= b else None)
        if v is None or v.shape != shape or v.dtype != dtype:
            return None
        views.append(v)
    return views


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte) of the memory ``t`` covers (0, 0 when empty)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def output_region_bytes(rt: RunnerRuntime) -> int:
    """Bytes of memory the serving buckets' outputs cover together (overlaps counted once)."""
    spans = sorted(_span(x) for b in rt.buckets if b.replay is not None for x in b.out_leaves)
    total, end = 0, -1
    for lo, hi in spans:
        if hi <= lo:
            continue
        if lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _capture_agreed(rt: RunnerRuntime, bucket: Bucket, strict: bool) -> None:
    """:func:`_capture_one` on one rank of ``rt.group``, then agree with the other ranks: a
    bucket that any rank cannot serve is disabled on every rank (with ``strict``, every rank
    raises CaptureError), and when any rank raised, every rank raises."""
    assert rt.group is not None
    try:
        if not _over_time_budget(rt, bucket):  # the clocks differ: agreed below like a failure
            _capture_one(rt, bucket)
    except Exception:
        exchange(rt.group, CODE_RAISED)  # tell the others before leaving, so none waits
        raise
    codes = exchange(rt.group, CODE_OK if bucket.status == "captured" else CODE_FAILED)
    raised = [r for r, c in enumerate(codes) if c == CODE_RAISED]
    if raised:
        raise AccelGraphError(
            f"GraphRunner capture stopped on rank {rt.group.rank}: rank(s) {raised} raised while "
            f"capturing bucket {bucket.size} (their logs have the error); every rank stops, so "
            f"none waits on the others' collectives"
        )
    failed = [r for r, c in enumerate(codes) if c != CODE_OK]
    if not failed:
        return
    if bucket.status == "captured":  # this rank could serve it; another could not
        g = bucket.graph
        # Outputs that became the shared region (share_outputs) stay: smaller buckets write
        # there. Otherwise the graph is reset and its pool memory goes back.
        owns_region = rt.output_region is not None and rt.output_region is bucket.out_leaves
        disable_bucket(rt, bucket, "disabled",
                       f"disabled on every rank: rank(s) {failed} could not capture it", None)
        if g is not None and not owns_region:
            g.reset()
            bucket.graph = None
    else:
        bucket.reason = f"{bucket.reason} (rank(s) {failed}; disabled on every rank)"
    if strict:
        raise CaptureError(f"GraphRunner bucket {bucket.size} on rank {rt.group.rank}: {bucket.reason}")


def _check_outputs(rt: RunnerRuntime, out: Any, b: int) -> None:
    leaves, spec = pytree.tree_flatten(out)
    bad = [x for x in leaves if not isinstance(x, torch.Tensor)]
    if not leaves or bad:
        what = type(out).__name__ if not leaves else type(bad[0]).__name__
        raise ConfigError(
            f"GraphRunner's function returned {what}; it must return a tensor or a "
            f"tuple/list/dict of tensors (a graph's outputs are device memory)"
        )
    dims = broadcast_outputs(rt.options.output_batch_dim, spec)
    for k, (x, d) in enumerate(zip(leaves, dims)):
        if d is not None and (x.dim() <= d or x.shape[d] != b):
            raise ConfigError(
                f"output {k} has shape {tuple(x.shape)}, with no batch of {b} along dim {d}; "
                f"pass output_batch_dim (None for outputs without a batch dimension)"
            )


def disable_bucket(rt: RunnerRuntime, bucket: Bucket, status: str, reason: str,
                   exc: BaseException | None, raise_strict: bool = True) -> None:
    """Take ``bucket`` out of service with ``status`` and ``reason`` (logged); its batches run
    eagerly. With ``rt.strict`` (and ``raise_strict``) raise CaptureError from ``exc`` instead.
    The caller rebuilds the routes (:meth:`RunnerRuntime.build_routes`) if they exist already."""
    bucket.status, bucket.reason, bucket.ready = status, reason, False
    bucket.replay, bucket.out_leaves = None, []
    log.warning("GraphRunner: bucket %d %s; its batches run eagerly", bucket.size, reason)
    if rt.strict and raise_strict:
        raise CaptureError(f"GraphRunner bucket {bucket.size}: {reason}") from exc
