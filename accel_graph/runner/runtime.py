"""Everything one :class:`~accel_graph.runner.GraphRunner` holds, in one record.

:class:`RunnerRuntime` is the runner's whole state: its settings, the static inputs, the
backend, the shared pool, one :class:`Bucket` per batch size, the per-batch-size routes the hot
path reads, and the counters behind ``stats()``. The modules of the runner are functions over
it: ``GraphRunner.__init__`` (:mod:`.core`) fills it, :func:`~.capture.capture_buckets` captures
into it, the serving path (:mod:`.core`) reads and counts in it, and :mod:`.reports` turns it into
JSON. A runner exposes it as ``runner.runtime``.

Named *runtime*, not *state*: "state" is reserved for the per-bucket user state a runner may
carry (``runner.state(bucket)``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError
from .inputs import InputSpec
from .state import StateTable

if TYPE_CHECKING:
    from ..backends import Backend, DeviceSpec
    from ..graphs.graph import Graph
    from .group import GroupInfo

__all__ = ["Bucket", "RunnerRuntime"]


@dataclass(eq=False)
class Bucket:
    """One bucket: its graph, static outputs and counters. ``ready`` gates the hot path."""

    size: int
    status: str = "pending"  # pending|captured|failed|over_budget|over_time_budget|disabled
    reason: str | None = None  # why it is not captured, or was disabled
    graph: Graph | None = None
    replay: Callable[[], None] | None = None  # the graph's replay; None: the bucket is not serving
    ready: bool = False  # captured and verified (or verify=False)
    verified: bool = False  # a replay of it was compared with eager
    checks: int = 0  # replays compared with eager and found equal
    out_leaves: list[torch.Tensor] = field(default_factory=list)  # static outputs, flattened
    capture_ms: float | None = None  # capture wall time, compile_ms included
    compile_ms: float | None = None  # of capture_ms, compiling (compile="inductor"); else None
    compile_cache: str | None = None  # "hit" | "miss" | "fallback" (compiled); else None
    incremental_bytes: int | None = None  # what the graph added to the shared pool
    standalone_bytes: int | None = None  # what it would need in a pool of its own
    pool_after_bytes: int | None = None  # the pool's reserved bytes after its capture
    replays: int = 0  # graph calls served (stats counter)
    live_rows: int = 0  # rows of real work in those calls (stats counter)
    verify_diff: str | None = None  # the mismatch that disabled it
    rows_checked: bool = False  # no live-rows check left: passed, or none applies (.rows)
    mixes_rows: bool = False  # disabled because padded rows changed live rows: fallback is live
    captured_at_call: int | None = None  # calls served before its capture (0: before serving)
    output_bytes: int | None = None  # bytes of its static outputs


@dataclass(eq=False, slots=True)
class RunnerRuntime:
    """The state of one GraphRunner; every field is public and documented.

    Given at construction: ``fn`` .. ``group`` (``pool`` is filled by capture when None; the
    behaviour flags ``verify`` .. ``progress`` may be changed later). Derived at construction:
    ``max_bucket``, ``buckets``, ``n_leaves``, ``lead``, ``lead_dim``, ``batched``, ``hot``.
    Filled by capture: ``captured``, ``route``, ``outs``, ``out_spec``, ``out_dims`` and the
    buckets' fields. Counted by calls: ``eager_calls``, ``fallbacks``, ``graph_sizes``,
    ``eager_sizes`` and the buckets' ``replays``/``live_rows``.

    Raises ConfigError when no input has a batch dimension.
    """

    #: The step served, ``fn(*args, **kwargs)``; also what runs on eager fallback.
    fn: Callable[..., Any]
    #: The bucket sizes, ascending (``runner.buckets``).
    ladder: list[int]
    #: One static input per input leaf, in pytree order of ``(args, kwargs)``.
    inputs: list[InputSpec]
    #: The example leaves (detached), whose rows seed each bucket's warm-up.
    examples: list[torch.Tensor]
    #: The pytree structure of ``(args, kwargs)`` every call must match.
    in_spec: pytree.TreeSpec
    #: The example's keyword names, in the order they were flattened.
    kw_order: dict[str, None]
    #: True when the inputs are positional tensors only: a call's args are the leaves as they are.
    flat_args: bool
    #: The ``output_batch_dim`` argument, broadcast against the outputs at capture.
    output_batch_dim: Any
    #: The runner's device: where inputs must be, and the ``device=`` of every Graph it makes.
    device: torch.device
    #: The backend the router picked for ``device`` at construction.
    backend: Backend
    #: ``backend``'s description of the routed device (the shared pool is made for it).
    device_spec: DeviceSpec
    #: ``compile=`` for every Graph (None or ``"inductor"``).
    compile: str | None
    #: Replays per bucket compared with eager (1, 2, 4, ...; 0: none).
    verify: int
    #: Raise instead of falling back to eager.
    strict: bool
    #: Return copies instead of views into the static outputs.
    copy_outputs: bool
    #: Bytes the shared pool may hold (None: no limit).
    memory_budget: int | None
    #: Show a progress bar during capture (None: when stderr is a terminal).
    progress: bool | None
    #: The shared pool handle; the one given, else created by capture.
    pool: object | None = None
    #: ``compile_options=`` for every Graph, as given (checked at construction).
    compile_options: Any = None
    #: The process group the ranks agree over (``process_group=``), or None in one process.
    group: GroupInfo | None = None
    #: Per-bucket user state (``state=`` factory), passed to ``fn`` as ``state=``.
    states: StateTable | None = None
    #: How a bucket that is not serving runs its batches: ``"padded"`` (at the bucket's padded
    #: shape, with the bucket's state) or ``"live"`` (at the batch's own size).
    fallback: str = "padded"
    #: ``"eager"``: ``capture()`` captures every bucket; ``"lazy"``: each bucket is captured on
    #: its first call.
    capture_mode: str = "eager"
    #: Seconds lazy capture may spend in all (None: no limit); buckets not captured when it is
    #: spent run as fallback.
    capture_time_budget: float | None = None
    #: Buckets' outputs share one region, sized by the first bucket captured.
    share_outputs: bool = False
    #: The shared output region (the first captured bucket's static outputs, flattened).
    output_region: list[torch.Tensor] | None = None
    #: The caller declared ``fn`` row-independent: verification skips the live-rows check
    #: (:mod:`.rows`).
    rows_independent: bool = False
    #: Debug mode: warn when a call's outputs are still referenced at the next call.
    debug: bool = False
    #: Weak references to the outputs returned by the last call (debug mode only).
    last_returned: list[Any] = field(default_factory=list)
    #: Calls at which outputs of the previous call were still referenced (debug mode).
    stale_output_warnings: int = 0

    #: The largest bucket, ``ladder[-1]`` (a field: the hot path reads it every call).
    max_bucket: int = field(init=False)
    #: One record per bucket, ascending size.
    buckets: list[Bucket] = field(init=False)
    #: The inputs with a batch dimension (the ones padded).
    batched: list[InputSpec] = field(init=False)
    #: How many input leaves a call passes (``len(inputs)``).
    n_leaves: int = field(init=False)
    #: Index in ``inputs`` of the first batched input, whose batch size is the call's.
    lead: int = field(init=False)
    #: Its batch dimension.
    lead_dim: int = field(init=False)
    #: Per input, what the hot path compares and copies into:
    #: ``(live views by batch size, their shapes, dtype, device)``.
    hot: list[tuple[list[torch.Tensor], list[torch.Size], torch.dtype, torch.device]] = field(init=False)

    #: Whether capture ran (even if every bucket was left out).
    captured: bool = False
    #: ``route[n]``: the bucket serving live batch size n (1 <= n <= max_bucket; None before
    #: capture, and for n below a bucket whose live-rows check is pending: the slow path).
    route: list[Bucket | None] = field(init=False)
    #: Live batch size -> the serving bucket's outputs narrowed to n rows, prebuilt.
    outs: dict[int, Any] = field(default_factory=dict)
    #: The pytree structure of ``fn``'s outputs (from the first bucket captured).
    out_spec: pytree.TreeSpec | None = None
    #: Per output leaf, its batch dimension (None: returned whole).
    out_dims: list[int | None] = field(default_factory=list)

    #: Calls served eagerly.
    eager_calls: int = 0
    #: Eager fallback reason -> count.
    fallbacks: Counter[str] = field(default_factory=Counter)
    #: ``graph_sizes[n]``: graph calls at live batch size n (a list: cheap on the hot path).
    graph_sizes: list[int] = field(init=False)
    #: Live batch size -> eager calls at that size.
    eager_sizes: Counter[int] = field(default_factory=Counter)
    #: Seconds spent capturing (warm-up and capture of every bucket captured so far).
    capture_seconds: float = 0.0
    #: Of ``capture_seconds``, seconds spent compiling (``compile="inductor"``).
    compile_seconds: float = 0.0

    def __post_init__(self) -> None:
        from ..foundation.compile_options import resolve_compile

        # Bad compile=/compile_options fail here, not at the first (lazy) capture: the same
        # resolution and messages as Graph(...).
        resolve_compile(self.compile, self.compile_options)
        self.max_bucket = self.ladder[-1]
        self.buckets = [Bucket(b) for b in self.ladder]
        for s in self.inputs:  # views per live batch size, so a call slices nothing
            s.live = [s.view(n) for n in range(self.max_bucket + 1)]
        self.n_leaves = len(self.inputs)
        self.batched = [s for s in self.inputs if s.batch_dim is not None]
        if not self.batched:
            raise ConfigError("no input has a batch dimension (batch_dim is None everywhere)")
        self.lead = next(k for k, s in enumerate(self.inputs) if s.batch_dim is not None)
        lead_dim = self.inputs[self.lead].batch_dim
        assert lead_dim is not None
        self.lead_dim = lead_dim
        self.hot = [(s.live, [v.shape for v in s.live], s.dtype, s.device) for s in self.inputs]
        self.route = [None] * (self.max_bucket + 1)
        self.graph_sizes = [0] * (self.max_bucket + 1)
        if self.states is None:
            self.states = StateTable(None, self.device)

    def bucket(self, size: int) -> Bucket:
        """The record of bucket ``size``; ConfigError when it is not on the ladder."""
        for b in self.buckets:
            if b.size == size:
                return b
        raise ConfigError(f"{size} is not a bucket of this runner ({self.ladder})")

    def bucket_args(self, size: int) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for ``fn`` at bucket ``size``: views of the static inputs, plus
        ``state=`` the bucket's state when the runner has a state factory."""
        args, kwargs = pytree.tree_unflatten([s.view(size) for s in self.inputs], self.in_spec)
        assert self.states is not None
        if self.states.enabled:
            kwargs = {**kwargs, **self.states.kwargs(size)}
        return args, kwargs

    def bucket_for(self, n: int) -> Bucket | None:
        """The bucket a live batch of ``n`` rows maps to (the smallest that fits), serving or
        not; None above the largest bucket."""
        if n < 1:
            raise ConfigError(f"batch size must be at least 1, got {n}")
        if n > self.max_bucket:
            return None
        for b in self.buckets:
            if b.size >= n:
                return b
        return None  # unreachable: n <= max_bucket

    def pool_bytes(self) -> tuple[int | None, int | None]:
        """(reserved, peak reserved) bytes of the shared pool, where the backend tells."""
        stats = self.backend.pool_stats(self.pool) if self.pool is not None else None
        if stats is None:
            return None, None
        return stats.reserved_bytes, stats.extra.get("peak_reserved_bytes")

    def build_routes(self) -> None:
        """Precompute, per live batch size, the serving bucket and its sliced outputs; rerun
        whenever a bucket starts or stops serving."""
        self.outs.clear()
        k = 0
        for n in range(1, self.max_bucket + 1):
            while self.buckets[k].size < n:
                k += 1
            bucket = self.buckets[k]
            # A padded size waits on the slow path for the bucket's live-rows check (.rows).
            self.route[n] = bucket if bucket.rows_checked or n == bucket.size else None
            if bucket.replay is not None:
                self.outs[n] = self.sliced_outputs(bucket, n)

    def sliced_outputs(self, bucket: Bucket, n: int) -> Any:
        """``bucket``'s static outputs narrowed to ``n`` rows, in ``fn``'s output structure."""
        assert self.out_spec is not None
        views = [x if d is None else x.narrow(d, 0, n) for x, d in zip(bucket.out_leaves, self.out_dims)]
        if self.out_spec.num_leaves == 1 and self.out_spec.is_leaf():
            return views[0]
        return pytree.tree_unflatten(views, self.out_spec)

    def calls_served(self) -> int:
        """Calls served (graph and eager) since construction or the last ``reset_stats()``."""
        return sum(b.replays for b in self.buckets) + self.eager_calls

    def reset_counters(self) -> None:
        """Zero the counters behind ``stats()`` (not the verification state)."""
        for b in self.buckets:
            b.replays = b.live_rows = 0
        self.fallbacks.clear()
        self.eager_calls = 0
        self.graph_sizes = [0] * (self.max_bucket + 1)
        self.eager_sizes.clear()
