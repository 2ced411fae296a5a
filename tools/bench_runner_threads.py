"""Benchmark: what the GraphRunner's call guard costs at batch 1 (issue 29, item 2).

Every ``GraphRunner`` call holds a lock and checks the calling thread
(``accel_graph/runner/guard.py``). This times, interleaved in rounds, a batch-1 call through the
guarded ``runner(x)`` against the same call with the guard bypassed (``__call__`` as it was
before the guard: the grad check, then the runner's internal ``_call``), for ``copy_outputs`` False and True, and reports
medians of the per-round medians:

    .venv213/bin/python tools/bench_runner_threads.py --json /tmp/bench-runner-threads.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "rows"}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import accel_graph as ag
from accel_graph.bench.timing import hardware_info


def _time(call: Any, x: torch.Tensor, iters: int) -> float:
    """Median microseconds per call over ``iters`` timed calls."""
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        call(x)
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per variant per round")
    p.add_argument("--hidden", type=int, default=256, help="width of the two-layer MLP")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU(),
                                torch.nn.Linear(a.hidden, a.hidden)).eval()
    x = torch.randn(1, a.hidden)
    rows = []
    print(f"{'copy_outputs':>12} {'guarded us':>10} {'unguarded us':>12} {'cost us':>8} {'cost %':>7}")
    for copy in (False, True):
        runner = ag.GraphRunner(model, (torch.randn(4, a.hidden),), buckets=[1, 2, 4], device="cpu",
                                copy_outputs=copy, verify=False).capture()
        rt = runner.runtime
        def unguarded(t: torch.Tensor, r: Any = runner, rt: Any = rt) -> Any:
            """The call as it was before the guard: grad check, then the call itself."""
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return r._call(rt, (t,), {})
            return r._call(rt, (t,), {})

        variants = {"guarded": runner, "unguarded": unguarded}
        with torch.no_grad():
            for call in variants.values():  # warm both paths
                _time(call, x, 200)
            per: dict[str, list[float]] = {k: [] for k in variants}
            for k in range(a.rounds):
                order = list(variants) if k % 2 == 0 else list(reversed(variants))
                for name in order:
                    per[name].append(_time(variants[name], x, a.iters))
        g, u = statistics.median(per["guarded"]), statistics.median(per["unguarded"])
        rows.append({"copy_outputs": copy, "guarded_us": round(g, 3), "unguarded_us": round(u, 3),
                     "cost_us": round(g - u, 3), "cost_pct": round(100 * (g - u) / u, 2),
                     "rounds": per})
        print(f"{copy!s:>12} {g:>10.2f} {u:>12.2f} {g - u:>8.2f} {100 * (g - u) / u:>6.1f}%")
    if a.json is not None:
        report = {"tool": "tools/bench_runner_threads.py",
                  "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "hardware": hardware_info(),
                  "settings": {"rounds": a.rounds, "iters": a.iters, "hidden": a.hidden,
                               "batch": 1, "torch": torch.__version__},
                  "rows": rows}
        a.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
