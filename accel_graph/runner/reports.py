"""The runner's JSON-ready reports: ``memory_report()`` and ``stats()`` (schemas in
``docs/runner.md``), read from the public fields of its
:class:`~accel_graph.runner.runtime.RunnerRuntime`."""

from __future__ import annotations

from typing import Any

from .capture import output_region_bytes
from .runtime import RunnerRuntime

__all__ = ["MEMORY_SCHEMA", "STATS_SCHEMA", "memory_report", "stats"]

MEMORY_SCHEMA = "accel_graph.runner.memory/1"
STATS_SCHEMA = "accel_graph.runner.stats/1"


def memory_report(rt: RunnerRuntime) -> dict[str, Any]:
    """Per-bucket memory from the allocator and the pool total (JSON-ready; schema in
    ``docs/runner.md``)."""
    reserved = peak = None
    if rt.captured:
        reserved, peak = rt.pool_bytes()
    out_sum = sum(b.output_bytes or 0 for b in rt.buckets if b.replay is not None)
    region = output_region_bytes(rt)
    rows = [{
        "bucket": b.size,
        "status": b.status,
        "reason": b.reason,
        "capture_ms": b.capture_ms,
        "compile_ms": b.compile_ms,
        "incremental_bytes": b.incremental_bytes if b.graph is not None else None,
        "standalone_bytes": b.standalone_bytes,
        "pool_after_capture_bytes": b.pool_after_bytes,
        "output_bytes": b.output_bytes,
        # Which program replays the bucket (compiled or interpreted; Graph.replay_mode()).
        "replay_mode": b.graph.replay_mode().mode if b.graph is not None else None,
    } for b in rt.buckets]
    return {
        "schema": MEMORY_SCHEMA,
        "device": str(rt.options.device),
        # The backend is routed at construction; the report names it once capture has used it,
        # as its schema has always said ("null before capture()").
        "backend": rt.backend.name if rt.captured else None,
        "compile": rt.options.compile,
        "pool_reserved_bytes": reserved,
        "pool_peak_reserved_bytes": peak,
        "memory_budget_bytes": rt.memory_budget,
        "static_input_bytes": sum(s.static.numel() * s.static.element_size() for s in rt.inputs),
        # Outputs: what each serving bucket's outputs take, their union in memory, and what
        # sharing saved (0 without share_outputs: each bucket's outputs are its own).
        "outputs_shared": rt.share_outputs,
        "output_bytes_per_bucket_sum": out_sum,
        "output_region_bytes": region,
        "output_bytes_saved": out_sum - region,
        "buckets": rows,
        "left_out": [b.size for b in rt.buckets if b.status != "captured"],
    }


def stats(rt: RunnerRuntime) -> dict[str, Any]:
    """Replays per bucket, eager fallbacks and why, padding waste (JSON-ready)."""
    per = []
    live = padded = 0
    for b in rt.buckets:
        per.append({"bucket": b.size, "status": b.status, "replays": b.replays,
                    "live_rows": b.live_rows, "padded_rows": b.replays * b.size - b.live_rows,
                    "verified": b.verified, "capture_ms": b.capture_ms,
                    "compile_ms": b.compile_ms, "compile_cache": b.compile_cache,
                    "captured_at_call": b.captured_at_call})
        live += b.live_rows
        padded += b.replays * b.size - b.live_rows
    graph_calls = sum(b.replays for b in rt.buckets)
    return {
        "schema": STATS_SCHEMA,
        "calls": graph_calls + rt.eager_calls,  # served calls (refused ones not counted)
        "capture_mode": rt.options.capture_mode,
        "stale_output_warnings": rt.stale_output_warnings,
        "capture_seconds": rt.capture_seconds,
        "compile_seconds": rt.compile_seconds,  # included in capture_seconds
        "captured_buckets": [b.size for b in rt.buckets if b.status == "captured"],
        "graph_calls": graph_calls,
        "eager_calls": rt.eager_calls,
        "eager_fallbacks": [{"reason": r, "count": c} for r, c in rt.fallbacks.most_common()],
        "buckets": per,
        "live_rows": live,
        "padding_waste_rows": padded,
        "batch_size_histogram": _histogram(rt),
        "padding_waste_fraction": padded / (live + padded) if live + padded else 0.0,
    }


def _histogram(rt: RunnerRuntime) -> dict[str, int]:
    """Live batch sizes served, graph and eager: ``{"3": 17, ...}`` (JSON keys are strings);
    feed it to :func:`~accel_graph.suggest_buckets` as ``{int(k): v for k, v in ...}``."""
    counts: dict[int, int] = {n: c for n, c in enumerate(rt.graph_sizes) if c}
    for n, c in rt.eager_sizes.items():
        counts[n] = counts.get(n, 0) + c
    return {str(n): counts[n] for n in sorted(counts)}
