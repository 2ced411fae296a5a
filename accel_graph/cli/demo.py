"""``accel-graph demo``: serve the bundled decoder from captured graphs, check it, time it.

What it does, in one process on the default device (the CPU recorder on a CPU-only box):

1. builds the bundled :class:`~accel_graph.models.Decoder` and a
   :class:`~accel_graph.GraphRunner` over its decode step for a small bucket ladder (compiled
   replay with ``--compile``, the default), and captures it;
2. serves a deterministic stream of requests of mixed batch sizes, each decoded greedily twice,
   eagerly and through the runner (alternating which goes first);
3. checks the tokens agree: a token may differ only where eager's top two logits are within the
   float32 tolerance of each other (a near-tie, counted and reported; that row is not compared
   further, as the sequences legitimately diverge); any other difference fails the demo (exit 1);
4. times each bucket's step both ways, interleaved, by medians; batch-1 greedy decoding both
   ways (median of interleaved generations); and the runner's own overhead per call (runner
   call minus a bare replay of the same graph).

Table on stdout; ``--json PATH`` writes the report (schema ``accel_graph.demo/1``, documented
in ``docs/runner.md``).

This module is the command and steps 1-3 (the model, the runner, the served stream and its token
check); the timings of step 4 are :mod:`accel_graph.cli.demo_timing`, the tables
:mod:`accel_graph.cli.demo_text`, and ``--tp`` is :mod:`accel_graph.cli.demo_tp`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..bench.tokens import compare_greedy
from ..errors import ConfigError
from .demo_text import format_report
from .demo_timing import batch1_decode, bucket_timings, multistep_decode
from .output import write_json

__all__ = ["SCHEMA", "add_arguments", "format_report", "run", "run_demo"]

SCHEMA = "accel_graph.demo/1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph demo``."""
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4], metavar="B",
                        help="bucket ladder to capture (default: 1 2 4; the model's max_batch "
                        "is the largest)")
    parser.add_argument("--requests", type=int, default=12, metavar="N",
                        help="requests in the served stream (default: 12)")
    parser.add_argument("--new-tokens", type=int, default=24, metavar="N",
                        help="tokens generated per sequence (default: 24)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled replay (Inductor; seconds per bucket on a cold cache); "
                        "--no-compile replays the recorded program as captured (default: "
                        "compiled in one process, interpreted with --tp)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor parallelism: run the sharded decoder (TPDecoder) on N local "
                        "CPU processes, gloo over loopback, one GraphRunner per rank; checks its "
                        "greedy tokens against the single-process model's (default: 1, one "
                        "process; --requests is not used with --tp > 1)")
    parser.add_argument("--collective", choices=("c10d", "functional"), default="c10d",
                        help="with --tp: the all-reduce the TP decoder issues, dist.all_reduce "
                        "(c10d, default) or the functional collective")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="torch intra-op threads (default: 1)")
    parser.add_argument("--bench-iters", type=int, default=200, metavar="N",
                        help="timed calls per variant and bucket (default: 200; 0 skips timing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the report as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when graph decoding matches eager (with ``--tp``: the single-process
    model), 1 otherwise."""
    _validate(args.buckets, args.requests, args.new_tokens, args.threads, args.bench_iters)
    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1 (1: one process), got {args.tp}")
    if args.tp > 1:
        from .demo_tp import run_tp_demo

        return run_tp_demo(args, compile=bool(args.compile))  # None: interpreted
    report = run_demo(
        buckets=args.buckets, requests=args.requests, new_tokens=args.new_tokens,
        compile=args.compile is not False, threads=args.threads, bench_iters=args.bench_iters,
        seed=args.seed,
    )
    sys.stdout.write(format_report(report))
    if args.json is not None:
        write_json(args.json, report)  # strict JSON, keys in the report's order
        sys.stdout.write(f"wrote {args.json}\n")
    return 0 if report["check"]["ok"] else 1


def _validate(buckets: list[int], requests: int, new_tokens: int, threads: int,
              bench_iters: int) -> None:
    if not buckets or any(b < 1 for b in buckets):
        raise ConfigError(f"--buckets needs positive batch sizes, got {buckets}")
    if max(buckets) > 64:
        raise ConfigError(f"--buckets up to 64 in the demo, got {max(buckets)}")
    for name, value, low in (("--requests", requests, 1), ("--new-tokens", new_tokens, 1),
                             ("--threads", threads, 1), ("--bench-iters", bench_iters, 0)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if new_tokens > 100:
        raise ConfigError(f"--new-tokens must be <= 100 (the model's max_seq is 128), got {new_tokens}")


def make_requests(seed: int, count: int, max_batch: int, vocab: int) -> list[torch.Tensor]:
    """A deterministic stream of prompts ``[B, T]``: B mixed over 1..max_batch (small ones more
    often, as in decode traffic), T in 2..8."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = list(range(1, max_batch + 1))
    weights = [1.0 / s for s in sizes]
    out = []
    for k in range(count):
        # Every batch size shows up once before the mix goes random, so every bucket serves.
        b = sizes[k] if k < len(sizes) else rng.choices(sizes, weights)[0]
        t = rng.randint(2, 8)
        out.append(torch.randint(0, vocab, (b, t), generator=gen))
    return out


