"""Soak: the process's RSS slope over many capture/replay/reset cycles and many replays.

Three runs on the recorder (CPU):

- ``interpreted``: N capture/replay/reset cycles of a small pointwise program, a new Graph each
  cycle (default 10^4);
- ``compiled``: the same with ``compile="inductor"`` (default 10^4: about 2 ms a cycle once the
  program's module is cached, so the count need not be smaller; the first cycle compiles);
- ``replay``: one captured graph replayed R times (default 10^5).

RSS is sampled (``psutil``) at about 200 evenly spaced points of each run, without forcing
garbage collection (graphs must go by reference counting; the cyclic collector runs when it
would for a user). The figure is the least-squares slope in bytes per cycle over the *second half*
of the samples: the first half is warm-up (the C library's heap, interned code, caches filling).
Growth over the first half and over the whole run are reported beside it.

    python tools/soak.py [--cycles 10000] [--compiled-cycles 10000] [--replays 100000]
                         [--only interpreted,compiled,replay] [--json out.json] [--check]

Targets (issue 14): interpreted under 16 B/cycle, compiled under 1 KB/cycle; replay under 1 B
per replay. ``--check`` exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel_graph as ag  # noqa: E402

TARGETS = {"interpreted": 16.0, "compiled": 1024.0, "replay": 1.0}
SAMPLES = 200


def _program(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2 + 1  # small pointwise ops: no OpenMP barrier to wait on


def _cycle_fn(compile: str | None) -> Callable[[], None]:
    x = torch.randn(32, 32)
    expected = _program(x)

    def cycle() -> None:
        g = ag.Graph(device="cpu", compile=compile)
        with ag.graph(g):
            y = _program(x)
        g.replay()
        if compile is None and not torch.equal(y, expected):  # a soak that computes garbage
            raise AssertionError("interpreted replay differs from eager")
        g.reset()

    return cycle


def _replay_fn() -> Callable[[], None]:
    x = torch.randn(32, 32)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        _program(x)
    return g.replay


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(i, rss)`` points, bytes per step (0 for fewer than 2 points)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    return sxy / sxx if sxx else 0.0


def soak(name: str, step: Callable[[], None], n: int, prewarm: int) -> dict:
    """Run ``step`` ``prewarm`` times unmeasured, then ``n`` times with RSS sampled."""
    proc = psutil.Process()
    t0 = time.perf_counter()
    for _ in range(prewarm):
        step()
    prewarm_s = time.perf_counter() - t0
    every = max(1, n // SAMPLES)
    points = [(0, proc.memory_info().rss)]
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        step()
        if i % every == 0 or i == n:
            points.append((i, proc.memory_info().rss))
    seconds = time.perf_counter() - t0
    half = [p for p in points if p[0] >= n // 2]
    first = [p for p in points if p[0] <= n // 2]
    s = slope(half)
    return {
        "name": name,
        "steps": n,
        "prewarm_steps": prewarm,
        "prewarm_s": round(prewarm_s, 2),
        "seconds": round(seconds, 2),
        "us_per_step": round(seconds / n * 1e6, 1),
        "samples": len(points),
        "rss_start_bytes": points[0][1],
        "rss_end_bytes": points[-1][1],
        "growth_first_half_bytes": first[-1][1] - first[0][1],
        "growth_second_half_bytes": half[-1][1] - half[0][1],
        "slope_whole_bytes_per_step": round(slope(points), 2),
        "slope_bytes_per_step": round(s, 2),
        "target_bytes_per_step": TARGETS[name],
        "ok": s < TARGETS[name],
    }


def _machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def _load() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=10_000, help="interpreted cycles (10^4)")
    ap.add_argument("--compiled-cycles", type=int, default=10_000, help="compiled cycles (10^4)")
    ap.add_argument("--replays", type=int, default=100_000, help="replays of one graph (10^5)")
    ap.add_argument("--prewarm", type=int, default=20, help="unmeasured steps before each run")
    ap.add_argument("--only", default="interpreted,compiled,replay", help="comma-separated runs")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(TARGETS)
    if unknown:
        ap.error(f"unknown run(s) {sorted(unknown)}; choose from {sorted(TARGETS)}")
    report = {
        "schema_version": 1,
        "command": " ".join(["python", "tools/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(),
        "load_average_start": _load(),
        "runs": [],
    }
    plan = [
        ("interpreted", lambda: _cycle_fn(None), args.cycles),
        ("compiled", lambda: _cycle_fn("inductor"), args.compiled_cycles),
        ("replay", _replay_fn, args.replays),
    ]
    for name, make, n in plan:
        if name in only and n > 0:
            report["runs"].append(soak(name, make(), n, args.prewarm))
    report["load_average_end"] = _load()
    try:
        from accel_graph.backends.recorder.compiled.inductor import compile_cache_info

        report["compile_cache"] = compile_cache_info()
    except ImportError:  # an older tree without the module cache
        report["compile_cache"] = None

    head = f"{'run':<12} {'steps':>8} {'us/step':>9} {'1st half':>10} {'2nd half':>10} {'slope B/step':>13} {'target':>8}  ok"
    print(head)
    print("-" * len(head))
    for r in report["runs"]:
        print(f"{r['name']:<12} {r['steps']:>8} {r['us_per_step']:>9.1f} "
              f"{r['growth_first_half_bytes'] / 1024:>8.0f}KB {r['growth_second_half_bytes'] / 1024:>8.0f}KB "
              f"{r['slope_bytes_per_step']:>13.2f} {r['target_bytes_per_step']:>8.0f}  "
              f"{'yes' if r['ok'] else 'NO'}")
    m = report["machine"]
    print(f"\n{report['date_utc']} UTC, {m['cpu']} ({m['cores']} cores), torch {m['torch']}, "
          f"load average {report['load_average_start']} -> {report['load_average_end']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if args.check and not all(r["ok"] for r in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
