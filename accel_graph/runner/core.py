"""``accel_graph.GraphRunner``: bucketed graph capture for inference servers.

The recipe every serving stack re-implements (``reference/serving-anchors.md`` section 0): a
ladder of batch-size buckets, static inputs sized for the largest, one eager warm-up per bucket,
capture largest-first into one shared pool with Python's GC off, pad each live batch up to the
smallest bucket that fits, replay, slice the outputs; eager above the top bucket. On top of it:
per-bucket memory from the allocator, a memory budget, eager-vs-replay verification of each
bucket's first replay, and eager fallback (logged) instead of aborting.

The runner's whole state is one :class:`~accel_graph.runner.runtime.RunnerRuntime`
(``runner.runtime``, its fixed settings a :class:`~accel_graph.runner.options.RunnerOptions`);
this module builds it (the public constructor, checks in :mod:`.options` and :mod:`.inputs`) and
serves calls on the hot path, :mod:`.serving` serves the rest, :mod:`.capture` captures into it
and :mod:`.reports` reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends import select_backend
from ..errors import ConfigError
from ..graphs.graph import Graph
from .capture import capture_buckets
from .debug import debug_call
from .dynamic import check_spec_dim
from .group import GroupInfo
from .guard import CallGuard
from .inputs import ExampleInputs
from .islands import resolve_islands
from .memory_plan import plan_runner
from .options import RunnerOptions, check_settings, verify_checks
from .reports import memory_report, stats
from .runtime import RunnerRuntime
from .serving import bad_inputs, copied, serve_slow
from .state import StateTable

__all__ = ["GraphRunner"]

log = logging.getLogger("accel_graph")


def _forwarded(name: str, doc: str, *, settable: bool = False) -> property:
    """A runner attribute that reads (and, if ``settable``, writes) field ``name`` of its
    runtime, so the state has one home and the runner's attributes stay as they were."""

    def get(self: GraphRunner) -> Any:
        return getattr(self._runtime, name)

    def set_(self: GraphRunner, value: Any) -> None:
        setattr(self._runtime, name, value)

    return property(get, set_ if settable else None, doc=doc)


