"""Benchmark: ``accel-alloc tune`` and ``accel-alloc simulate`` end to end.

(a) ``tune`` over the default budget (256 configurations) of a ~20,000-event generated trace
    (``generate("shapes", seed=0, steps=12)``: 20,308 events, variable sequence lengths), timed
    in-process (:func:`accel_graph.allocator.tune.search.tune`, trace already loaded) and as a
    subprocess (``accel-alloc tune TRACE --json --no-progress``, load included), also with
    ``--jobs 2``. Target: < 30 s.
(b) ``accel-alloc simulate`` of a 1,000,000-event trace in the compact format, as a subprocess
    (``--json``; load, convert, one C replay, output). The trace is tools/bench_replay.py's
    synthetic builder (imported, not duplicated). Target: < 2 s.

Also timed: ``accel-alloc --version`` (the interpreter and CLI start-up floor). Medians of
``--repeat`` runs (default 5), interleaved. Prints a table; ``--json PATH`` writes the figures
with the hardware (nproc, CPU model, load average before and after).

    python tools/bench_alloc_cli.py [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_replay import hardware, synthetic_trace  # noqa: E402

from accel_graph.allocator.sim.generate import generate  # noqa: E402
from accel_graph.allocator.traces import save_trace  # noqa: E402
from accel_graph.allocator.tune.search import DEFAULT_BUDGET, tune  # noqa: E402

TUNE_WORKLOAD = {"workload": "shapes", "seed": 0, "steps": 12}


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "accel-alloc"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "accel_graph.cli.alloc.main"]


def _timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    return dt, p.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--events", type=int, default=1_000_000, help="simulate benchmark size")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    hw_before = hardware()
    cli = _cli()
    wl = dict(TUNE_WORKLOAD)
    trace = generate(wl.pop("workload"), **wl)
    n_tune_events = len(trace.events(0))
    big = synthetic_trace(a.events)
    n_big = len(big.events(0))
    rows: dict[str, list[float]] = {
        "tune in-process": [], "tune subprocess": [], "tune subprocess --jobs 2": [],
        "simulate 1M subprocess": [], "accel-alloc --version": [],
    }
    info: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as d:
        tpath, bpath = Path(d) / "shapes.agtrace", Path(d) / "synthetic1m.agtrace"
        save_trace(trace, tpath, format="compact")
        save_trace(big, bpath, format="compact")
        info["compact_mib_1m"] = round(bpath.stat().st_size / 2**20, 1)
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r = tune(trace)
            rows["tune in-process"].append(time.perf_counter() - t0)
            info["evaluated"] = r.evaluated
            info["alternatives"] = len(r.alternatives)
            info["recommended"] = r.recommended.config
            dt, out = _timed(cli + ["tune", str(tpath), "--json", "--no-progress"])
            rows["tune subprocess"].append(dt)
            info["evaluated_cli"] = json.loads(out)["evaluated"]
            dt, _ = _timed(cli + ["tune", str(tpath), "--json", "--no-progress", "--jobs", "2"])
            rows["tune subprocess --jobs 2"].append(dt)
            dt, out = _timed(cli + ["simulate", str(bpath), "--json"])
            rows["simulate 1M subprocess"].append(dt)
            sim = json.loads(out)["predicted"]
            info["simulate_ops"] = sim["ops"]
            info["simulate_replay_seconds"] = sim["replay_seconds"]
            dt, _ = _timed(cli + ["--version"])
            rows["accel-alloc --version"].append(dt)
    per_cfg = float(np.median(rows["tune in-process"])) / (
        int(info["evaluated"]) + int(info["alternatives"]))  # type: ignore[call-overload]
    hw_after = hardware()
    targets = {"tune subprocess": 30.0, "tune in-process": 30.0, "simulate 1M subprocess": 2.0}
    print(f"tune trace: generate({TUNE_WORKLOAD}) = {n_tune_events:,} events; "
          f"{info['evaluated']} configurations + {info['alternatives']} policy rows "
          f"(budget {DEFAULT_BUDGET}); recommended {info['recommended']!r}")
    print(f"simulate trace: tools/bench_replay.py synthetic_trace({a.events}) = {n_big:,} events, "
          f"{info['simulate_ops']:,} ops, compact {info['compact_mib_1m']} MiB; "
          f"C replay {info['simulate_replay_seconds']:.3f} s")
    print(f"{'row':<28}{'median s':>10}{'best s':>10}{'target':>10}")
    for k, v in rows.items():
        t = targets.get(k)
        mark = "" if t is None else (f"< {t:g}" + (" ok" if np.median(v) < t else " MISS"))
        print(f"{k:<28}{float(np.median(v)):>10.3f}{min(v):>10.3f}{mark:>10}")
    print(f"per configuration (in-process median / evaluations): {per_cfg * 1000:.1f} ms")
    print(f"hardware: nproc {hw_before['nproc']}, {hw_before['cpu']}, load average "
          f"{tuple(round(x, 2) for x in hw_before['loadavg'])} -> "  # type: ignore[attr-defined]
          f"{tuple(round(x, 2) for x in hw_after['loadavg'])}")  # type: ignore[attr-defined]
    if a.json:
        Path(a.json).write_text(json.dumps({
            "tool": "tools/bench_alloc_cli.py",
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "repeat": a.repeat,
            "tune_trace": {**TUNE_WORKLOAD, "events": n_tune_events},
            "simulate_trace": {"builder": "tools/bench_replay.py:synthetic_trace",
                               "events": n_big},
            "info": info,
            "median_s": {k: float(np.median(v)) for k, v in rows.items()},
            "best_s": {k: min(v) for k, v in rows.items()},
            "runs_s": rows,
            "per_config_ms": round(per_cfg * 1000, 3),
            "targets_s": targets,
            "targets_met": all(float(np.median(rows[k])) < t for k, t in targets.items()),
            "hardware": hw_before, "loadavg_after": hw_after["loadavg"],
            "cpu_count_affinity": len(os.sched_getaffinity(0)),
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
