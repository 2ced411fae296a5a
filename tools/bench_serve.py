"""Load sweep: serve-bench at several arrival rates, eager and graph engine, one capture.

At a low rate the engines are arrival-bound (tokens/s follows the offered load, steps carry
few requests) and the graph engine shows in TPOT; as the rate grows steps batch more requests
(continuous batching) and the faster engine serves more tokens/s. The same executors serve
every rate (captured once); each rate is a full serve-bench (warm-up, then alternating rounds,
medians; :mod:`accel_graph.serving.engine_bench`):

    .venv/bin/python tools/bench_serve.py --rates 50,250,1000 --json docs/bench-serve-sweep.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "load_before",
"rates": [accel_graph.serve-bench/1 reports]}``. Exit status 1 if any rate's tokens differ
between the engines.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from accel_graph.bench.timing import hardware_info
from accel_graph.cli.output import format_table, write_json
from accel_graph.serving.engine_bench import ServeBenchOptions, prepare, serve_bench
from accel_graph.serving.workload import parse_range


def _load() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    d = ServeBenchOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="50,250,1000",
                   help="arrival rates in requests/s, comma-separated (default %(default)s)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--prompt-lens", default=f"{d.prompt_lens[0]}:{d.prompt_lens[1]}")
    p.add_argument("--max-new-tokens", default=f"{d.new_tokens[0]}:{d.new_tokens[1]}")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--graphs", default=d.graphs, choices=("full", "full_and_piecewise", "piecewise"),
                   help="the graph executor's mode (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as serve-bench)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rates = [float(r) for r in a.rates.split(",")]
    base = ServeBenchOptions(
        requests=a.requests, prompt_lens=parse_range(a.prompt_lens, "--prompt-lens"),
        new_tokens=parse_range(a.max_new_tokens, "--max-new-tokens"), seed=a.seed,
        slots=a.slots, max_tokens=a.max_tokens, rounds=a.rounds,
        compile=None if a.no_compile else "inductor", graphs=a.graphs)
    load = _load()
    prepared = prepare(base)
    reports: list[dict[str, Any]] = []
    rows = []
    for rate in rates:
        opts = ServeBenchOptions(**{**base.__dict__, "rate": rate})
        r = serve_bench(opts, prepared=prepared)
        reports.append(r)
        for name in ("eager", "graph"):
            e = r[name]
            rows.append([f"{rate:g}", name, f"{e['tokens_per_s']:.0f}",
                         f"{e['ttft_ms_p50']:.1f}", f"{e['ttft_ms_p99']:.1f}",
                         f"{e['tpot_ms_p50']:.2f}", f"{e['tpot_ms_p99']:.2f}", e["steps"],
                         f"{r['speedup']:.2f}x" if name == "graph" else "",
                         str(r["tokens_equal"]).lower()])
        print(f"rate {rate:g}/s done", file=sys.stderr)
    print(f"serve-bench load sweep: {a.requests} requests, prompts {a.prompt_lens}, new tokens "
          f"{a.max_new_tokens}, {torch.get_num_threads()} threads, load before {load}")
    print(format_table(["rate/s", "engine", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                        "TPOT p50 ms", "TPOT p99 ms", "steps", "speedup", "tokens_equal"], rows))
    if a.json is not None:
        write_json(a.json, {"tool": "tools/bench_serve.py",
                            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "hardware": hardware_info(), "load_before": load, "rates": reports})
        print(f"wrote {a.json}")
    return 0 if all(r["tokens_equal"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
