"""Benchmark: whole-trace replay of a synthetic 1,000,000-event trace (native policy).

Generates a simple trace (not the calibrated generator): n/3 allocations of mixed sizes, each
freed (free_requested + free_completed) after a random lag, on one stream; saves it in the
compact format; then times load -> op conversion -> one Engine.replay call.

    python tools/bench_replay.py [--events 1000000] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_graph.allocator.sim.replayer import replay_trace  # noqa: E402
from accel_graph.allocator.sim.trace_ops import build_ops
from accel_graph.allocator.traces import Trace, load_trace, save_trace  # noqa: E402
from accel_graph.allocator.traces.actions import ACTION_CODE  # noqa: E402
from accel_graph.allocator.traces.record import TRACE_DTYPE  # noqa: E402


def synthetic_trace(n_events: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    n = n_events // 3
    kind = rng.random(n)
    size = np.where(kind < 0.6, rng.integers(1, 64 * 1024, n),
                    np.where(kind < 0.95, rng.integers(64 * 1024, 4 << 20, n),
                             rng.integers(4 << 20, 64 << 20, n)))
    lag = rng.geometric(1 / 40, n)  # each block lives ~40 allocations
    t_alloc = np.arange(n, dtype=np.float64)
    t_free = t_alloc + lag + 0.5
    addr = (1 << 44) + np.arange(n, dtype=np.uint64) * np.uint64(1 << 26)  # unique per block
    ev = np.zeros(3 * n, dtype=TRACE_DTYPE)
    key = np.concatenate((t_alloc, t_free, t_free + 0.25))
    ev["action"] = np.repeat([ACTION_CODE["alloc"], ACTION_CODE["free_requested"],
                              ACTION_CODE["free_completed"]], n)
    ev["addr"] = np.tile(addr, 3)
    ev["size"] = np.tile(size, 3)
    ev["frames"] = -1
    ev["time_us"] = -1
    ev = ev[np.argsort(key, kind="stable")]
    return Trace([ev], [], None, "cuda")


def hardware() -> dict[str, object]:
    model = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), model)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "loadavg": os.getloadavg(),
            "python": platform.python_version(), "numpy": np.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args(argv)
    trace = synthetic_trace(a.events)
    rows: dict[str, list[float]] = {"load compact": [], "convert to ops": [],
                                    "replay inside C": [], "end to end": []}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.agt"
        save_trace(trace, path)
        size = path.stat().st_size
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            t = load_trace(path)
            t1 = time.perf_counter()
            build_ops(t)
            t2 = time.perf_counter()
            r = replay_trace(t)  # converts again, then one Engine.replay call
            t3 = time.perf_counter()
            rows["load compact"].append(t1 - t0)
            rows["convert to ops"].append(t2 - t1)
            rows["replay inside C"].append(r.replay_seconds)
            rows["end to end"].append((t1 - t0) + (t3 - t2))
    n_ev = len(trace.events(0))
    print(f"synthetic trace: {n_ev:,} events, {r.n_ops:,} ops, compact file {size / 2**20:.1f} MiB;"
          f" peak reserved {r.peak_reserved / 2**20:.0f} MiB, {r.device_mallocs} device mallocs")
    print(f"{'step':<18}{'best s':>10}{'median s':>10}")
    for k, v in rows.items():
        print(f"{k:<18}{min(v):>10.3f}{float(np.median(v)):>10.3f}")
    hw = hardware()
    print(f"hardware: {hw}")
    ok = min(rows["replay inside C"]) < 1.0 and min(rows["end to end"]) < 2.0
    print("targets (C < 1 s, end to end < 2 s):", "met" if ok else "NOT met")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "events": n_ev, "ops": r.n_ops, "compact_bytes": size,
            "best_s": {k: min(v) for k, v in rows.items()},
            "median_s": {k: float(np.median(v)) for k, v in rows.items()},
            "targets_met": ok, "hardware": hw}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
