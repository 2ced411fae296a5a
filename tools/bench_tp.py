"""Benchmark: the TP=2 decoder on two local CPU processes, replay vs eager under one process group.

The goal (issue 19): interpreted replay at most 0.9x eager's time per decode step at batch 1,
eager under ``torch.inference_mode()`` being the baseline, both on the same gloo group. Runs
:func:`accel_graph.bench.tp.run_tp` ``--runs`` times (each a fresh pair of processes; the
variants are interleaved within each run, medians per run) and reports every run and the median
over runs, with the step's all-reduces timed alone, which is the part of the step no graph
removes (so ``eager - allreduce`` is the compute replay can speed up):

    bash tools/dev.sh run python tools/bench_tp.py --json docs/bench-tp.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "runs":
[accel_graph.tp/1 reports, rank lists trimmed to rank 0], "summary"}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from accel_graph.bench.timing import hardware_info
from accel_graph.bench.tp import TPSettings, run_tp


def _load() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every run's TP tokens matched the single-process model's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="fresh process pairs (default 3)")
    p.add_argument("--iters", type=int, default=1000, help="timed steps per variant per run")
    p.add_argument("--gen-rounds", type=int, default=10, help="greedy generations per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--compile", action="store_true", help="compiled (inductor) replay")
    p.add_argument("--collective", choices=("c10d", "functional"), default="c10d")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    settings = TPSettings(buckets=(1,), iters=a.iters, gen_rounds=a.gen_rounds, threads=a.threads,
                          compile="inductor" if a.compile else None, collective=a.collective)
    runs: list[dict[str, Any]] = []
    print(f"{'run':>3} {'load':>15} {'eager TP us':>11} {'replay TP us':>12} {'ratio':>6} "
          f"{'allreduce us':>12} {'compute e/r us':>15} {'1p eager':>8} {'1p replay':>9} "
          f"{'tok/s eager':>11} {'tok/s replay':>12}")
    for k in range(a.runs):
        load = _load()
        r = run_tp(settings)
        r["load_before"] = load
        r["ranks"] = r["ranks"][:1]
        runs.append(r)
        st, sp, tps = r["step_us"], r["single_process"]["step_us"], r["ranks"][0]["tokens_per_s"] or {}
        print(f"{k:>3} {load:>15} {st['eager_tp']:>11.0f} {st['replay_tp']:>12.0f} "
              f"{r['replay_over_eager']:>6.2f} {st['allreduce_only']:>12.0f} "
              f"{st['eager_compute_only']:>7.0f}/{st['replay_compute_only']:<7.0f} {sp['eager']:>8.0f} "
              f"{sp['replay']:>9.0f} {tps.get('eager_tp', 0):>11.0f} {tps.get('replay_tp', 0):>12.0f}",
              flush=True)

    def med(key: str, *path: str) -> float:
        vals = []
        for r in runs:
            v: Any = r
            for part in path:
                v = v[part]
            vals.append(v[key])
        return statistics.median(vals)

    summary = {
        "eager_tp_us": med("eager_tp", "step_us"),
        "replay_tp_us": med("replay_tp", "step_us"),
        "allreduce_only_us": med("allreduce_only", "step_us"),
        "replay_over_eager": med("replay_over_eager"),
        "single_eager_us": med("eager", "single_process", "step_us"),
        "single_replay_us": med("replay", "single_process", "step_us"),
        "eager_compute_only_us": med("eager_compute_only", "step_us"),
        "replay_compute_only_us": med("replay_compute_only", "step_us"),
        "checks_ok": all(r["check"]["ok"] for r in runs),
        "captured": runs[0]["ranks"][0]["buckets"],
    }
    s = summary
    print(f"median over {a.runs} runs: eager TP {s['eager_tp_us']:.0f} us, replay TP "
          f"{s['replay_tp_us']:.0f} us, ratio {s['replay_over_eager']:.2f} (goal <= 0.90); "
          f"all-reduces alone {s['allreduce_only_us']:.0f} us; one rank's compute alone "
          f"{s['eager_compute_only_us']:.0f} us eager, {s['replay_compute_only_us']:.0f} us replay; "
          f"single process {s['single_eager_us']:.0f} / {s['single_replay_us']:.0f} us; checks "
          f"{'OK' if s['checks_ok'] else 'FAILED'}")
    if a.json is not None:
        doc = {"tool": "tools/bench_tp.py",
               "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "hardware": hardware_info() | {"threads": a.threads},
               "settings": vars(a) | {"json": str(a.json)}, "runs": runs, "summary": summary}
        a.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {a.json}")
    return 0 if summary["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
