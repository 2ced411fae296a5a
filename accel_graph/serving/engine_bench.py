"""serve-bench: the same seeded request stream through the eager and the graph engine.

Both engines are :class:`~.engine.Engine` (one scheduler) over the bundled decoder, with the
same slots and step budget; the eager one runs each step under ``torch.inference_mode()``
(:class:`~.executors.EagerExecutor`, the baseline), the graph one replays captured graphs
(:class:`~.executors.GraphExecutor` in the ``graphs`` mode, default ``"full"``: whole-step
graphs; with an eager fallback on the same model).

Method: both engines first serve the stream once untimed (warm-up: every bucket replayed and
verified, caches warm), then ``rounds`` timed rounds alternate which engine goes first; each
figure is the median over the rounds. Arrivals are honest: a request is admitted only when the
engine's wall clock passes its arrival, and every round replays the same arrival times. Every
request's tokens must be equal between the engines in every round (``tokens_equal``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .engine import Engine, EngineRun
from .engine_memory import kv_bytes_per_slot, size_kv_cache, weight_bytes
from .metrics import summarize
from .requests import Request
from .workload import poisson_requests

__all__ = ["FIGURES", "SCHEMA", "ServeBenchOptions", "prepare", "serve_bench"]

SCHEMA = "accel_graph.serve-bench/1"
#: The per-engine figures (medians over the rounds).
FIGURES = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


@dataclass(frozen=True)
class ServeBenchOptions:
    """One serve-bench run (the CLI's options; docs/serving.md)."""

    requests: int = 96
    rate: float = 1000.0
    prompt_lens: tuple[int, int] = (16, 96)
    new_tokens: tuple[int, int] = (16, 48)
    seed: int = 0
    slots: int = 16
    max_tokens: int = 64
    token_budget: int | None = None
    compile: str | None = "inductor"
    rounds: int = 3
    memory_budget: int | None = None
    graphs: str = "full"


def prepare(opts: ServeBenchOptions) -> tuple[Any, Any, dict[str, Any], float]:
    """Build both executors (the graph one captured): ``(eager, graph, kv_cache facts, capture
    seconds)``; :func:`serve_bench` takes them to serve several streams (the load sweep)
    without capturing again. Only the model options of ``opts`` are read."""
    from .executors import EagerExecutor, GraphExecutor, serving_config

    config = serving_config(max_batch=opts.slots)
    t0 = time.perf_counter()

    def build(slots: int, capture: bool) -> Any:
        return GraphExecutor.from_config(config, num_slots=slots, max_tokens=opts.max_tokens,
                                         compile=opts.compile, capture=capture,
                                         graphs=opts.graphs)

    if opts.memory_budget is not None:
        graph, sizing = size_kv_cache(build, opts.memory_budget)
        kv = sizing.as_dict()
    else:
        graph = build(opts.slots, True)
        rep = graph.memory_report()
        per_slot = kv_bytes_per_slot(graph)
        kv = {"slots": graph.num_slots, "bytes_per_slot": per_slot,
              "kv_bytes": per_slot * graph.num_slots, "weights_bytes": weight_bytes(graph),
              "pool_bytes": rep["pool_peak_reserved_bytes"], "warmup_peak_bytes": None,
              "budget_bytes": None, "source": "measured"}
    capture_s = time.perf_counter() - t0
    eager = EagerExecutor.from_config(config, num_slots=graph.num_slots,
                                      max_tokens=opts.max_tokens)
    kv["bytes"] = kv["kv_bytes"]
    return eager, graph, kv, capture_s


def _bucket_use(executor: Any) -> dict[str, int]:
    return dict(executor.describe().get("bucket_use") or {})


def serve_bench(opts: ServeBenchOptions, progress: Callable[[int, int], None] | None = None,
                prepared: tuple[Any, Any, dict[str, Any], float] | None = None) -> dict[str, Any]:
    """Run serve-bench (module docstring); returns the JSON-ready report
    (schema ``accel_graph.serve-bench/1``, docs/serving.md). ``prepared``: executors from
    :func:`prepare` with the same model options (default: built here)."""
    from .executors import EagerExecutor

    eager_ex, graph_ex, kv, capture_s = prepared or prepare(opts)
    vocab = graph_ex.model.config.vocab_size
    stream = poisson_requests(opts.requests, opts.rate, opts.prompt_lens, opts.new_tokens,
                              vocab_size=vocab, seed=opts.seed)
    fallback = EagerExecutor(graph_ex.model, max_tokens=graph_ex.max_tokens,
                             max_segments=graph_ex.max_segments)
    engines = {
        "eager": Engine(eager_ex, token_budget=opts.token_budget, vocab_size=vocab),
        "graph": Engine(graph_ex, token_budget=opts.token_budget, vocab_size=vocab,
                        fallback=fallback),
    }
    total = (opts.rounds + 1) * 2 * len(stream)
    done = [0]

    def tick(n: int, _of: int) -> None:
        if progress is not None:
            progress(done[0] + n, total)

    runs: dict[str, list[EngineRun]] = {"eager": [], "graph": []}
    reference: list[list[int]] | None = None
    equal = True
    use_before = _bucket_use(graph_ex)
    for rnd in range(opts.rounds + 1):  # round 0: warm-up, not timed
        order = ("eager", "graph") if rnd % 2 == 0 else ("graph", "eager")
        if rnd == 1:
            use_before = _bucket_use(graph_ex)
        for name in order:
            run = engines[name].run(stream, progress=tick)
            done[0] += len(stream)
            tokens = [r.tokens for r in run.results]
            reference = tokens if reference is None else reference
            equal = equal and tokens == reference
            if rnd:
                runs[name].append(run)
    use_after = _bucket_use(graph_ex)
    bucket_use = {b: use_after[b] - use_before.get(b, 0) for b in use_after}
    return _finite(_report(opts, stream, runs, equal, kv, capture_s, bucket_use, graph_ex, engines))


def _median_figures(runs: list[EngineRun]) -> dict[str, Any]:
    sums = [summarize(r.results, r.elapsed_s) for r in runs]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in sums) for k in FIGURES}
    out["steps"] = int(statistics.median(r.stats["steps"] for r in runs))
    out["fallback_steps"] = sum(r.stats["fallback_steps"] for r in runs)
    out["elapsed_s"] = statistics.median(s["elapsed_s"] for s in sums)
    for k in ("served", "rejected", "failed"):  # the same every round (the same stream)
        out[k] = sums[0][k]
    out["rounds"] = {k: [s[k] for s in sums] for k in ("tokens_per_s", "tpot_ms_p50")}
    return out


