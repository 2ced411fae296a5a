"""``accel_graph.GraphRunner``: bucketed graph capture for inference servers.

The recipe every serving stack re-implements (``reference/serving-anchors.md`` section 0): a
ladder of batch-size buckets, static inputs sized for the largest, one eager warm-up per bucket,
capture largest-first into one shared pool with Python's GC off, pad each live batch up to the
smallest bucket that fits, replay, slice the outputs; eager above the top bucket. On top of it:
per-bucket memory from the allocator, a memory budget, eager-vs-replay verification of each
bucket's first replay, and eager fallback (logged) instead of aborting.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import AccelGraphError, ConfigError
from ..frontend import Graph
from .buckets import default_ladder, validate_ladder
from .capture import CaptureMixin
from .inputs import InputSpec, broadcast, leaf_names
from .reports import memory_report, stats
from .support import Bucket, fits
from .verify import UndoLog, compare

__all__ = ["GraphRunner"]

log = logging.getLogger("accel_graph")


class GraphRunner(CaptureMixin):
    """Serve ``fn`` from one captured graph per batch-size bucket.

    Args:
        fn: the step to capture, ``fn(*inputs) -> tensor or pytree of tensors``. It must be
            capturable (see :func:`accel_graph.check_capturable`); state it reads and writes
            (weights, a KV cache) is captured by reference.
        example_inputs: positional inputs (a tuple; a lone tensor is one input), tensors or
            pytrees of tensors, on the runner's device. They fix dtype, rank and non-batch
            shape of every input; their batch size may be anything, their rows seed warm-up.
        buckets: the batch sizes to capture; default :func:`default_ladder` up to ``max_batch``
            (vLLM's 1, 2, 4, 8, 16, 24, ...).
        max_batch: the largest batch to serve from a graph (needed when ``buckets`` is None).
        batch_dim: the batch dimension of each input: an int for all, a tuple with one entry
            per positional argument (int, None, or a tree matching that argument), or None for
            an input without one (copied whole each call). Default 0.
        pad_value: value of padded rows, per input as ``batch_dim``. Default 0.
        pad_index: for index inputs (KV-cache slots, positions): the index padded rows use, to
            point at a dummy slot so padded rows never write into live state. Overrides
            ``pad_value`` for the inputs it names.
        output_batch_dim: batch dimension of each output (int, or a tuple/tree of int/None;
            None returns that output whole). Default 0.
        example_kwargs: keyword inputs, like ``example_inputs``.
        pool: a pool handle to capture into; default a new ``graph_pool_handle(device)``.
        device: default: the device of the example inputs.
        compile: passed to every :class:`~accel_graph.Graph` (``"inductor"`` on the recorder).
        verify: compare each bucket's first replay with eager at the padded shape, under the
            per-dtype tolerances of :mod:`accel_graph.testing.tolerances`; a mismatch disables
            the bucket (its calls run eagerly).
        strict: raise instead of falling back to eager (failed capture, verification mismatch,
            batch above the largest bucket).
        memory_budget: bytes the pool may hold; buckets that push it over are captured, measured
            and rolled back, largest first. Exact on the recorder.
        copy_outputs: return copies instead of views into the graphs' static outputs (which the
            next call of the same bucket overwrites).
        progress: show a progress bar during capture; None: only when stderr is a terminal.

    Calls run under ``torch.no_grad()``; ``capture()`` runs ``fn`` eagerly once per bucket
    (warm-up), so state ``fn`` mutates is touched then. Not thread-safe: one caller at a time.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Any,
        buckets: Sequence[int] | None = None,
        *,
        max_batch: int | None = None,
        batch_dim: Any = 0,
        pad_value: Any = 0,
        pad_index: Any = None,
        output_batch_dim: Any = 0,
        example_kwargs: Mapping[str, Any] | None = None,
        pool: object | None = None,
        device: torch.device | str | int | None = None,
        compile: str | None = None,
        verify: bool = True,
        strict: bool = False,
        memory_budget: int | None = None,
        copy_outputs: bool = False,
        progress: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        if buckets is None:
            if max_batch is None:
                raise ConfigError(
                    "give buckets=[...] or max_batch=N (the default ladder is 1, 2, 4, 8, 16, 24, "
                    "... up to N, as vLLM's)"
                )
            self.buckets = default_ladder(max_batch)
        else:
            self.buckets = validate_ladder(buckets, max_batch)
        if memory_budget is not None and (
            isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
        ):
            raise ConfigError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
        self.memory_budget = memory_budget
        self.verify, self.strict, self.copy_outputs = bool(verify), bool(strict), bool(copy_outputs)
        self.progress = progress
        self.compile = compile
        self.max_bucket = self.buckets[-1]

        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        kwargs = dict(example_kwargs or {})
        leaves, self._in_spec = pytree.tree_flatten((args, kwargs))
        if not leaves:
            raise ConfigError("example_inputs has no tensors; GraphRunner needs at least one input")
        first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
        if first is None:
            raise ConfigError("example_inputs holds no tensor")
        self.device = torch.device(device) if device is not None else first.device
        if self.device.type != "cpu" and self.device.index is None and first.device.type == self.device.type:
            self.device = first.device
        names = leaf_names(args, kwargs)
        dims = broadcast(batch_dim, self._in_spec, "batch_dim", 0)
        pads = broadcast(pad_value, self._in_spec, "pad_value", 0)
        idx = broadcast(pad_index, self._in_spec, "pad_index", None)
        self.inputs = [
            InputSpec.build(nm, x, d, p, i, self.max_bucket, self.device)
            for nm, x, d, p, i in zip(names, leaves, dims, pads, idx)
        ]
        self._examples = [x.detach() for x in leaves]
        for s in self.inputs:  # views per live batch size, so a call slices nothing
            s.live = [s.view(n) for n in range(self.max_bucket + 1)]
        self._batched = [s for s in self.inputs if s.batch_dim is not None]
        self._hot = [(s.live, [v.shape for v in s.live], s.dtype, s.device) for s in self.inputs]
        batched = [k for k, s in enumerate(self.inputs) if s.batch_dim is not None]
        if not batched:
            raise ConfigError("no input has a batch dimension (batch_dim is None everywhere)")
        self._lead = batched[0]
        self._lead_dim = self.inputs[self._lead].batch_dim
        self._output_batch_dim = output_batch_dim
        # Fast path: positional tensors only, no kwargs: the call's args are the leaves.
        self._flat_args = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        self._n_leaves = len(leaves)
        self._kw_order = dict.fromkeys(kwargs)

        self._pool = pool
        self._graph_device = device
        self._buckets = [Bucket(b) for b in self.buckets]
        self._captured = False
        # route[n] -> bucket for 1 <= n <= max_bucket; built by capture().
        self._route: list[Bucket | None] = [None] * (self.max_bucket + 1)
        self._outs: dict[int, Any] = {}  # live batch size -> prebuilt sliced outputs
        self._out_spec: pytree.TreeSpec | None = None
        self._out_dims: list[int | None] = []
        self._fallbacks: Counter[str] = Counter()
        self._eager_calls = 0
        # Live batch sizes served (graph: a list indexed by size, cheap on the hot path), for
        # stats()["batch_size_histogram"] and suggest_buckets().
        self._sizes = [0] * (self.max_bucket + 1)
        self._eager_sizes: Counter[int] = Counter()

    # ------------------------------------------------------------------------------------
    # serving
    # ------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one batch: replay the smallest bucket that fits, or eagerly (logged)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self(*args, **kwargs)
        if kwargs or not self._flat_args:
            if kwargs.keys() != self._kw_order.keys():
                raise ConfigError(
                    f"keyword inputs {sorted(kwargs)} do not match the example's {sorted(self._kw_order)}"
                )
            kwargs = {k: kwargs[k] for k in self._kw_order}  # the example's order, as flattened
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != self._in_spec:
                raise ConfigError(f"inputs do not match the example inputs' structure: {spec} vs {self._in_spec}")
        else:
            leaves = args
            if len(leaves) != self._n_leaves:
                raise ConfigError(f"expected {self._n_leaves} inputs, got {len(leaves)}")
        try:
            n = leaves[self._lead].shape[self._lead_dim]
        except (AttributeError, IndexError):
            raise self._bad(leaves, 1) from None
        bucket = self._route[n] if 0 < n <= self.max_bucket else None
        if bucket is None or not bucket.ready:
            return self._slow(bucket, n, leaves, args, kwargs)
        # The hot path: compare, copy, pad, replay, return prebuilt views. Everything else
        # (views per batch size, output slices) was built at capture.
        try:
            for (live, shapes, dtype, device), x in zip(self._hot, leaves):
                if x.shape != shapes[n] or x.dtype is not dtype or x.device != device:
                    raise self._bad(leaves, n)
                live[n].copy_(x)
        except AttributeError:  # a leaf that is not a tensor
            raise self._bad(leaves, n) from None
        size = bucket.size
        if n != size:
            for s in self._batched:
                s.static.narrow(s.batch_dim, n, size - n).fill_(s.pad)
        bucket.replay()
        bucket.replays += 1
        bucket.live_rows += n
        self._sizes[n] += 1
        if self.copy_outputs:
            return self._copy(self._outs[n])
        return self._outs[n]

    def _copy(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out.clone()
        return pytree.tree_map(torch.clone, out)

    def _bad(self, leaves: Sequence[Any], n: int) -> ConfigError:
        for s, x in zip(self.inputs, leaves):
            if not fits(s, x):
                return ConfigError(s.mismatch(x, n))
        sizes = {s.name: x.shape[s.batch_dim] for s, x in zip(self.inputs, leaves) if s.batch_dim is not None}
        return ConfigError(f"batched inputs disagree on the batch size: {sizes}")

    def _slow(self, bucket: Bucket | None, n: int, leaves: Sequence[Any], args: tuple, kwargs: dict) -> Any:
        """Everything off the hot path: validation, first-replay verification, eager fallback."""
        for s, x in zip(self.inputs, leaves):
            if not fits(s, x):
                raise self._bad(leaves, max(n, 1))
        if n < 1:
            raise ConfigError(
                f"batch of size {n} (input {self.inputs[self._lead].name}): a batch needs at least one row"
            )
        for s, x in zip(self.inputs, leaves):
            if s.batch_dim is not None and x.shape[s.batch_dim] != n:
                raise self._bad(leaves, n)
        if not self._captured:
            return self._eager("capture() has not run yet", args, kwargs, n)
        if bucket is None:
            return self._eager(f"batch {n} is above the largest bucket ({self.max_bucket})", args, kwargs, n)
        if bucket.replay is None:
            return self._eager(f"bucket {bucket.size} {bucket.reason}", args, kwargs, n)
        return self._verify_first(bucket, n, leaves, args, kwargs)

    def _eager(self, reason: str, args: tuple, kwargs: dict, n: int) -> Any:
        if self.strict:
            raise AccelGraphError(f"GraphRunner (strict): {reason}")
        if reason not in self._fallbacks:
            log.warning("GraphRunner: running eagerly: %s", reason)
        self._fallbacks[reason] += 1
        self._eager_calls += 1
        self._eager_sizes[n] += 1
        return self.fn(*args, **kwargs)

    def _verify_first(self, bucket: Bucket, n: int, leaves: Sequence[Any], args: tuple, kwargs: dict) -> Any:
        """First replay of a bucket: compare with eager on the same padded inputs."""
        for s, x in zip(self.inputs, leaves):
            s.live[n].copy_(x)
        if n != bucket.size:
            for s in self._batched:
                s.static.narrow(s.batch_dim, n, bucket.size - n).fill_(s.pad)
        bargs, bkwargs = self._bucket_args(bucket.size)
        undo = UndoLog()
        with undo:
            expected = self.fn(*bargs, **bkwargs)
        undo.snapshot_post()
        undo.restore()  # eager's writes undone: replay starts from the same state
        assert bucket.replay is not None
        bucket.replay()
        actual = pytree.tree_unflatten(bucket.out_leaves, self._out_spec)
        diff = compare(actual, expected)
        bucket.verified = True
        if diff is not None:
            undo.reapply()  # keep eager's side effects: its result is the one returned
            bucket.verify_diff = diff
            self._fail(bucket, "disabled", f"disabled by verification: {diff}", None)
            self._build_routes()
            self._fallbacks[f"bucket {bucket.size} {bucket.reason}"] += 1
            self._eager_calls += 1
            self._eager_sizes[n] += 1
            leaves_e, spec = pytree.tree_flatten(expected)
            sliced = [x if d is None else x.narrow(d, 0, n) for x, d in zip(leaves_e, self._out_dims)]
            return pytree.tree_unflatten(sliced, spec)
        bucket.ready = True
        bucket.replays += 1
        bucket.live_rows += n
        self._sizes[n] += 1
        out = self._outs[n]
        return self._copy(out) if self.copy_outputs else out

    # ------------------------------------------------------------------------------------
    # reports
    # ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Per-bucket memory from the allocator and the pool total (JSON-ready; schema
        ``accel_graph.runner.memory/1`` in ``docs/runner.md``)."""
        return memory_report(self)

    def stats(self) -> dict[str, Any]:
        """Replays per bucket, eager fallbacks and why, padding waste (JSON-ready; schema
        ``accel_graph.runner.stats/1`` in ``docs/runner.md``)."""
        return stats(self)

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (not the verification state)."""
        for b in self._buckets:
            b.replays = b.live_rows = 0
        self._fallbacks.clear()
        self._eager_calls = 0
        self._sizes = [0] * (self.max_bucket + 1)
        self._eager_sizes.clear()

    def graph(self, bucket: int) -> Graph | None:
        """The graph serving ``bucket`` (None when it is not captured or was disabled)."""
        for b in self._buckets:
            if b.size == bucket:
                return b.graph if b.replay is not None else None
        raise ConfigError(f"{bucket} is not a bucket of this runner ({self.buckets})")

    @property
    def captured_buckets(self) -> list[int]:
        """Buckets whose graphs serve calls (captured and not disabled)."""
        return [b.size for b in self._buckets if b.replay is not None]

    def __repr__(self) -> str:
        return (f"GraphRunner(buckets={self.buckets}, captured={self.captured_buckets}, "
                f"device={self.device}, compile={self.compile!r})")
