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
from ..models.slot_attention import SlotAttentionMeta
from ..runner import GraphRunner
from ..runner.memory_plan import plan_shared_pool
from .decode_graphs import DecodeGraphs, is_decode_only
from .step import StepBatch

__all__ = ["EagerExecutor", "GraphExecutor", "greedy_step", "serving_config", "token_ladder"]

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


class GraphExecutor(_FlatExecutor):
    """Runs each step from captured graphs, vLLM's FULL_AND_PIECEWISE: a step with a prompt
    chunk from the graphs captured per token bucket (a :class:`GraphRunner` over the flat
    step, docs/runner.md "Token buckets"), its attention islands run eagerly with the live
    lengths; a decode-only step from a whole-step graph with attention inside
    (:mod:`~accel_graph.serving.decode_graphs`). All graphs share one pool.

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
        decode_graphs: serve decode-only steps from whole-step graphs (default); False: every
            step from the token-bucket graphs.
        kv_buckets: the decode graphs' key extents (default
            :func:`~accel_graph.serving.decode_graphs.kv_ladder`).

    ``runner`` is the token-bucket :class:`GraphRunner` (``runner.memory_report()``,
    ``stats()``: the pool is shared, so its pool figures count every graph); ``decode`` the
    :class:`~accel_graph.serving.decode_graphs.DecodeGraphs` (None without); ``runners()``
    all of them. A step the
    graphs cannot serve runs eagerly (the runner's fallback, logged once per reason); a replay
    that raises is served eagerly too (one process only: with a process group the error
    propagates, as the other ranks' collectives could not pair), logged once.
    """

    kind = "graph"

    def __init__(self, model: Decoder, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 buckets: list[int] | None = None, max_segments: int | None = None,
                 compile: str | None = "inductor", compile_options: dict[str, Any] | None = None,
                 verify: bool | int = True, process_group: Any = None,
                 capture: bool = True, decode_graphs: bool = True,
                 kv_buckets: list[int] | None = None) -> None:
        super().__init__(model, max_tokens, max_segments)
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
        # One pool for every graph (flat and decode): they never run at once, so they share.
        self.pool = graph_pool_handle(meta.buffer.device)
        options = {"compile": compile, "compile_options": compile_options, "verify": verify,
                   "process_group": process_group, "pool": self.pool}
        self.runner = GraphRunner(
            flat_step, example, buckets=ladder, batch_dim=(0, 0, None), output_batch_dim=None,
            progress=False, **options)
        self.decode: DecodeGraphs | None = (
            DecodeGraphs(model, kv_buckets, options) if decode_graphs else None)
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
        """Capture every bucket (largest first). Capture runs an empty step (no live token), so
        it writes nothing into the KV cache. Returns ``self``."""
        if self.captured:
            raise AccelGraphError("this executor's graphs are already captured")
        self.meta.clear()
        self.runner.capture()
        if self.decode is not None:
            self.decode.capture()
        self.captured = True
        return self

    def plan_memory(self, trace: str | None = None) -> dict[str, Any]:
        """The memory plan of every graph of this executor in its one shared pool, before
        capture (:func:`~accel_graph.runner.memory_plan.plan_shared_pool`: schema
        ``accel_graph.runner.memory-plan/1``, plus ``runners``); captures nothing."""
        return plan_shared_pool(self.runners(), trace=trace)

    def runners(self) -> list[GraphRunner]:
        """Every runner of this executor in capture order: the token-bucket one, then the
        decode graphs' (widest key extent first)."""
        decode = self.decode
        return [self.runner] + ([] if decode is None else
                                [decode.runners[k] for k in reversed(decode.kv_buckets)])

    def run(self, batch: StepBatch) -> list[int]:
        """Run one step; the greedy next token of each sampled segment, in segment order."""
        decode = self.decode
        if decode is not None and isinstance(batch, StepBatch) and batch.segments \
                and is_decode_only(batch.segments):
            try:
                out = decode.run(batch.segments)
            except AccelGraphError as exc:
                if self.process_group is not None:
                    raise
                self._note_fallback(f"decode graph step failed ({type(exc).__name__}: {exc})")
                out = self._run_flat(batch, eager=True)
            self.steps += 1
            self.tokens_run += len(batch.segments)
            return out
        return self._run_flat(batch)

    def _run_flat(self, batch: StepBatch, eager: bool = False) -> list[int]:
        self._fill(batch)
        meta = self.meta
        n = meta.num_tokens
        tokens, positions = meta.tok_id[:n], meta.tok_pos[:n]
        if eager:
            with torch.inference_mode():
                out = self._tokens(greedy_step(self.model, meta, tokens, positions,
                                               self._sample_rows))
            return out
        try:
            chosen = self.runner(tokens, positions, self._sample_rows)
        except AccelGraphError as exc:
            if self.process_group is not None:
                raise
            # The step's cache writes are idempotent (each live token's key/value at its own
            # position), so running it again eagerly is safe after a replay that failed midway.
            self._note_fallback(f"graph step failed ({type(exc).__name__}: {exc})")
            with torch.inference_mode():
                chosen = greedy_step(self.model, meta, tokens, positions, self._sample_rows)
        out = self._tokens(chosen)
        self.steps += 1
        self.tokens_run += n
        return out

    def _note_fallback(self, reason: str) -> None:
        if reason not in self._fallback_reasons:
            log.warning("accel_graph.serving: %s; serving this step eagerly", reason)
        self._fallback_reasons[reason] = self._fallback_reasons.get(reason, 0) + 1

    def describe(self) -> dict[str, Any]:
        """Kind, buckets, bucket use counts, compile mode, eager fallbacks (the runner's and
        this executor's), pool bytes (JSON-ready)."""
        stats = self.runner.stats()
        mem = self.runner.memory_report()
        use = {str(b["bucket"]): b["replays"] for b in stats["buckets"]}
        fallbacks = list(stats["eager_fallbacks"]) + [
            {"reason": r, "count": c} for r, c in self._fallback_reasons.items()]
        eager_calls = stats["eager_calls"]
        capture_s, compile_s = stats["capture_seconds"] or 0.0, stats["compile_seconds"] or 0.0
        decode = self.decode
        if decode is not None:
            use.update(decode.bucket_use())
            dst = decode.stats()
            fallbacks += dst["eager_fallbacks"]
            eager_calls += dst["eager_calls"]
            capture_s += dst["capture_seconds"]
            compile_s += dst["compile_seconds"]
        return {**self._base_facts(), "buckets": list(self.runner.buckets), "bucket_use": use,
                "captured_buckets": self.runner.captured_buckets,
                "decode_graphs": None if decode is None else {
                    "kv_buckets": decode.kv_buckets,
                    "row_buckets": list(decode.runners[decode.kv_buckets[0]].buckets)},
                "compile": self.compile_mode, "eager_fallbacks": fallbacks,
                "eager_steps": eager_calls + sum(self._fallback_reasons.values()),
                "pool_bytes": mem["pool_reserved_bytes"],
                "capture_seconds": capture_s, "compile_seconds": compile_s}
