"""Benchmark: issue 16's numbers for ``accel-alloc`` on a ~20,000-event snapshot with stack frames.

The trace: ``generate("shapes", seed=0, steps=12)`` (20,308 events) with torch-shaped frames on
every event (:func:`accel_graph.allocator.sim.torch_shaped.torch_frames`: C++ ``??`` frames,
torch's and the standard library's Python frames, then one of 24 user sites), written as a
snapshot pickle as torch writes it (frame dicts shared). Each command runs as a subprocess
(interpreter start-up, load, analysis, JSON output), ``--repeat`` times (default 3), median
wall time; its peak RSS comes from ``wait4``.

Targets (issue 16): ``inspect``, ``simulate`` (``--config expandable_segments:True``, which
also replays the recorded settings for the effect split) and ``validate`` each under 1.5 s;
``tune`` (default budget, 256 configurations) under 3 s; memory under 10x the file size, where
memory is the peak RSS above the same command's on a 100-event trace (the interpreter, numpy
and the C core are there whatever the trace). No timing is asserted anywhere in the tests.

    python tools/bench_alloc_numbers.py [--repeat 3] [--json out.json]
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

COMMANDS = {
    "inspect": ["inspect", "--json"],
    "simulate": ["simulate", "--config", "expandable_segments:True", "--json"],
    "validate": ["validate", "--json"],
    "tune": ["tune", "--json", "--no-progress"],
}
TARGET_S = {"inspect": 1.5, "simulate": 1.5, "validate": 1.5, "tune": 3.0}
MEMORY_FACTOR = 10
SITES = 24


def framed(trace: Any, seed: int = 0) -> Any:
    """``trace`` with torch-shaped frames on every event (one of :data:`SITES` user sites)."""
    import numpy as np

    from accel_graph.allocator.sim.torch_shaped import torch_frames

    rng = np.random.default_rng(seed)
    trace.stacks = [torch_frames(40 + i, f"layer_{i}",
                                 ("nn/modules/linear.py", "_tensor.py", "nn/functional.py")[i % 3])
                    for i in range(SITES)]
    ev = trace.device_traces[0]
    ev["frames"] = rng.integers(0, SITES, len(ev)).astype(np.int32)
    return trace


def _run(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one subprocess. Linux keeps a child's
    pre-exec high-water mark (the forked copy of its parent) in ``ru_maxrss``, so this runs in
    a parent that imports nothing heavy (``--measure``)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    err = p.stderr.read().decode() if p.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err[-2000:]}")
    return dt, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # KiB on Linux


def _measure(spec: str) -> int:
    """``--measure SPEC.json``: run ``{"name": [[cmd], repeat]}`` and print the results (a
    parent without numpy or the trace in memory, see :func:`_run`)."""
    jobs = json.loads(Path(spec).read_text())
    out = {name: [_run(cmd) for _ in range(n)] for name, (cmd, n) in jobs.items()}
    print(json.dumps(out))
    return 0


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "accel-alloc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "accel_graph.cli.alloc.main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.measure:
        return _measure(a.measure)
    import numpy as np
    from bench_replay import hardware

    from accel_graph.allocator.sim.generate import generate
    from accel_graph.allocator.traces import save_trace

    hw = hardware()
    trace = framed(generate("shapes", seed=0, steps=12))
    tiny = framed(generate("frag", seed=0, steps=4))
    cli = _cli()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        path, small = Path(d) / "shapes.pickle", Path(d) / "tiny.pickle"
        save_trace(trace, path)
        save_trace(tiny, small)
        size = path.stat().st_size
        jobs = {}
        for name, args in COMMANDS.items():
            jobs[name] = [cli + [args[0], str(path), *args[1:]], a.repeat]
            jobs[f"{name} floor"] = [cli + [args[0], str(small), *args[1:]], 2]
        spec = Path(d) / "jobs.json"
        spec.write_text(json.dumps(jobs))
        res = json.loads(subprocess.run([sys.executable, __file__, "--measure", str(spec)],
                                        capture_output=True, text=True, check=True).stdout)
        for name in COMMANDS:
            runs, floor = res[name], max(r[2] for r in res[f"{name} floor"])
            t = float(np.median([r[0] for r in runs]))
            cpu = float(np.median([r[1] for r in runs]))
            rss = max(r[2] for r in runs)
            rows[name] = {"median_s": round(t, 3), "best_s": round(min(r[0] for r in runs), 3),
                          "cpu_s": round(cpu, 3), "target_s": TARGET_S[name],
                          "met": t < TARGET_S[name], "cpu_met": cpu < TARGET_S[name],
                          "peak_rss_mib": round(rss / 2**20, 1),
                          "floor_rss_mib": round(floor / 2**20, 1),
                          "memory_over_file": round((rss - floor) / size, 2),
                          "memory_met": rss - floor < MEMORY_FACTOR * size}
    hw_after = hardware()
    out = {"events": len(trace.events(0)), "tiny_events": len(tiny.events(0)),
           "file_mib": round(size / 2**20, 2), "repeat": a.repeat, "rows": rows,
           "hardware": {k: (list(v) if isinstance(v, tuple) else v) for k, v in hw.items()}}
    print(f"trace: generate('shapes', seed=0, steps=12) + torch-shaped frames: "
          f"{out['events']:,} events, snapshot pickle {out['file_mib']} MiB; memory floor: the "
          f"same command on a {out['tiny_events']}-event trace")
    print(f"{'command':<10}{'median s':>10}{'best s':>9}{'CPU s':>8}{'target':>10}{'peak RSS':>11}"
          f"{'floor':>9}{'(RSS-floor)/file':>18}")
    for name, r in rows.items():
        print(f"{name:<10}{r['median_s']:>10.3f}{r['best_s']:>9.3f}{r['cpu_s']:>8.3f}"
              f"{'< ' + format(r['target_s'], 'g') + (' ok' if r['met'] else ' MISS'):>10}"
              f"{r['peak_rss_mib']:>9.1f}Mi{r['floor_rss_mib']:>7.1f}Mi"
              f"{r['memory_over_file']:>13.2f}x {'ok' if r['memory_met'] else 'MISS'}")
    out["load_after"] = list(hw_after["loadavg"])  # type: ignore[call-overload]
    print(f"hardware: nproc {hw['nproc']}, {hw['cpu']}, python {hw['python']}, load average "
          f"{tuple(round(x, 2) for x in hw['loadavg'])} -> "  # type: ignore[attr-defined]
          f"{tuple(round(x, 2) for x in hw_after['loadavg'])} (wall times grow with load; "  # type: ignore[attr-defined]
          "CPU s = user + system of the process)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
