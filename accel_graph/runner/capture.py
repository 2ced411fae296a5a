"""Capture for :class:`~accel_graph.runner.GraphRunner`: warm-up, largest-first capture into
one shared pool, the memory budget, and the per-batch-size routes the hot path reads.

A mixin so the serving path (:mod:`.core`) stays small; it works on the runner's attributes,
which :meth:`GraphRunner.__init__` sets up.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..errors import AccelGraphError, CaptureError, ConfigError, OutOfMemoryError
from ..frontend import Graph, graph, graph_pool_handle
from .support import Bucket, broadcast_outputs, progress_bar, reason_of

if TYPE_CHECKING:
    from .core import GraphRunner

__all__ = ["CaptureMixin"]

log = logging.getLogger("accel_graph")

#: Capture failures that disable one bucket (the others keep serving). Anything else is a bug
#: in the function or the inputs and propagates.
_BUCKET_FAILURES = (CaptureError, OutOfMemoryError, torch.OutOfMemoryError, MemoryError)


class CaptureMixin:
    """The capture half of GraphRunner."""

    # ------------------------------------------------------------------------------------
    # capture
    # ------------------------------------------------------------------------------------
    def _bucket_args(self, b: int) -> tuple[tuple, dict]:
        args, kwargs = pytree.tree_unflatten([s.view(b) for s in self.inputs], self._in_spec)
        return args, kwargs

    def _pool_bytes(self, handle: Any) -> tuple[int | None, int | None]:
        """(reserved, peak reserved) bytes of the shared pool, where the backend tells."""
        stats = self._backend.pool_stats(handle) if handle is not None else None
        if stats is None:
            return None, None
        return stats.reserved_bytes, stats.extra.get("peak_reserved_bytes")

    def capture(self: GraphRunner) -> GraphRunner:
        """Warm up and capture every bucket, largest first, into one shared pool.

        A bucket whose capture fails (``CaptureError``, out of memory) or that pushes the pool
        over ``memory_budget`` is left out with its reason (``strict=True`` raises instead); its
        batches run eagerly. Raises ConfigError when the budget cannot hold even the smallest
        bucket, or when ``fn`` returns something other than tensors. Returns ``self``.
        """
        if self._captured:
            raise AccelGraphError("GraphRunner.capture() already ran; build a new runner to recapture")
        probe = Graph(device=self._graph_device or self.device, compile=self.compile)
        self._backend, spec = probe.backend, probe.device
        del probe
        handle = self._pool if self._pool is not None else graph_pool_handle(spec.torch_device)
        self._pool = handle
        bar = progress_bar(len(self.buckets), self.progress)
        gc_was_enabled = gc.isenabled()
        # GC off during capture (vLLM and SGLang freeze it): a collection mid-capture costs
        # time and can run finalizers of tensors in the middle of a capture. No gc.collect()
        # first: with torch imported one full collection takes ~0.5 s on a 2-core CPU, longer
        # than capturing a small ladder.
        gc.disable()
        try:
            for bucket in reversed(self._buckets):  # largest first: smaller ones reuse its memory
                if bar is not None:
                    bar.set_postfix_str(f"bucket {bucket.size}")
                self._capture_one(bucket, handle)
                if bar is not None:
                    reserved, _ = self._pool_bytes(handle)
                    mib = "?" if reserved is None else f"{reserved / 2**20:.1f}"
                    bar.set_postfix_str(f"bucket {bucket.size} | pool {mib} MiB")
                    bar.update(1)
        finally:
            if gc_was_enabled:
                gc.enable()
            if bar is not None:
                bar.close()
            self._captured = True
            self._build_routes()
        smallest = self._buckets[0]
        if smallest.status == "over_budget":
            raise ConfigError(
                f"memory_budget={self.memory_budget} bytes is too small for the smallest bucket "
                f"({smallest.size}), which needs {smallest.pool_after_bytes} bytes of pool "
                f"({smallest.standalone_bytes} standalone); raise the budget or drop it. Every "
                f"call runs eagerly until then."
            )
        return self

    def _capture_one(self, bucket: Bucket, handle: Any) -> None:
        b = bucket.size
        for s, x in zip(self.inputs, self._examples):
            s.fill_bucket(x, b)
        args, kwargs = self._bucket_args(b)
        spec = self._backend.device_spec(self.device)
        # Warm-up on the stream capture will use (per-stream library handles, e.g. hipBLASLt,
        # must exist before capture): workspaces, lazy init, algorithm choice.
        try:
            with torch.no_grad(), self._backend.stream_context(self._backend.capture_stream(spec)):
                warm = self.fn(*args, **kwargs)
        except (OutOfMemoryError, torch.OutOfMemoryError, MemoryError) as exc:
            self._fail(bucket, "failed", f"eager warm-up ran out of memory: {reason_of(exc)}", exc)
            return
        self._check_outputs(warm, b)
        del warm
        self._backend.synchronize(spec)
        g = Graph(device=self._graph_device or self.device, pool=handle, compile=self.compile)
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), graph(g, pool=handle):
                out = self.fn(*args, **kwargs)
        except _BUCKET_FAILURES as exc:
            self._fail(bucket, "failed", f"capture failed: {reason_of(exc)}", exc)
            return
        bucket.capture_ms = (time.perf_counter() - t0) * 1e3
        bucket.graph = g
        bucket.incremental_bytes = g.memory_bytes()
        bucket.standalone_bytes = g.standalone_bytes()
        reserved, _ = self._pool_bytes(handle)
        bucket.pool_after_bytes = reserved
        if self.memory_budget is not None:
            used = reserved
            if used is None:  # backend cannot count its pool: sum of graphs' growth
                used = sum(x.incremental_bytes or 0 for x in self._buckets if x.graph is not None)
            if used > self.memory_budget:
                del out
                g.reset()  # roll back: the pool drops what only this graph used
                bucket.graph = None
                self._fail(bucket, "over_budget",
                           f"left out by memory_budget={self.memory_budget}: the pool would hold "
                           f"{used} bytes with it", None, raise_strict=False)
                return
        leaves, spec = pytree.tree_flatten(out)
        if self._out_spec is None:
            self._out_spec = spec
            self._out_dims = broadcast_outputs(self._output_batch_dim, spec)
        bucket.out_leaves = leaves
        bucket.replay = g.replay
        bucket.status = "captured"
        bucket.ready = not self.verify

    def _check_outputs(self, out: Any, b: int) -> None:
        leaves, spec = pytree.tree_flatten(out)
        bad = [x for x in leaves if not isinstance(x, torch.Tensor)]
        if not leaves or bad:
            what = type(out).__name__ if not leaves else type(bad[0]).__name__
            raise ConfigError(
                f"GraphRunner's function returned {what}; it must return a tensor or a "
                f"tuple/list/dict of tensors (a graph's outputs are device memory)"
            )
        dims = broadcast_outputs(self._output_batch_dim, spec)
        for k, (x, d) in enumerate(zip(leaves, dims)):
            if d is not None and (x.dim() <= d or x.shape[d] != b):
                raise ConfigError(
                    f"output {k} has shape {tuple(x.shape)}, with no batch of {b} along dim {d}; "
                    f"pass output_batch_dim (None for outputs without a batch dimension)"
                )

    def _fail(self, bucket: Bucket, status: str, reason: str, exc: BaseException | None,
              raise_strict: bool = True) -> None:
        bucket.status, bucket.reason, bucket.ready = status, reason, False
        bucket.replay, bucket.out_leaves = None, []
        log.warning("GraphRunner: bucket %d %s; its batches run eagerly", bucket.size, reason)
        if self.strict and raise_strict:
            raise CaptureError(f"GraphRunner bucket {bucket.size}: {reason}") from exc

    def _build_routes(self) -> None:
        """Precompute, per live batch size, the bucket and the sliced outputs."""
        self._outs.clear()
        k = 0
        for n in range(1, self.max_bucket + 1):
            while self._buckets[k].size < n:
                k += 1
            bucket = self._buckets[k]
            self._route[n] = bucket
            if bucket.replay is not None:
                self._outs[n] = self._sliced(bucket, n)

    def _sliced(self, bucket: Bucket, n: int) -> Any:
        assert self._out_spec is not None
        views = [x if d is None else x.narrow(d, 0, n) for x, d in zip(bucket.out_leaves, self._out_dims)]
        if self._out_spec.num_leaves == 1 and self._out_spec.is_leaf():
            return views[0]
        return pytree.tree_unflatten(views, self._out_spec)
