"""Whole-step ("FULL") graphs for serving steps: attention inside the graph, no island.

The token-bucket graphs of :class:`~accel_graph.serving.executors.GraphExecutor` (PIECEWISE)
serve any flat step, with attention as an eager island per layer: its shapes follow the live
lengths. On a CPU, where a graph removes dispatch and not arithmetic, those islands and the
pieces around them keep a mixed step close to eager (docs/benchmarks.md). But the segments of
a step are independent (each writes and reads its own cache row), so a step can be served
part by part from graphs whose shapes are static, attention included:

- **decode** (:class:`DecodeGraphs`): every one-token segment of the step in one graph whose
  rows are the cache's slots ``0..R-1`` (:meth:`Decoder.slot_decode_step
  <accel_graph.models.decoder.Decoder.slot_decode_step>`). ``R`` is the highest slot in the
  step plus one, padded to a row bucket (:func:`slot_ladder`): the engine hands out the lowest
  free slot first, so a light load uses few rows. A slot without a token this step, and the
  padding, are rows that are not live: they write back what their slot holds (nothing changes)
  and their output is not read.
- **chunk** (:class:`ChunkGraphs`): each prompt chunk (two tokens or more) in one graph of
  ``C`` tokens of one slot (:meth:`Decoder.slot_chunk_step
  <accel_graph.models.decoder.Decoder.slot_chunk_step>`), ``C`` a chunk bucket
  (:func:`chunk_ladder`); the padding takes a position no live token of the chunk has and
  writes back.

Both read keys ``0..K-1`` of a row, ``K`` from a short ladder (:func:`kv_ladder`: half and all of
``max_seq``): a step takes the smallest extent that covers its longest
sequence, so short sequences read less. One :class:`~accel_graph.GraphRunner` per ``K`` and
family, all in the executor's one pool. vLLM's FULL_AND_PIECEWISE mode is the decode family
plus token buckets for the rest; the executor's ``graphs="full"`` serves every step from these
two families (docs/serving.md "Graph modes").

The executor validates a step whole (:func:`~accel_graph.models.slot_attention.check_step`)
before any part of it runs; these classes trust what they are given.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..models.decoder import Decoder
from ..runner import GraphRunner
from .step import Segment

__all__ = ["ChunkGraphs", "DecodeGraphs", "chunk_ladder", "is_decode_only", "kv_ladder",
           "slot_ladder"]


def kv_ladder(max_seq: int) -> list[int]:
    """The default key extents: ``max_seq // 2`` (if at least 16) and ``max_seq``. A step pays
    for the extent it picks, so a short sequence should not read the whole cache; but each
    extent is one graph per bucket, compiled on capture, so the ladder is short (a quarter
    extent too made the default serve-bench's cold capture 100 s instead of about 65 s, for
    a few percent at this load: docs/benchmarks.md)."""
    return sorted({k for k in (max_seq // 2,) if k >= 16} | {max_seq})


def slot_ladder(num_slots: int) -> list[int]:
    """The default row buckets of the decode graphs: 4, 8, 16, ... below ``num_slots``, then
    ``num_slots`` (every slot)."""
    ladder, b = [], 4
    while b < num_slots:
        ladder.append(b)
        b *= 2
    return ladder + [num_slots]


def chunk_ladder(max_tokens: int) -> list[int]:
    """The default token buckets of the chunk graphs: 16, 32, ... below ``max_tokens``, then
    ``max_tokens`` (a short chunk pads to 16: few graphs, as each is compiled on capture)."""
    ladder, b = [], 16
    while b < max_tokens:
        ladder.append(b)
        b *= 2
    return ladder + [max_tokens]


def is_decode_only(segments: Sequence[Segment]) -> bool:
    """Whether every segment of a step feeds one token (a decode token, or a one-token chunk)."""
    return all(len(s.tokens) == 1 for s in segments)


def _check_ladder(name: str, ladder: Sequence[int], top: int, what: str) -> list[int]:
    if any(isinstance(k, bool) or not isinstance(k, int) for k in ladder) or not ladder or \
            max(ladder) != top or min(ladder) < 1:
        raise ConfigError(f"{name}={list(ladder)} must be ints in 1..{top} that end at {top} "
                          f"({what})")
    return sorted(set(ladder))


class _ExtentRunners:
    """One :class:`GraphRunner` per key extent over the step ``make_fn(kv)``, with one staging
    buffer (``rows`` int64 rows of ``width``) copied to the device once per call."""

    def __init__(self, model: Decoder, kv_buckets: Sequence[int] | None, rows: int, width: int,
                 make_fn: Callable[[int], Callable[..., torch.Tensor]], example: Callable[[torch.Tensor], tuple],
                 runner_options: dict[str, Any]) -> None:
        cfg = model.config
        self.model = model
        self.max_seq = cfg.max_seq
        self.kv_buckets = _check_ladder(
            "kv_buckets", kv_ladder(cfg.max_seq) if kv_buckets is None else kv_buckets,
            cfg.max_seq, "every step must fit one key extent")
        self._host = array("q", bytes(8 * rows * width))
        self._zeros = array("q", bytes(8 * rows * width))
        self._host_tensor = torch.frombuffer(self._host, dtype=torch.int64).view(rows, width)
        self.buffer = torch.zeros(rows, width, dtype=torch.int64, device=model.tok_emb.device)
        self.runners: dict[int, GraphRunner] = {}
        for kv in self.kv_buckets:
            fn = make_fn(kv)
            self.runners[kv] = GraphRunner(fn, example(self.buffer), progress=False,
                                           **runner_options)

    def extent(self, need: int) -> int:
        """The smallest key extent of at least ``need`` keys."""
        return next(k for k in self.kv_buckets if k >= need)

    def stage(self) -> None:
        self.buffer.copy_(self._host_tensor)  # one copy (host to device on GPUs)

    def capture(self) -> None:
        """Capture every runner's buckets (the widest key extent first). Capture runs rows
        that are not live, so it changes nothing in the cache."""
        for kv in reversed(self.kv_buckets):
            self.runners[kv].capture()

    def ordered_runners(self) -> list[GraphRunner]:
        """The runners in capture order."""
        return [self.runners[k] for k in reversed(self.kv_buckets)]

    def bucket_use(self, family: str) -> dict[str, int]:
        """Replays per graph, keyed ``"<family> <bucket>x<kv>"``."""
        return {f"{family} {b['bucket']}x{kv}": b["replays"]
                for kv, runner in self.runners.items() for b in runner.stats()["buckets"]}

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


class DecodeGraphs(_ExtentRunners):
    """The decode graphs of one model (module docstring): one runner per key extent, bucketed
    on slot rows; :meth:`run` serves the one-token segments of a step.

    Args:
        model: the :class:`Decoder` (or one rank's ``TPDecoder``) whose cache rows are slots.
        kv_buckets: the key extents (default :func:`kv_ladder`), ending at ``max_seq``.
        runner_options: passed to each :class:`GraphRunner` (compile, verify, pool, ...).
    """

    family = "decode"

    def __init__(self, model: Decoder, kv_buckets: Sequence[int] | None,
                 runner_options: dict[str, Any]) -> None:
        self.num_slots = n = model.config.max_batch

        def make_fn(kv: int) -> Callable[..., torch.Tensor]:
            def decode_step(tokens: torch.Tensor, positions: torch.Tensor,
                            live: torch.Tensor) -> torch.Tensor:
                return model.slot_decode_step(tokens, positions, live != 0, kv).argmax(dim=-1)

            decode_step.__qualname__ = f"decode_step_kv{kv}"
            return decode_step

        super().__init__(model, kv_buckets, 3, n, make_fn,
                         lambda b: (b[0, :1], b[1, :1], b[2, :1]),
                         {**runner_options, "buckets": slot_ladder(n), "batch_dim": 0,
                          "output_batch_dim": 0})

    def prepare(self, segments: Sequence[Segment]) -> tuple[int, int]:
        """Stage one-token segments (validated by the caller:
        :func:`~accel_graph.models.slot_attention.check_step`); returns ``(rows, kv)``: the
        slot rows (highest slot + 1) and the key extent that serves them."""
        n = self.num_slots
        rows = max(s.slot for s in segments) + 1
        need = max(s.start for s in segments) + 1
        host = self._host
        host[:] = self._zeros
        for seg in segments:
            host[seg.slot] = seg.tokens[0]
            host[n + seg.slot] = seg.start
            host[2 * n + seg.slot] = 1
        self.stage()
        return rows, self.extent(need)

    def run(self, segments: Sequence[Segment]) -> dict[int, int]:
        """Serve one-token segments from their graph: ``{slot: greedy next token}`` for every
        segment (one host read)."""
        rows, kv = self.prepare(segments)
        b = self.buffer
        chosen = self.runners[kv](b[0, :rows], b[1, :rows], b[2, :rows]).tolist()
        return {s.slot: chosen[s.slot] for s in segments}


class ChunkGraphs(_ExtentRunners):
    """The chunk graphs of one model (module docstring): one runner per key extent, bucketed
    on the chunk's tokens; :meth:`run` serves one prompt chunk.

    Args:
        model: the :class:`Decoder` (or one rank's ``TPDecoder``).
        max_tokens: the longest chunk (the executor's largest step).
        buckets: the chunk buckets (default :func:`chunk_ladder`), ending at ``max_tokens``.
        kv_buckets: the key extents (default :func:`kv_ladder`), ending at ``max_seq``.
        runner_options: passed to each :class:`GraphRunner`.
    """

    family = "chunk"

    def __init__(self, model: Decoder, max_tokens: int, buckets: Sequence[int] | None,
                 kv_buckets: Sequence[int] | None, runner_options: dict[str, Any]) -> None:
        self.buckets = _check_ladder("chunk_buckets", chunk_ladder(max_tokens) if buckets is None
                                     else buckets, max_tokens, "the largest chunk a step carries")
        self.max_tokens = t = max_tokens

        def make_fn(kv: int) -> Callable[..., torch.Tensor]:
            def chunk_step(tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                           meta: torch.Tensor) -> torch.Tensor:
                # meta: [slot, sampled row]
                return model.slot_chunk_step(tokens, positions, meta[:1], live != 0, meta[1:],
                                             kv).argmax(dim=-1)

            chunk_step.__qualname__ = f"chunk_step_kv{kv}"
            return chunk_step

        # Staging rows: tokens, positions, live (t each), then [slot, sampled row].
        super().__init__(model, kv_buckets, 4, t, make_fn,
                         lambda b: (b[0, :1], b[1, :1], b[2, :1], b[3, :2]),
                         {**runner_options, "buckets": self.buckets,
                          "batch_dim": (0, 0, 0, None), "output_batch_dim": None})

    def can_serve(self, seg: Segment) -> bool:
        """Whether the chunk has a free position for its padding (one its live tokens do not
        take) or needs none."""
        c = len(seg.tokens)
        size = next((b for b in self.buckets if b >= c), None)
        if size is None:
            return False
        return size == c or seg.start + c < self.max_seq or seg.start > 0

    def run(self, seg: Segment) -> int:
        """Serve one prompt chunk (validated by the caller, :meth:`can_serve` true) from its
        graph: the greedy next token after its last token (read even when ``seg.sample`` is
        false; one host read)."""
        c, start = len(seg.tokens), seg.start
        size = next(b for b in self.buckets if b >= c)
        pad = start + c if start + c < self.max_seq else start - 1
        t, host = self.max_tokens, self._host
        host[0:c] = array("q", seg.tokens)
        host[t:t + c] = array("q", range(start, start + c))
        host[2 * t:2 * t + c] = array("q", [1] * c)
        if size > c:  # padding: token 0 at the free position, not live
            host[c:size] = array("q", bytes(8 * (size - c)))
            host[t + c:t + size] = array("q", [pad] * (size - c))
            host[2 * t + c:2 * t + size] = array("q", bytes(8 * (size - c)))
        host[3 * t] = seg.slot
        host[3 * t + 1] = c - 1
        self.stage()
        b = self.buffer
        # The padding's own keys need no extent: it writes back and its output is not read.
        kv = self.extent(start + c)
        return int(self.runners[kv](b[0, :size], b[1, :size], b[2, :size], b[3, :2])[0])