# The token check lives with the benchmarks (the TP demo uses it too); the demo's name stays.
_check_tokens = compare_greedy


def _serve(model: Any, runner: Any, requests: list[torch.Tensor], new_tokens: int) -> dict[str, Any]:
    from ..models import greedy_generate

    eager_s = graph_s = 0.0
    tokens = compared = ties = 0
    mismatches: list[dict[str, Any]] = []
    for k, prompt in enumerate(requests):
        rec: list[torch.Tensor] = []

        def eager_step(tok: torch.Tensor, pos: torch.Tensor, rec: list = rec) -> torch.Tensor:
            out = model.decode_step(tok, pos)
            rec.append(out)
            return out

        results = {}
        # Alternate which goes first, so drift over the run hits both alike.
        for which in (("eager", "graph") if k % 2 == 0 else ("graph", "eager")):
            step = eager_step if which == "eager" else runner
            t0 = time.perf_counter()
            results[which] = greedy_generate(model, prompt, new_tokens, step=step)
            dt = time.perf_counter() - t0
            if which == "eager":
                eager_s += dt
            else:
                graph_s += dt
        tokens += prompt.shape[0] * new_tokens
        c, t, bad = _check_tokens(prompt.shape[1], results["eager"], results["graph"], rec)
        compared, ties = compared + c, ties + t
        mismatches += [{"request": k, **m} for m in bad]
    return {
        "requests": len(requests),
        "batch_sizes": [int(p.shape[0]) for p in requests],
        "generated_tokens": tokens,
        "eager_s": eager_s,
        "graph_s": graph_s,
        "eager_tokens_per_s": tokens / eager_s if eager_s else None,
        "graph_tokens_per_s": tokens / graph_s if graph_s else None,
        "speedup": eager_s / graph_s if graph_s else None,
        "tokens_compared": compared,
        "near_ties": ties,
        "mismatches": mismatches,
    }


def run_demo(*, buckets: list[int] | tuple[int, ...] = (1, 2, 4), requests: int = 12,
             new_tokens: int = 24, compile: bool = True, threads: int = 1, bench_iters: int = 200,
             seed: int = 0) -> dict[str, Any]:
    """Run the demo and return its report (a JSON-ready dict, schema :data:`SCHEMA`)."""
    buckets = sorted(set(buckets))
    _validate(buckets, requests, new_tokens, threads, bench_iters)
    t_start = time.perf_counter()
    from .. import GraphRunner
    from ..bench.timing import hardware_info
    from ..models import Decoder, DecoderConfig

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = DecoderConfig(max_batch=max(buckets))
        model = Decoder(cfg)
        example = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        runner = GraphRunner(model.decode_step, example, buckets=buckets,
                             compile="inductor" if compile else None)
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.capture()
        capture_s = time.perf_counter() - t0
        stream = make_requests(seed, requests, max(buckets), cfg.vocab_size)
        with torch.inference_mode():
            serving = _serve(model, runner, stream, new_tokens)
            rows, overhead = bucket_timings(model, runner, buckets, bench_iters) if bench_iters else ([], {})
            batch1 = (batch1_decode(model, runner, new_tokens, max(3, bench_iters // 10))
                      if bench_iters and 1 in buckets else None)
            multistep = (multistep_decode(model, runner, min(new_tokens, 8), max(3, bench_iters // 10),
                                    "inductor" if compile else None)
                         if bench_iters and 1 in buckets else None)
        memory = runner.memory_report()
        stats = runner.stats()
    finally:
        torch.set_num_threads(saved_threads)
    by_bucket = {r["bucket"]: r for r in rows}
    table = []
    for m in memory["buckets"]:
        g = runner.graph(m["bucket"])
        compiled = g.compile_info() if g is not None else None
        table.append({
            "bucket": m["bucket"],
            "status": m["status"],
            "reason": m["reason"],
            "capture_ms": m["capture_ms"],
            "compile_s": compiled.get("compile_s") if isinstance(compiled, dict) else None,
            "compile_fallback": compiled.get("fallback") if isinstance(compiled, dict) else None,
            "incremental_bytes": m["incremental_bytes"],
            "standalone_bytes": m["standalone_bytes"],
            **{k: by_bucket.get(m["bucket"], {}).get(k) for k in ("eager_step_us", "graph_step_us", "speedup")},
        })
    ok = not serving["mismatches"] and (multistep is None or multistep["tokens_equal_eager"])
    return {
        "schema": SCHEMA,
        "tool": "accel-graph demo",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info() | {"threads": threads},
        "model": {"name": "accel_graph.models.Decoder", **cfg.as_dict(),
                  "parameters": model.num_parameters()},
        "settings": {"buckets": buckets, "requests": requests, "new_tokens": new_tokens,
                     "compile": "inductor" if compile else None, "bench_iters": bench_iters,
                     "seed": seed},
        "capture_s": capture_s,
        "buckets": table,
        "pool_reserved_bytes": memory["pool_reserved_bytes"],
        "serving": serving,
        "batch1": batch1,
        "multistep": multistep,
        "overhead": overhead,
        "runner_stats": stats,
        "check": {"ok": ok, "near_ties": serving["near_ties"],
                  "mismatches": len(serving["mismatches"])},
        "wall_s": time.perf_counter() - t_start,
    }
