"""``accel-graph serve-bench``: one seeded request stream through the eager and the graph
serving engine; a table on stdout, a progress bar on stderr, JSON with ``--json``.

The measurement lives in :mod:`accel_graph.serving.engine_bench`; this module parses options,
draws the progress bar and prints (schema and method in docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .output import format_table, write_json

__all__ = ["add_arguments", "format_report", "options_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph serve-bench`` (defaults: docs/serving.md)."""
    from ..serving.engine_bench import ServeBenchOptions

    d = ServeBenchOptions()
    parser.add_argument("--requests", type=int, default=d.requests, metavar="N",
                        help=f"requests in the stream (default {d.requests})")
    parser.add_argument("--rate", type=float, default=d.rate, metavar="R",
                        help=f"Poisson arrival rate, requests/s; inf: all at once (default {d.rate:g})")
    parser.add_argument("--prompt-lens", default=f"{d.prompt_lens[0]}:{d.prompt_lens[1]}",
                        metavar="A:B", help="prompt lengths, uniform in A..B (default %(default)s)")
    parser.add_argument("--max-new-tokens", default=f"{d.new_tokens[0]}:{d.new_tokens[1]}",
                        metavar="K", help="new tokens per request: K, or A:B uniform "
                        "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, metavar="S",
                        help=f"the stream's seed (default {d.seed})")
    parser.add_argument("--slots", type=int, default=d.slots, metavar="N",
                        help=f"KV-cache slots, i.e. requests served at once (default {d.slots}); "
                        "ignored with --memory-budget")
    parser.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                        help="size the KV cache from this budget after weights, graph pool and "
                        "warm-up peak (instead of --slots)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="T",
                        help=f"most tokens per step, the largest token bucket (default {d.max_tokens})")
    parser.add_argument("--token-budget", type=int, default=None, metavar="T",
                        help="the scheduler's per-step token budget (default: --max-tokens)")
    parser.add_argument("--graphs", choices=("full", "full_and_piecewise", "piecewise"),
                        default=d.graphs, help="the graph executor's mode (default full: every "
                        "step from whole-step graphs; piecewise: token buckets with attention "
                        "islands; docs/serving.md \"Graph modes\")")
    parser.add_argument("--no-compile", action="store_true",
                        help="interpreted graph replay instead of Inductor-compiled replay")
    parser.add_argument("--rounds", type=int, default=d.rounds, metavar="N",
                        help=f"timed rounds per engine after one warm-up round; figures are "
                        f"medians (default {d.rounds})")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="torch intra-op threads (default 1: on a small shared machine, "
                        "threads of one op wait for each other whenever another process "
                        "takes a core, which swings timings by several times)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--json", type=Path, default=None, metavar="F",
                        help="also write the report as JSON to F (schema: docs/serving.md)")


def options_from_args(args: argparse.Namespace) -> Any:
    """:class:`~accel_graph.serving.engine_bench.ServeBenchOptions` from parsed options;
    ConfigError (exit 2) for bad values."""
    from ..serving.engine_bench import ServeBenchOptions
    from ..serving.workload import parse_range

    for name in ("requests", "slots", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.rate > 0:
        raise ConfigError(f"--rate must be > 0 requests/s (inf: all at once), got {args.rate}")
    return ServeBenchOptions(
        requests=args.requests, rate=args.rate,
        prompt_lens=parse_range(args.prompt_lens, "--prompt-lens"),
        new_tokens=parse_range(args.max_new_tokens, "--max-new-tokens"), seed=args.seed,
        slots=args.slots, max_tokens=args.max_tokens, token_budget=args.token_budget,
        compile=None if args.no_compile else "inductor", rounds=args.rounds,
        memory_budget=args.memory_budget, graphs=args.graphs)


class _Bar:
    """tqdm on stderr over the requests served (created on the first tick)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar = enabled, None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="serve-bench", unit="req", file=sys.stderr,
                            leave=False, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    """Run serve-bench, print the table, write ``--json``; returns 0."""
    import torch

    from ..serving.engine_bench import serve_bench

    opts = options_from_args(args)
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    bar = _Bar(not args.no_progress)
    try:
        report = serve_bench(opts, progress=bar)
    finally:
        bar.close()
    sys.stdout.write(format_report(report) + "\n")
    if args.json is not None:
        write_json(args.json, report)
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _bucket_order(key: str) -> tuple[int, ...]:
    """Token buckets ("64") by size, then whole-step graphs ("chunk 64x128", "decode 16x128")
    by family, bucket and key extent."""
    family, _, size = key.rpartition(" ")
    if family:
        bucket, kv = size.split("x")
        return (1 if family == "chunk" else 2, int(bucket), int(kv))
    return (0, int(key))


def format_report(report: dict[str, Any]) -> str:
    """The serve-bench table (and the lines under it) from a report."""
    o = report["options"]
    rows = [[name, f"{e['tokens_per_s']:.0f}", _ms(e["ttft_ms_p50"]), _ms(e["ttft_ms_p99"]),
             _ms(e["tpot_ms_p50"]), _ms(e["tpot_ms_p99"]), e["steps"]]
            for name, e in (("eager", report["eager"]), ("graph", report["graph"]))]
    table = format_table(["engine", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                          "TPOT p99 ms", "steps"], rows)
    kv = report["kv_cache"]
    use = ", ".join(f"{b}: {n}" for b, n in sorted(report["bucket_use"].items(),
                                                   key=lambda kv_: _bucket_order(kv_[0])) if n)
    ratio = report["tpot_p50_ratio"]
    lines = [
        f"serve-bench: {report['requests']} requests at {o['rate']}/s, prompts "
        f"{o['prompt_lens'][0]}..{o['prompt_lens'][1]}, new tokens {o['new_tokens'][0]}.."
        f"{o['new_tokens'][1]} ({report['prefill_tokens']} prefill + {report['decode_tokens']} "
        f"decode tokens), seed {o['seed']}; {o['rounds']} rounds, medians; "
        f"{report['threads']} threads",
        table,
        f"speedup (graph/eager tokens/s): {report['speedup']:.2f}x; TPOT p50 graph/eager: "
        + ("-" if ratio is None else f"{ratio:.2f}x")
        + f"; tokens_equal: {str(report['tokens_equal']).lower()}",
        f"graph replays per bucket (timed rounds; unused ones left out): {use or '-'}; "
        f"eager fallback steps: "
        f"{report['graph']['fallback_steps']}",
        f"KV cache: {kv['slots']} slots x {kv['bytes_per_slot']} B = {kv['kv_bytes']} B; graph "
        f"pool {kv['pool_bytes']} B ({kv['source']}); capture {report['capture_s']:.1f} s",
    ]
    return "\n".join(lines)