def _report(opts: ServeBenchOptions, stream: list[Request], runs: dict[str, list[EngineRun]],
            equal: bool, kv: dict[str, Any], capture_s: float, bucket_use: dict[str, int],
            graph_ex: Any, engines: dict[str, Engine]) -> dict[str, Any]:
    eager, graph = _median_figures(runs["eager"]), _median_figures(runs["graph"])
    results = runs["graph"][0].results
    desc = graph_ex.describe()
    return {
        "schema": SCHEMA,
        # rate inf (all at once) as the string "inf": strict JSON has no infinity
        "options": {**asdict(opts), "rate": opts.rate if math.isfinite(opts.rate) else "inf",
                    "prompt_lens": list(opts.prompt_lens),
                    "new_tokens": list(opts.new_tokens),
                    "token_budget": engines["graph"].scheduler.token_budget},
        "requests": len(stream),
        "prefill_tokens": sum(len(r.prompt) for r in stream),
        "decode_tokens": sum(len(r.tokens) for r in results),
        "tokens_equal": equal,
        "eager": eager,
        "graph": graph,
        "speedup": _ratio(graph["tokens_per_s"], eager["tokens_per_s"]),
        "tpot_p50_ratio": _ratio(graph["tpot_ms_p50"], eager["tpot_ms_p50"]),
        "bucket_use": bucket_use,
        "buckets": desc.get("buckets"),
        "eager_fallbacks": desc.get("eager_fallbacks"),
        "kv_cache": kv,
        "capture_s": capture_s,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }


def _finite(obj: Any) -> Any:
    """NaN (a percentile over no values, a ratio of them) as None, so the JSON is strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan
