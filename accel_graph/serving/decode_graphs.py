"""Whole-step graphs for decode-only serving steps: the FULL half of vLLM's FULL_AND_PIECEWISE.

A mixed step (prompt chunks and decode tokens) runs from the token-bucket graphs of
:class:`~accel_graph.serving.executors.GraphExecutor`, with attention as an eager island per
layer: its shapes follow the live lengths. A step of decode tokens only has a shape a graph can
hold whole: one row per KV-cache slot, attention over keys ``0..K-1`` of each row, the rest
masked (:meth:`Decoder.slot_decode_step <accel_graph.models.decoder.Decoder.slot_decode_step>`).
So it is captured with attention inside, one graph per (rows, ``K``): no island, no eager op
between pieces. On a CPU, where a graph removes dispatch and not arithmetic, that is what
makes decode steps cheap (tools/bench_flat_step.py, docs/benchmarks.md).

- Rows are slots ``0..R-1`` (``R``: the highest slot in the step plus one, padded up to the
  row bucket): the engine hands out the lowest free slot first, so a light load uses few rows.
  A slot without a token this step, and the bucket's padding, are rows that are not live: they
  write back what their slot holds (nothing changes) and their output is not read.
- ``K``, the key extent, comes from a short ladder (:func:`kv_ladder`: a quarter, half and all
  of ``max_seq``); a step takes the smallest that covers its longest sequence, so short
  sequences read fewer keys. One :class:`~accel_graph.GraphRunner` per ``K``, all in the
  executor's one pool.

Each step is validated as :meth:`SlotAttentionMeta.fill
<accel_graph.models.slot_attention.SlotAttentionMeta.fill>` validates a flat one (slot range,
one segment per slot, positions inside ``max_seq``), before anything runs.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..models.decoder import Decoder
from ..runner import GraphRunner
from .step import Segment

__all__ = ["DecodeGraphs", "is_decode_only", "kv_ladder", "slot_ladder"]


def kv_ladder(max_seq: int) -> list[int]:
    """The default key extents of the decode graphs: ``max_seq // 4``, ``max_seq // 2`` and
    ``max_seq``, those of at least 16 keys (a step pays for the extent it picks, so a short
    sequence should not read the whole cache; each extent is one graph per row bucket)."""
    return sorted({k for k in (max_seq // 4, max_seq // 2) if k >= 16} | {max_seq})


def slot_ladder(num_slots: int) -> list[int]:
    """The default row buckets of the decode graphs: 4, 8, 16, ... below ``num_slots``, then
    ``num_slots`` (every slot)."""
    ladder, b = [], 4
    while b < num_slots:
        ladder.append(b)
        b *= 2
    return ladder + [num_slots]


def is_decode_only(segments: Sequence[Segment]) -> bool:
    """Whether every segment of a step feeds one token (a decode token, or a one-token chunk)."""
    return all(len(s.tokens) == 1 for s in segments)


class DecodeGraphs:
    """The decode-only graphs of one model: one :class:`GraphRunner` per key extent, bucketed
    on slot rows, serving :meth:`run` (module docstring).

    Args:
        model: the :class:`Decoder` (or one rank's ``TPDecoder``) whose cache rows are slots.
        kv_buckets: the key extents (default :func:`kv_ladder`); the largest must be
            ``max_seq``, so that every step fits one.
        runner_options: passed to each :class:`GraphRunner` (compile, verify, pool,
            process_group, ...).
    """

    def __init__(self, model: Decoder, kv_buckets: Sequence[int] | None,
                 runner_options: dict[str, Any]) -> None:
        cfg = model.config
        self.model = model
        self.num_slots, self.max_seq = cfg.max_batch, cfg.max_seq
        ladder = kv_ladder(cfg.max_seq) if kv_buckets is None else sorted(set(kv_buckets))
        if not ladder or ladder[-1] != cfg.max_seq or ladder[0] < 1 or any(
                isinstance(k, bool) or not isinstance(k, int) for k in ladder):
            raise ConfigError(f"kv_buckets={kv_buckets} must be ints in 1..max_seq that end at "
                              f"max_seq={cfg.max_seq} (every decode step must fit one)")
        self.kv_buckets = ladder
        n = self.num_slots
        # Host staging (tokens, positions, live per slot row) and its one device copy a step.
        self._host = array("q", bytes(8 * 3 * n))
        self._host_tensor = torch.frombuffer(self._host, dtype=torch.int64).view(3, n)
        self.buffer = torch.zeros(3, n, dtype=torch.int64, device=model.tok_emb.device)
        example = (self.buffer[0, :1], self.buffer[1, :1], self.buffer[2, :1])
        self.runners: dict[int, GraphRunner] = {}
        for kv in ladder:
            self.runners[kv] = GraphRunner(
                self._step_fn(kv), example, buckets=slot_ladder(n), batch_dim=0,
                output_batch_dim=0, progress=False, **runner_options)

    def _step_fn(self, kv: int) -> Any:
        model = self.model

        def decode_step(tokens: torch.Tensor, positions: torch.Tensor,
                        live: torch.Tensor) -> torch.Tensor:
            return model.slot_decode_step(tokens, positions, live != 0, kv).argmax(dim=-1)

        decode_step.__qualname__ = f"decode_step_kv{kv}"
        return decode_step

    def capture(self) -> None:
        """Capture every runner's buckets (the widest key extent first). Capture runs rows that
        are not live, so it changes nothing in the cache."""
        for kv in reversed(self.kv_buckets):
            self.runners[kv].capture()

    def prepare(self, segments: Sequence[Segment]) -> tuple[int, int]:
        """Validate a decode-only step and stage it; returns ``(rows, kv)``: the slot rows
        (highest slot + 1) and the key extent that serves it. ValueError naming the segment
        for a slot outside the cache or used twice, or a position outside ``max_seq``; on
        error nothing is staged."""
        n, seen = self.num_slots, set()
        rows = need = 0
        for i, seg in enumerate(segments):
            slot, start = seg.slot, seg.start
            if not 0 <= slot < n:
                raise ValueError(f"segment {i}: slot {slot} is outside 0..{n - 1}")
            if slot in seen:
                raise ValueError(f"two segments of one step share slot {slot}: each live request "
                                 f"has its own slot and feeds one segment per step")
            if not 0 <= start < self.max_seq:
                raise ValueError(
                    f"segment {i}: 1 token at position {start} does not fit a sequence of "
                    f"max_seq={self.max_seq} (need 0 <= start < max_seq)")
            seen.add(slot)
            rows, need = max(rows, slot + 1), max(need, start + 1)
        host = self._host
        host[0:3 * n] = array("q", bytes(8 * 3 * n))
        for seg in segments:
            host[seg.slot] = seg.tokens[0]
            host[n + seg.slot] = seg.start
            host[2 * n + seg.slot] = 1
        self.buffer.copy_(self._host_tensor)
        kv = next(k for k in self.kv_buckets if k >= need)
        return rows, kv

    def run(self, segments: Sequence[Segment]) -> list[int]:
        """Serve a decode-only step from its graph: the greedy next token of each segment with
        ``sample``, in segment order (one host read)."""
        rows, kv = self.prepare(segments)
        b = self.buffer
        chosen = self.runners[kv](b[0, :rows], b[1, :rows], b[2, :rows]).tolist()
        return [chosen[s.slot] for s in segments if s.sample]

    def bucket_use(self) -> dict[str, int]:
        """Replays per graph, keyed ``"decode <rows>x<kv>"``."""
        use = {}
        for kv, runner in self.runners.items():
            for b in runner.stats()["buckets"]:
                use[f"decode {b['bucket']}x{kv}"] = b["replays"]
        return use

    def stats(self) -> dict[str, Any]:
        """Eager calls, capture and compile seconds and eager fallbacks summed over runners."""
        out: dict[str, Any] = {"eager_calls": 0, "capture_seconds": 0.0, "compile_seconds": 0.0,
                               "eager_fallbacks": []}
        for runner in self.runners.values():
            st = runner.stats()
            out["eager_calls"] += st["eager_calls"]
            out["capture_seconds"] += st["capture_seconds"] or 0.0
            out["compile_seconds"] += st["compile_seconds"] or 0.0
            out["eager_fallbacks"] += list(st["eager_fallbacks"])
        return out
