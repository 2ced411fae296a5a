"""Executors that run the serving engine's flat steps on the bundled decoder, eagerly or from
graphs captured per token bucket (:class:`~accel_graph.serving.step.StepExecutor`).

Both run the same model code, :meth:`Decoder.flat_forward
<accel_graph.models.decoder.Decoder.flat_forward>`: the token-wise parts (projections, norms,
rotary, MLP, LM head on the sampled rows) and, per layer, attention over the slot KV cache as an
eager island (:mod:`accel_graph.models.slot_attention`). :class:`EagerExecutor` calls it under
``torch.inference_mode()`` (the baseline); :class:`GraphExecutor` serves it from a
:class:`~accel_graph.GraphRunner` bucketed on the step's number of tokens (docs/runner.md
"Token buckets": flat inputs with ``batch_dim=0``): tokens and positions are padded up to the
bucket, the attention metadata lives in
static tensors the graphs read by reference, and the islands run with the live lengths. Either
works over a :class:`~accel_graph.models.Decoder` or one rank's
:class:`~accel_graph.models.TPDecoder` (every rank runs the same steps).

Per step: one pass over the segments builds the metadata (:meth:`SlotAttentionMeta.fill`), one
model call, one ``argmax`` over the sampled rows, one host read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..errors import AccelGraphError, ConfigError
from ..graphs.device_queries import graph_pool_handle
from ..models.decoder import Decoder, DecoderConfig
from ..models.slot_attention import SlotAttentionMeta, check_step
from ..runner import GraphRunner
from ..runner.memory_plan import plan_shared_pool
from .full_graphs import ChunkGraphs, DecodeGraphs, is_decode_only
from .step import StepBatch

__all__ = ["GRAPH_MODES", "EagerExecutor", "GraphExecutor", "greedy_step", "serving_config", "token_ladder"]

log = logging.getLogger("accel_graph")

#: Default per-step token budget of the executors.
DEFAULT_MAX_TOKENS = 64


def serving_config(**overrides: Any) -> DecoderConfig:
    """The bundled decoder sized for the serving benchmark on a small CPU: 4 layers of width 32
    (2 heads of 16, MLP 96), a 256-token context and 16 slots (``max_batch``). Narrow on
    purpose: on a CPU a graph removes dispatch overhead, not arithmetic, so a model whose
    matmuls dominate (width 128 at 16 tokens per step) gains little, as a GPU decode step
    dominated by launches gains much. ``overrides`` replace fields (``max_batch=32``)."""
    base: dict[str, Any] = {"dim": 32, "n_heads": 2, "mlp_hidden": 96, "n_layers": 4,
                            "max_seq": 256, "max_batch": 16}
    base.update(overrides)
    return DecoderConfig(**base)


def token_ladder(max_tokens: int) -> list[int]:
    """The default token buckets up to ``max_tokens``: 4, 8, 16, 32, ... (powers of two), then
    ``max_tokens`` itself (decode-only steps of a few requests pad little; a step with a prompt
    chunk pads at most to twice its size). Few buckets: each is compiled on capture."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be a positive int, got {max_tokens!r}")
    ladder, b = [], 4
    while b < max_tokens:
        ladder.append(b)
        b *= 2
    ladder.append(max_tokens)
    return ladder


def greedy_step(model: Decoder, meta: SlotAttentionMeta, tokens: torch.Tensor,
                positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The step both executors run: :meth:`Decoder.flat_forward` and the greedy choice on the
    sampled rows (``[len(rows)]`` int64), so the graph's output is the tokens themselves and
    the host reads a handful of ints, not the logits."""
    return model.flat_forward(tokens, positions, rows, meta).argmax(dim=-1)


def _build_model(config: DecoderConfig, num_slots: int | None, process_group: Any,
                 tensor_parallel: bool, collective: str) -> Decoder:
    if num_slots is not None:
        config = dataclasses.replace(config, max_batch=num_slots)
    model = Decoder(config)
    if tensor_parallel:
        from ..models.tp_decoder import TPDecoder

        model = TPDecoder(model, process_group, collective=collective)
    return model


class _FlatExecutor:
    """What both executors share: sizes, the metadata and the host side of a step."""

    kind = "?"

    def __init__(self, model: Decoder, max_tokens: int, max_segments: int | None) -> None:
        if not isinstance(model, Decoder):
            raise ConfigError(f"an executor runs a bundled Decoder or TPDecoder, got {type(model).__name__}")
        cfg = model.config
        self.model = model
        self.num_slots = cfg.max_batch
        self.max_seq = cfg.max_seq
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.max_segments = self.num_slots if max_segments is None else max_segments
        if not 1 <= self.max_segments <= self.num_slots:
            raise ConfigError(
                f"max_segments={max_segments} must be in 1..num_slots={self.num_slots} (a step "
                f"carries at most one segment per live request)")
        self.meta: SlotAttentionMeta = model.flat_metadata(max_tokens, self.max_segments)
        self.steps = 0
        self.tokens_run = 0

    def _fill(self, batch: StepBatch) -> None:
        segs = batch.segments
        if not isinstance(batch, StepBatch) or not segs:
            raise ValueError(f"run() takes a StepBatch with at least one segment, got {batch!r}")
        self.meta.fill([s.slot for s in segs], [s.start for s in segs],
                       [s.tokens for s in segs], [s.sample for s in segs])

    def _tokens(self, chosen: torch.Tensor) -> list[int]:
        n = self.meta.num_samples
        # The one host read of the step.
        return chosen[:n].tolist() if n else []

    def _base_facts(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_slots": self.num_slots, "max_seq": self.max_seq,
                "max_tokens": self.max_tokens, "max_segments": self.max_segments,
                "steps": self.steps, "tokens": self.tokens_run,
                "tensor_parallel": getattr(self.model, "world_size", None)}


class EagerExecutor(_FlatExecutor):
    """Runs each step eagerly (under ``torch.inference_mode()``): the baseline.

    Args:
        model: a :class:`Decoder` (or a :class:`TPDecoder` shard); its ``max_batch`` is the
            number of slots, its ``max_seq`` the longest request.
        max_tokens: the most tokens one step may carry.
        max_segments: the most segments one step may carry (default: the number of slots).
    """

    kind = "eager"

    def __init__(self, model: Decoder, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_segments: int | None = None) -> None:
        super().__init__(model, max_tokens, max_segments)

    @classmethod
    def from_config(cls, config: DecoderConfig, *, num_slots: int | None = None,
                    process_group: Any = None, tensor_parallel: bool = False,
                    collective: str = "c10d", **kwargs: Any) -> EagerExecutor:
        """Build the model from ``config`` with ``num_slots`` slots (default: its
        ``max_batch``), sharded over ``process_group`` when ``tensor_parallel``."""
        model = _build_model(config, num_slots, process_group, tensor_parallel, collective)
        return cls(model, **kwargs)

    def run(self, batch: StepBatch) -> list[int]:
        """Run one step; the greedy next token of each sampled segment, in segment order."""
        self._fill(batch)
        meta = self.meta
        n = meta.num_tokens
        with torch.inference_mode():
            chosen = greedy_step(self.model, meta, meta.tok_id[:n], meta.tok_pos[:n],
                                 meta.sample_rows[:max(meta.num_samples, 1)])
            out = self._tokens(chosen)
        self.steps += 1
        self.tokens_run += n
        return out

    def describe(self) -> dict[str, Any]:
        """Kind, sizes and counters (JSON-ready)."""
        return {**self._base_facts(), "buckets": None, "bucket_use": None, "compile": None,
                "eager_fallbacks": [], "pool_bytes": None}


#: The graph modes of :class:`GraphExecutor` (vLLM's names where they mean the same).
GRAPH_MODES = ("piecewise", "full_and_piecewise", "full")


class GraphExecutor(_FlatExecutor):
    """Runs each step from captured graphs, in one of three modes (``graphs=``, docs/serving.md
    "Graph modes"; all graphs share one pool):

    - ``"piecewise"``: every step from the graphs captured per token bucket (a
      :class:`GraphRunner` over the flat step, docs/runner.md "Token buckets"), its attention
      islands run eagerly with the live lengths;
    - ``"full_and_piecewise"`` (vLLM's default): decode-only steps from whole-step graphs with
      attention inside (:class:`~accel_graph.serving.full_graphs.DecodeGraphs`), the rest
      piecewise;
    - ``"full"`` (the default): every step from whole-step graphs, part by part: its one-token
      segments in one decode graph, each prompt chunk in a chunk graph
      (:class:`~accel_graph.serving.full_graphs.ChunkGraphs`); the token-bucket graphs are not
      captured. A chunk no chunk graph can pad (it fills its row to ``max_seq`` from position 0)
      is served eagerly.

    Args:
        model: a :class:`Decoder` (or one rank's :class:`TPDecoder`: pass ``process_group``
            too, and run the same steps on every rank).
        max_tokens: the most tokens one step may carry; the largest bucket.
        buckets: the token buckets (default :func:`token_ladder` of ``max_tokens``); the
            largest must equal ``max_tokens``.
        max_segments: the most segments one step may carry (default: the number of slots).
        compile: ``None`` (interpreted replay) or ``"inductor"`` (compiled replay).
        compile_options: passed to the runner (default with ``compile``: ``{"replay":
            "compiled"}``).
        verify: the runner's replay verification (``True``: the first two replays of each
            bucket are compared with eager).
        process_group: the tensor-parallel group (the runner agrees on buckets across ranks).
        capture: capture every bucket now (default), or leave it to :meth:`capture`.
        graphs: the mode (above).
        kv_buckets: the whole-step graphs' key extents (default
            :func:`~accel_graph.serving.full_graphs.kv_ladder`).
        chunk_buckets: the chunk graphs' token buckets (default
            :func:`~accel_graph.serving.full_graphs.chunk_ladder`).

    ``runner`` is the token-bucket :class:`GraphRunner` (``runner.memory_report()``: the pool
    is shared, so its pool figures count every graph); ``decode`` and ``chunk`` the
    whole-step graph families (None where the mode has none); :meth:`runners` those captured.
    A step the graphs cannot serve runs eagerly (the runner's fallback, logged once per
    reason); a replay that raises is served eagerly too (one process only: with a process
    group the error propagates, as the other ranks' collectives could not pair), logged once.
    """

    kind = "graph"

    def __init__(self, model: Decoder, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 buckets: list[int] | None = None, max_segments: int | None = None,
                 compile: str | None = "inductor", compile_options: dict[str, Any] | None = None,
                 verify: bool | int = True, process_group: Any = None,
                 capture: bool = True, graphs: str = "full",
                 kv_buckets: list[int] | None = None,
                 chunk_buckets: list[int] | None = None) -> None:
        super().__init__(model, max_tokens, max_segments)
        if graphs not in GRAPH_MODES:
            raise ConfigError(f"graphs={graphs!r} must be one of {GRAPH_MODES}")
        for name, value, modes in (("kv_buckets", kv_buckets, ("full_and_piecewise", "full")),
                                   ("chunk_buckets", chunk_buckets, ("full",))):
            if value is not None and graphs not in modes:
                raise ConfigError(f"{name}= sets graphs that graphs={graphs!r} does not build "
                                  f"(it applies to {' and '.join(repr(m) for m in modes)})")
        self.graphs = graphs
        ladder = token_ladder(max_tokens) if buckets is None else sorted(set(buckets))
        if not ladder or ladder[-1] != max_tokens:
            raise ConfigError(
                f"buckets={buckets} must end at max_tokens={max_tokens} (the largest step a "
                f"graph serves); add {max_tokens}")
        self.compile_mode = compile
        if compile is not None and compile_options is None:
            # Compiled, not "auto": a graph with islands would spend its first 12 replays timing
            # the interpreted program too, and on this model compiled replay is the faster one
            # (tools/bench_flat_step.py --replay interpreted|compiled).
            compile_options = {"replay": "compiled"}
        self.process_group = process_group
        self._fallback_reasons: dict[str, int] = {}
        meta, model_ = self.meta, model
        sample_rows = meta.sample_rows

        def flat_step(tokens: torch.Tensor, positions: torch.Tensor,
                      rows: torch.Tensor) -> torch.Tensor:
            return greedy_step(model_, meta, tokens, positions, rows)

        self._sample_rows = sample_rows
        example = (meta.tok_id[:1], meta.tok_pos[:1], sample_rows)
        # One pool for every graph: they never run at once, so they share it.
        self.pool = graph_pool_handle(meta.buffer.device)
        options = {"compile": compile, "compile_options": compile_options, "verify": verify,
                   "process_group": process_group, "pool": self.pool}
        self.runner = GraphRunner(
            flat_step, example, buckets=ladder, batch_dim=(0, 0, None), output_batch_dim=None,
            progress=False, **options)
        self.decode: DecodeGraphs | None = (
            None if graphs == "piecewise" else DecodeGraphs(model, kv_buckets, options))
        self.chunk: ChunkGraphs | None = (
            ChunkGraphs(model, max_tokens, chunk_buckets, kv_buckets, options)
            if graphs == "full" else None)
        self.captured = False
        if capture:
            self.capture()

    @classmethod
    def from_config(cls, config: DecoderConfig, *, num_slots: int | None = None,
                    process_group: Any = None, tensor_parallel: bool = False,
                    collective: str = "c10d", **kwargs: Any) -> GraphExecutor:
        """Build the model from ``config`` with ``num_slots`` slots (default: its
        ``max_batch``), sharded over ``process_group`` when ``tensor_parallel``, and capture."""
        model = _build_model(config, num_slots, process_group, tensor_parallel, collective)
        return cls(model, process_group=process_group if tensor_parallel else None, **kwargs)

    def capture(self) -> GraphExecutor:
        """Capture the mode's graphs (each runner largest bucket first). Capture runs empty
        steps or rows that are not live, so it writes nothing into the KV cache. Returns
        ``self``."""
        if self.captured:
            raise AccelGraphError("this executor's graphs are already captured")
        self.meta.clear()
        for runner in self.runners():
            runner.capture()
        self.captured = True
        return self

    def plan_memory(self, trace: str | None = None) -> dict[str, Any]:
        """The memory plan of every graph of this executor in its one shared pool, before
        capture (:func:`~accel_graph.runner.memory_plan.plan_shared_pool`: schema
        ``accel_graph.runner.memory-plan/1``, plus ``runners``); captures nothing."""
        return plan_shared_pool(self.runners(), trace=trace)

    def memory_report(self) -> dict[str, Any]:
        """The first captured runner's ``memory_report()`` (schema
        ``accel_graph.runner.memory/1``): its pool figures are the executor's one shared pool,
        every graph counted; its buckets are that runner's."""
        return self.runners()[0].memory_report()

    def runners(self) -> list[GraphRunner]:
        """The runners the mode captures, in capture order: the token-bucket one (not in
        ``"full"``), the chunk graphs', the decode graphs' (widest key extent first)."""
        out = [] if self.graphs == "full" else [self.runner]
        for family in (self.chunk, self.decode):
            if family is not None:
                out += family.ordered_runners()
        return out

    def run(self, batch: StepBatch) -> list[int]:
        """Run one step; the greedy next token of each sampled segment, in segment order."""
        segs = batch.segments if isinstance(batch, StepBatch) else ()
        decode = self.decode
        if decode is None or not segs:
            return self._run_flat(batch)
        decode_only = is_decode_only(segs)
        if not decode_only and self.chunk is None:  # full_and_piecewise: a step with a chunk
            return self._run_flat(batch)
        # The whole step is checked before any part of it runs (the flat path's fill does it).
        check_step([s.slot for s in segs], [s.start for s in segs], [len(s.tokens) for s in segs],
                   max_tokens=self.max_tokens, max_segments=self.max_segments,
                   max_seq=self.max_seq, num_slots=self.num_slots)
        if decode_only:
            return self._run_parts(batch, segs, [])
        assert self.chunk is not None
        decs = [s for s in segs if len(s.tokens) == 1]
        chunks = [s for s in segs if len(s.tokens) > 1]
        if not all(self.chunk.can_serve(s) for s in chunks):
            self._note_fallback("a prompt chunk fills its row from position 0 to max_seq, so no "
                                "chunk graph can pad it")
            self._fill(batch)
            return self._finish(self._run_flat_eager(), batch.num_tokens)
        return self._run_parts(batch, decs, chunks)

    def _run_parts(self, batch: StepBatch, decs: list[Any], chunks: list[Any]) -> list[int]:
        """Serve a step part by part from whole-step graphs: its one-token segments ``decs`` in
        one decode graph, then each chunk of ``chunks`` in a chunk graph."""
        assert self.decode is not None
        try:
            chosen = self.decode.run(decs) if decs else {}
            for seg in chunks:
                assert self.chunk is not None
                chosen[seg.slot] = self.chunk.run(seg)
        except AccelGraphError as exc:
            if self.process_group is not None:
                raise
            # Cache writes are idempotent (each live token's key/value at its own position),
            # so serving the whole step again eagerly is safe after a part that failed.
            self._note_fallback(f"whole-step graph failed ({type(exc).__name__}: {exc})")
            self._fill(batch)
            return self._finish(self._run_flat_eager(), batch.num_tokens)
        return self._finish([chosen[s.slot] for s in batch.segments if s.sample],
                            batch.num_tokens)

    def _finish(self, out: list[int], tokens: int) -> list[int]:
        self.steps += 1
        self.tokens_run += tokens
        return out

    def _run_flat_eager(self) -> list[int]:
        """The filled step (``meta``) eagerly."""
        meta = self.meta
        n = meta.num_tokens
        with torch.inference_mode():
            return self._tokens(greedy_step(self.model, meta, meta.tok_id[:n], meta.tok_pos[:n],
                                            self._sample_rows))

    def _run_flat(self, batch: StepBatch) -> list[int]:
        self._fill(batch)
        meta = self.meta
        n = meta.num_tokens
        tokens, positions = meta.tok_id[:n], meta.tok_pos[:n]
        try:
            chosen = self.runner(tokens, positions, self._sample_rows)
        except AccelGraphError as exc:
            if self.process_group is not None:
                raise
            # The step's cache writes are idempotent (each live token's key/value at its own
            # position), so running it again eagerly is safe after a replay that failed midway.
            self._note_fallback(f"graph step failed ({type(exc).__name__}: {exc})")
            return self._finish(self._run_flat_eager(), n)
        return self._finish(self._tokens(chosen), n)

    def _note_fallback(self, reason: str) -> None:
        if reason not in self._fallback_reasons:
            log.warning("accel_graph.serving: %s; serving this step eagerly", reason)
        self._fallback_reasons[reason] = self._fallback_reasons.get(reason, 0) + 1

    def describe(self) -> dict[str, Any]:
        """Kind, mode, buckets, bucket use counts (token buckets by size; whole-step graphs as
        ``"decode <rows>x<keys>"`` and ``"chunk <tokens>x<keys>"``), compile mode, eager
        fallbacks (the runners' and this executor's), pool bytes (JSON-ready)."""
        stats = self.runner.stats()
        mem = self.memory_report()
        use = {str(b["bucket"]): b["replays"] for b in stats["buckets"]}
        fallbacks = list(stats["eager_fallbacks"]) + [
            {"reason": r, "count": c} for r, c in self._fallback_reasons.items()]
        eager_calls = stats["eager_calls"]
        capture_s, compile_s = stats["capture_seconds"] or 0.0, stats["compile_seconds"] or 0.0
        whole: dict[str, Any] = {}
        for family in (self.decode, self.chunk):
            if family is None:
                continue
            use.update(family.bucket_use(family.family))
            fst = family.stats()
            fallbacks += fst["eager_fallbacks"]
            eager_calls += fst["eager_calls"]
            capture_s += fst["capture_seconds"]
            compile_s += fst["compile_seconds"]
            whole[family.family] = {
                "kv_buckets": family.kv_buckets,
                "buckets": list(family.runners[family.kv_buckets[0]].buckets)}
        if self.graphs == "full":  # the token-bucket graphs are built but never captured
            use = {k: n for k, n in use.items() if not k.isdigit()}
        return {**self._base_facts(), "graphs": self.graphs,
                "buckets": None if self.graphs == "full" else list(self.runner.buckets),
                "bucket_use": use,
                "captured_buckets": None if self.graphs == "full" else self.runner.captured_buckets,
                "whole_step_graphs": whole or None,
                "compile": self.compile_mode, "eager_fallbacks": fallbacks,
                "eager_steps": eager_calls + sum(self._fallback_reasons.values()),
                "pool_bytes": mem["pool_reserved_bytes"],
                "capture_seconds": capture_s, "compile_seconds": compile_s}
