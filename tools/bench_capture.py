"""Benchmark: steady-state capture time of the bundled decoder's decode step on the recorder.

``accel-graph bench`` reports one capture per batch size, so its capture column moves with
whatever else the machine does in that instant. This captures the same step many times in one
process (after one warm-up capture that pays torch's one-time imports) and reports the median and
spread, next to one eager call, for comparing two trees (run it in each, interleaved):

    bash tools/dev.sh run python tools/bench_capture.py --json out.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "rows":
[{"batch", "captures", "median_ms", "p10_ms", "p90_ms", "eager_median_ms",
"capture_vs_eager"}]}``. Interpreted replay only (no Inductor).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

import accel_graph
from accel_graph.models import Decoder, DecoderConfig


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(batch: int, captures: int) -> dict[str, float | int]:
    """Median capture and eager times (ms) of ``captures`` captures at ``batch``."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig()).eval()
    tokens = torch.zeros(batch, dtype=torch.long)
    positions = torch.zeros(batch, dtype=torch.long)
    times, eager = [], []
    with torch.no_grad():
        model.decode_step(tokens, positions)
        warm = accel_graph.Graph(device="cpu")
        with accel_graph.graph(warm):
            model.decode_step(tokens, positions)
        del warm
        for _ in range(captures):
            g = accel_graph.Graph(device="cpu")
            t0 = time.perf_counter()
            with accel_graph.graph(g):
                out = model.decode_step(tokens, positions)
            times.append(time.perf_counter() - t0)
            del g, out
    with torch.inference_mode():  # the baseline the project compares against
        for _ in range(captures):
            t0 = time.perf_counter()
            model.decode_step(tokens, positions)
            eager.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1e3
    eager_med = statistics.median(eager) * 1e3
    return {
        "batch": batch,
        "captures": captures,
        "median_ms": med,
        "p10_ms": _quantile(times, 0.1) * 1e3,
        "p90_ms": _quantile(times, 0.9) * 1e3,
        "eager_median_ms": eager_med,
        "capture_vs_eager": med / eager_med,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--captures", type=int, default=50)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(b, args.captures) for b in args.batch]
    print(f"{'batch':>5} {'captures':>8} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'eager ms':>9} {'x eager':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['captures']:>8} {r['median_ms']:>10.3f} {r['p10_ms']:>8.3f} "
              f"{r['p90_ms']:>8.3f} {r['eager_median_ms']:>9.3f} {r['capture_vs_eager']:>8.2f}")
    if args.json:
        report = {
            "tool": "tools/bench_capture.py",
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                         "torch": torch.__version__, "threads": 1,
                         "loadavg": list(os.getloadavg())},
            "settings": {"batch": args.batch, "captures": args.captures},
            "rows": rows,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
