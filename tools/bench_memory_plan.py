"""Issue 28 item 4: ``GraphRunner.plan_memory()`` against interpreted ``capture()`` of the same
ladder, and the plan's figures against what capture measures.

Usage::

    python tools/bench_memory_plan.py [--reps 5] [--threads 2] [--json bench_memory_plan.json]

Cases: the bundled decoder's decode step over a 51-bucket ladder (1..51, ``DecoderConfig``
defaults otherwise) and the bundled ResNet over 1, 2, 4, 8, 16. For each case:

- **cold**: a fresh process per measurement (imports done, model built, then one timed call):
  ``plan_memory()`` alone, ``capture()`` alone; ``--cold-reps`` of each, interleaved, medians. The first plan or capture in a process pays the
  recorder's per-op planning (meta execution, cached process-wide by op and shape), so this is
  what a server pays at start-up;
- **warm**: in one process, after one untimed plan and capture, ``--reps`` rounds of a fresh
  runner's ``plan_memory()`` and a fresh runner's ``capture()``, interleaved; medians;
- the planned pool, peak and per-bucket figures against ``memory_report()`` after capture
  (largest relative difference over the buckets; the issue's rule is 5% or one 2 MiB segment).

Prints a table and writes JSON (schema ``accel_graph.bench.memory-plan/1``): per case
``cold_plan_s``, ``cold_capture_s``, ``warm_plan_s``, ``warm_capture_s`` (medians), ``plan``
and ``measured`` pool figures, ``max_bucket_diff_bytes``. Timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

CASES = ("decoder51", "resnet5")


def _runner(case: str) -> Any:
    import torch

    import accel_graph
    from accel_graph.models.decoder import Decoder, DecoderConfig
    from accel_graph.models.resnet import ResNet

    if case == "decoder51":
        model = Decoder(DecoderConfig(max_batch=51))
        ex = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        return lambda: accel_graph.GraphRunner(model.decode_step, ex, buckets=list(range(1, 52)),
                                               progress=False, verify=False)
    model = ResNet()
    x = model.example_input(1)
    return lambda: accel_graph.GraphRunner(model, x, buckets=[1, 2, 4, 8, 16], progress=False,
                                           verify=False)


def _one(case: str, what: str, threads: int) -> float:
    """Time one cold ``plan_memory()`` or ``capture()`` (run in a child process)."""
    import torch

    torch.set_num_threads(threads)
    make = _runner(case)
    runner = make()
    t0 = time.perf_counter()
    if what == "plan":
        runner.plan_memory()
    else:
        runner.capture()
    return time.perf_counter() - t0


def _cold(case: str, what: str, threads: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", case, what, "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def _warm(case: str, reps: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    make = _runner(case)
    make().plan_memory()
    make().capture()
    plans, caps = [], []
    plan = report = None
    for _ in range(reps):
        r = make()
        t0 = time.perf_counter()
        plan = r.plan_memory()
        plans.append(time.perf_counter() - t0)
        r2 = make()
        t0 = time.perf_counter()
        r2.capture()
        caps.append(time.perf_counter() - t0)
        report = r2.memory_report()
    assert plan is not None and report is not None
    measured = {b["bucket"]: b for b in report["buckets"]}
    diff = max(max(abs(b["incremental_bytes"] - measured[b["bucket"]]["incremental_bytes"]),
                   abs(b["standalone_bytes"] - measured[b["bucket"]]["standalone_bytes"]))
               for b in plan["buckets"])
    return {
        "warm_plan_s": statistics.median(plans), "warm_capture_s": statistics.median(caps),
        "plan": {k: plan[k] for k in ("pool_reserved_bytes", "pool_peak_reserved_bytes",
                                      "warmup_peak_bytes", "static_output_bytes")},
        "measured": {k: report[k] for k in ("pool_reserved_bytes", "pool_peak_reserved_bytes",
                                            "output_region_bytes")},
        "buckets": len(plan["buckets"]),
        "max_bucket_diff_bytes": diff,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cold-reps", type=int, default=3, help="fresh processes per cold figure")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="bench_memory_plan.json")
    p.add_argument("--child", nargs=2, metavar=("CASE", "WHAT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(_one(args.child[0], args.child[1], args.threads))
        return 0
    rows = []
    for case in CASES:
        row: dict[str, Any] = {"case": case, "threads": args.threads}
        cold: dict[str, list[float]] = {"plan": [], "capture": []}
        for _ in range(args.cold_reps):  # interleaved: load on the machine hits both alike
            for what in ("plan", "capture"):
                cold[what].append(_cold(case, what, args.threads))
        row["cold_plan_s"] = statistics.median(cold["plan"])
        row["cold_capture_s"] = statistics.median(cold["capture"])
        row["cold_runs"] = cold
        row.update(_warm(case, args.reps, args.threads))
        rows.append(row)
    mib = 2 ** 20
    head = (f"{'case':<10} {'buckets':>7} {'cold plan':>10} {'cold capture':>13} {'warm plan':>10} "
            f"{'warm capture':>13} {'pool plan/meas MiB':>19} {'max bucket diff':>16}")
    print(head)
    for r in rows:
        print(f"{r['case']:<10} {r['buckets']:>7} {r['cold_plan_s']:>9.2f}s {r['cold_capture_s']:>12.2f}s "
              f"{r['warm_plan_s']:>9.3f}s {r['warm_capture_s']:>12.3f}s "
              f"{r['plan']['pool_reserved_bytes'] / mib:>9.1f}/{r['measured']['pool_reserved_bytes'] / mib:<9.1f} "
              f"{r['max_bucket_diff_bytes']:>16}")
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"schema": "accel_graph.bench.memory-plan/1", "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