class GraphRunner:
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
        max_batch: the largest batch to serve from a graph (needed when ``buckets`` and
            ``dynamic`` are None).
        dynamic: a ``torch.fx.experimental.dynamic_spec`` ShapeVar/IntVar with ``max`` (or the
            TensorSpec of the first batched input): the ladder is the default one over its
            ``min..max`` (:mod:`.dynamic`), so one spec serves torch.compile/export and the runner.
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
        compile, compile_options: as for :class:`~accel_graph.Graph` (``"inductor"``), resolved
            once here (``ACCEL_GRAPH_COMPILE`` read now) and used by every bucket's graph.
        verify: how many replays of each bucket are compared with eager at the padded shape,
            under the per-dtype tolerances of :mod:`accel_graph.foundation.tolerances`: True (default) 2
            (the first replay and the second, which catches host values baked at capture
            that move with state, such as a cache length), an int N: replays 1, 2, 4, ...,
            2**(N-1); False or 0: none. A mismatch disables the bucket (its calls fall back).
            Replays between checks take the slow path; after the last check, the hot path.
            A padded call is also compared with ``fn`` on its live rows alone (no ``state=``):
            padded rows must not change live rows (:mod:`.rows`): the first padded call of
            each bucket is checked. ``rows_independent=True`` skips that check.
        strict: raise instead of falling back to eager (failed capture, verification mismatch,
            batch above the largest bucket).
        memory_budget: bytes the pool may hold; buckets that push it over are captured, measured
            and rolled back, largest first. Exact on the recorder.
        copy_outputs: return copies instead of views into the graphs' static outputs (which the
            next call of the same bucket overwrites).
        progress: show a progress bar during capture; None: only when stderr is a terminal.
        process_group: ``fn`` is one rank's share of a step: the ranks agree (:mod:`.group`).
        state: a factory ``state(bucket_size) -> object`` building per-bucket state (a static KV
            cache, attention-metadata buffers); ``fn`` receives it as the keyword ``state=``
            in warm-up, capture, verification and fallback at that bucket, and
            ``runner.state(bucket)`` returns it (see :mod:`accel_graph.runner.state`).
        fallback: how a bucket that is not serving runs its batches: ``"padded"`` (default:
            at the bucket's padded shape with the bucket's state, what its graph would have
            done) or ``"live"`` (``fn`` on the live batch at its own size). Batches above the
            largest bucket always run at their own size.
        capture: ``"eager"`` (default: ``capture()`` captures every bucket, largest first) or
            ``"lazy"`` (each bucket is captured on its first call; ``capture()`` is optional).
        capture_time_budget: seconds all captures together may take; buckets not captured
            when it is spent are left out (status ``over_time_budget``) and run as fallback.
        share_outputs: every bucket's graph writes its outputs into one region, the largest
            captured bucket's outputs (a copy at the end of each smaller graph; each graph's
            own output memory returns to the pool), so output memory is that of the largest
            bucket, not the sum over buckets. Returned views then stay valid only until the
            next call of *any* bucket (without it: of the same bucket). With lazy capture the
            region is the first bucket captured; larger ones keep their own outputs.
        debug: check the outputs contract: outputs returned by a call must be unchanged when
            the next call starts (else something else wrote into them: another runner in the
            same pool, or the caller), warned and counted in ``stats()``; then they are
            NaN-filled, so code that still reads them after the next call sees NaN.
        islands: code to run as eager islands in every capture of this runner (code capture
            refuses, such as a mixture-of-experts block reading the router's choice on the
            host, runs eagerly between the captured pieces of each graph; see
            :func:`accel_graph.eager_island`). A list of: ``nn.Module`` subclasses (every
            instance, subclasses included), ``nn.Module`` instances, functions (wrapped where
            code looks them up by their own name: module globals, or the class of a method; a
            function the model reaches under another name must be decorated with
            ``eager_island`` where it is defined), or ``"package.module.attr"`` strings naming
            one of these (a function named so is wrapped at exactly that place). The marking
            holds during the runner's captures only, on the capturing thread: replay calls the
            code the capture recorded, and the model is left untouched otherwise
            (:mod:`accel_graph.runner.islands`). Capture with islands runs each piece once for
            real (the island's warm-up); the runner puts back every tensor that writes (a KV
            cache's length), so capture leaves state as the warm-up left it.

    Calls run under ``torch.no_grad()``; ``capture()`` runs ``fn`` eagerly once per bucket
    (warm-up), so state ``fn`` mutates is touched then. Threads: calls are serialised, and
    with ``copy_outputs=False`` one thread may call (:mod:`accel_graph.runner.guard`).

    The backend is routed at construction (:func:`accel_graph.backends.select_backend`, as a
    :class:`~accel_graph.Graph` on the runner's device would be), so ``runner.runtime.backend``
    exists before ``capture()``; routing errors (``BackendUnavailable``) raise here.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Any,
        buckets: Sequence[int] | None = None,
        *,
        max_batch: int | None = None,
        dynamic: Any = None,
        batch_dim: Any = 0,
        pad_value: Any = 0,
        pad_index: Any = None,
        output_batch_dim: Any = 0,
        example_kwargs: Mapping[str, Any] | None = None,
        pool: object | None = None,
        device: torch.device | str | int | None = None,
        compile: str | None = None,
        compile_options: Mapping[str, Any] | None = None,
        verify: bool | int = True,
        strict: bool = False,
        memory_budget: int | None = None,
        copy_outputs: bool = False,
        progress: bool | None = None,
        process_group: Any = None,
        state: Callable[[int], Any] | None = None,
        fallback: str = "padded",
        capture: str = "eager",
        capture_time_budget: float | None = None,
        share_outputs: bool = False,
        debug: bool = False,
        rows_independent: bool = False,
        islands: Sequence[Any] | None = None,
    ) -> None:
        ladder = check_settings(fn, buckets, max_batch, dynamic, memory_budget, fallback, capture,
                                capture_time_budget)
        ex = ExampleInputs.build(example_inputs, example_kwargs, device, batch_dim, pad_value,
                                 pad_index, ladder[-1])
        check_spec_dim(dynamic, ex.inputs)
        # Graphs get the resolved device, never the bare argument: device="cuda" with inputs on
        # cuda:1 must capture on cuda:1, not on whatever device is current.
        backend, routed = select_backend(ex.device)
        device_spec = backend.device_spec(routed)
        checks = verify_checks(verify)
        marked = resolve_islands(islands)
        group = None if process_group is None else GroupInfo.build(process_group, ex.device, capture)
        states = StateTable(state, ex.device)
        # Resolved last, as always: compile=/compile_options errors come after the others.
        options = RunnerOptions.resolve(
            fn=fn, ladder=ladder, output_batch_dim=output_batch_dim, device=ex.device,
            compile=compile, compile_options=compile_options, fallback=fallback,
            capture_mode=capture,
            capture_time_budget=None if capture_time_budget is None else float(capture_time_budget),
            rows_independent=bool(rows_independent), debug=bool(debug), islands=marked,
        )
        self._runtime = RunnerRuntime(
            options=options,
            inputs=ex.inputs,
            examples=ex.examples,
            in_spec=ex.in_spec,
            kw_order=ex.kw_order,
            flat_args=ex.flat_args,
            backend=backend,
            device_spec=device_spec,
            verify=checks,
            strict=bool(strict),
            copy_outputs=bool(copy_outputs),
            memory_budget=memory_budget,
            progress=progress,
            pool=pool,
            group=group,
            states=states,
            share_outputs=bool(share_outputs),
        )
        #: One caller at a time; views of static outputs serve one thread (:mod:`.guard`).
        self._guard = CallGuard()

    @property
    def runtime(self) -> RunnerRuntime:
        """The runner's whole state (settings, static inputs, backend, pool, buckets, routes,
        counters); see :class:`~accel_graph.runner.runtime.RunnerRuntime` for its fields."""
        return self._runtime

    # Settings and structure, kept as attributes of the runner; they live in ``runtime``.
    fn = _forwarded("fn", "The step served (and run on eager fallback).")
    buckets = _forwarded("ladder", "The bucket sizes, ascending.")
    max_bucket = _forwarded("max_bucket", "The largest bucket.")
    device = _forwarded("device", "The runner's device (where inputs must be).")
    inputs = _forwarded("inputs", "The static inputs, one :class:`InputSpec` per input leaf.")
    compile = _forwarded("compile", "``compile=`` of every Graph, as given.")

    @property
    def verify(self) -> int:
        """Replays per bucket compared with eager (``verify=`` as a number; settable)."""
        return self._runtime.verify

    @verify.setter
    def verify(self, value: bool | int) -> None:
        self._runtime.verify = verify_checks(value)

    strict = _forwarded("strict", "Raise instead of falling back to eager.", settable=True)
    copy_outputs = _forwarded("copy_outputs", "Return copies, not views into static outputs.", settable=True)
    memory_budget = _forwarded("memory_budget", "Bytes the shared pool may hold during capture.", settable=True)
    progress = _forwarded("progress", "Show a capture progress bar (None: on a terminal).", settable=True)

    # ------------------------------------------------------------------------------------
    # capture
    # ------------------------------------------------------------------------------------
    def capture(self) -> GraphRunner:
        """Warm up and capture every bucket, largest first, into one shared pool.

        A bucket whose capture fails (``CaptureError``, out of memory) or that pushes the pool
        over ``memory_budget`` is left out with its reason (``strict=True`` raises instead); its
        batches run eagerly. Raises AccelGraphError on a second call, ConfigError when the budget
        cannot hold even the smallest bucket, or when ``fn`` returns something other than
        tensors. Returns ``self``. (:func:`~accel_graph.runner.capture.capture_buckets`.)
        """
        guard = self._guard
        guard.enter(False, "capture()")
        try:
            capture_buckets(self._runtime)
        finally:
            guard.exit()
        return self

    # ------------------------------------------------------------------------------------
    # serving
    # ------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one batch: replay the smallest bucket that fits, or eagerly (logged).

        Calls from several threads are serialised; with ``copy_outputs=False`` only the thread
        that called first may call (AccelGraphError otherwise; see :mod:`.guard`)."""
        rt = self._runtime
        guard = self._guard
        guard.enter(not rt.copy_outputs)
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return self._call(rt, args, kwargs)
            return self._call(rt, args, kwargs)
        finally:
            guard.exit()

    def _call(self, rt: RunnerRuntime, args: tuple, kwargs: dict) -> Any:
        if rt.options.debug:
            return debug_call(rt, self._serve, args, kwargs)
        return self._serve(args, kwargs)

    def _serve(self, args: tuple, kwargs: dict) -> Any:
        rt = self._runtime
        if kwargs or not rt.flat_args:
            if kwargs.keys() != rt.kw_order.keys():
                raise ConfigError(
                    f"keyword inputs {sorted(kwargs)} do not match the example's {sorted(rt.kw_order)}"
                )
            kwargs = {k: kwargs[k] for k in rt.kw_order}  # the example's order, as flattened
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if spec != rt.in_spec:
                raise ConfigError(f"inputs do not match the example inputs' structure: {spec} vs {rt.in_spec}")
        else:
            leaves = args
            if len(leaves) != rt.n_leaves:
                raise ConfigError(f"expected {rt.n_leaves} inputs, got {len(leaves)}")
        try:
            n = leaves[rt.lead].shape[rt.lead_dim]
        except (AttributeError, IndexError):
            raise bad_inputs(rt, leaves, 1) from None
        bucket = rt.route[n] if 0 < n <= rt.max_bucket else None
        if bucket is None or not bucket.ready:
            return serve_slow(rt, n, leaves, args, kwargs)
        # The hot path: compare, copy, pad, replay, return prebuilt views. Everything else
        # (views per batch size, output slices) was built at capture.
        try:
            for (live, shapes, dtype, device), x in zip(rt.hot, leaves):
                if x.shape != shapes[n] or x.dtype is not dtype or x.device != device:
                    raise bad_inputs(rt, leaves, n)
                live[n].copy_(x)
        except AttributeError:  # a leaf that is not a tensor
            raise bad_inputs(rt, leaves, n) from None
        size = bucket.size
        if n != size:
            for s in rt.batched:
                s.static.narrow(s.batch_dim, n, size - n).fill_(s.pad)
        bucket.replay()
        bucket.replays += 1
        bucket.live_rows += n
        rt.graph_sizes[n] += 1
        if rt.copy_outputs:
            return copied(rt.outs[n])
        return rt.outs[n]

    # ------------------------------------------------------------------------------------
    # buckets and their state
    # ------------------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        """The bucket a live batch of ``n`` rows is served by: the smallest bucket that fits,
        whether its graph serves or its fallback runs; None above the largest bucket (that
        batch runs eagerly at its own size). ConfigError for ``n < 1``, and above the ladder
        with ``strict=True`` (such a call would raise)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise ConfigError(f"bucket_for(n): n must be an int batch size, got {n!r}")
        rt = self._runtime
        b = rt.bucket_for(n)
        if b is None and rt.strict:
            raise ConfigError(
                f"bucket_for({n}): batch {n} is above the largest bucket ({rt.max_bucket}) and "
                f"the runner is strict, so such a call raises; add a bucket of at least {n}"
            )
        return None if b is None else b.size

    def state(self, bucket: int) -> Any:
        """The state object of ``bucket`` (built by the ``state=`` factory on first use), the
        one its graph and its fallback read and write. ConfigError without a factory, or when
        ``bucket`` is not on the ladder (``bucket_for(n)`` names the bucket of a batch)."""
        rt = self._runtime
        assert rt.states is not None
        if not rt.states.enabled:
            raise ConfigError("this runner has no per-bucket state; pass GraphRunner(..., state=factory)")
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ConfigError(f"state(bucket): bucket must be a positive int, got {bucket!r}")
        if bucket <= rt.max_bucket and bucket not in rt.options.ladder:
            raise ConfigError(
                f"state({bucket}): {bucket} is not a bucket of this runner ({rt.options.ladder}); "
                f"runner.bucket_for({bucket}) = {self.bucket_for(bucket)} is the bucket that "
                f"serves a batch of {bucket}"
            )
        return rt.states.get(bucket)

    # ------------------------------------------------------------------------------------
    # reports
    # ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Per-bucket memory from the allocator and the pool total (JSON-ready; schema
        ``accel_graph.runner.memory/1`` in ``docs/runner.md``)."""
        return memory_report(self._runtime)

    def plan_memory(self, trace: str | None = None, *, alloc_conf: str | None = None) -> dict[str, Any]:
        """The memory this runner's graphs will take, predicted without capturing (JSON-ready;
        schema ``accel_graph.runner.memory-plan/1`` in ``docs/runner.md`` "Memory plan").

        Records every bucket on metadata, largest first into one planned pool, and books each
        allocation on the allocator engine under the target device's rules: no capture, no
        kernel, no device memory; the runner is unchanged (``memory_report()`` still shows no
        bucket captured). ``trace``: also write the planned pool's allocations as a
        memory-snapshot trace (``accel-alloc tune`` ranks settings on it). ``alloc_conf``: plan
        under this allocator config string instead of the environment's. Raises the
        ``CaptureError`` capture would raise (a refused op, a data-dependent size), naming the
        op and its line. (:func:`~accel_graph.runner.memory_plan.plan_runner`.)
        """
        guard = self._guard
        guard.enter(False, "plan_memory()")
        try:
            return plan_runner(self._runtime, trace=trace, alloc_conf=alloc_conf)
        finally:
            guard.exit()

    def stats(self) -> dict[str, Any]:
        """Replays per bucket, eager fallbacks and why, padding waste (JSON-ready; schema
        ``accel_graph.runner.stats/1`` in ``docs/runner.md``)."""
        return stats(self._runtime)

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (not the verification state)."""
        self._runtime.reset_counters()

    def graph(self, bucket: int) -> Graph | None:
        """The graph serving ``bucket`` (None when it is not captured or was disabled)."""
        b = self._runtime.bucket(bucket)
        return b.graph if b.replay is not None else None

    @property
    def captured_buckets(self) -> list[int]:
        """Buckets whose graphs serve calls (captured and not disabled)."""
        return [b.size for b in self._runtime.buckets if b.replay is not None]

    def __repr__(self) -> str:
        return (f"GraphRunner(buckets={self.buckets}, captured={self.captured_buckets}, "
                f"device={self.device}, compile={self.compile!r})")
