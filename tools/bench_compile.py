"""Compile cost of compiled replay (issue 15, item 3): cold, warm, recapture, cycles, workers.

Measured on the bundled decoder's decode step at batch 1 (``Graph(device="cpu",
compile="inductor")``), one torch thread, each figure from ``Graph.compile_info()["compile_s"]``
(the seconds instantiation spent building the FX graph and compiling it, or fetching the module
from the process-wide cache):

- ``cold``: the first compile in a fresh process with an empty Inductor cache directory
  (``TORCHINDUCTOR_CACHE_DIR`` set to a new temporary directory);
- ``warm``: the first compile in another fresh process over the same, now filled, directory:
  Inductor's FX graph cache hits (issue goal: under 0.5 s);
- ``2nd in process``: the same program captured again in the cold child after emptying our
  module cache (``clear_compile_cache()``): an FX graph cache hit without the once-per-process
  costs of torch's first compile;
- ``recapture``: an identical capture in the same process after the first (goal: no compile at
  all, ``cache == "hit"``), measured in both child processes;
- ``cycles``: N capture/replay/reset cycles of the identical compiled graph in one process: RSS
  (``psutil``) sampled at ~100 points, least-squares slope over the second half in bytes per
  1000 cycles, growth per cycle in each quarter of the run (RSS grows over the first ~700
  cycles on the decoder, then stays flat), and ``compile_cache_info()`` before and after
  (issue goal: memory flat);
- ``workers``: ``GraphRunner(decode_step, buckets=..., compile="inductor").capture()`` in a
  fresh process with an empty cache directory per run, for each Inductor ``compile_threads``
  value (``TORCHINDUCTOR_COMPILE_THREADS``: parallel C++ kernel compiles within one graph);
  runs interleaved over ``--repeats``, medians.

    python tools/bench_compile.py [--cycles N] [--workers 1 2 4] [--buckets 1 2 4 8]
                                  [--repeats R] [--skip cycles,workers] [--json out.json]

Prints a table; ``--json`` writes the report. Numbers from a loaded machine are inflated; the
load average is reported with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = "accel_graph.bench_compile/1"


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _capture_step(batch: int = 1) -> tuple[Any, Any, Any]:
    """One compiled capture of the decode step: ``(graph, model, args)``."""
    import torch

    import accel_graph as ag
    from accel_graph.bench.decode import prepare_decoder
    from accel_graph.models import DecoderConfig

    model, tokens, pos = prepare_decoder(DecoderConfig(), 16)
    args = (tokens[:batch].clone(), pos[:batch].clone())
    with torch.inference_mode():
        model.decode_step(*args)
        g = ag.Graph(device="cpu", compile="inductor")
        with ag.graph(g):
            model.decode_step(*args)
    return g, model, args


def child_compile() -> dict[str, Any]:
    """In a child process: first compile, then an identical recapture."""
    import torch

    import accel_graph as ag
    from accel_graph.backends.recorder.compiled.inductor import (
        clear_compile_cache,
        compile_cache_info,
    )

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    g, model, args = _capture_step()
    first_wall = time.perf_counter() - t0
    first = g.compile_info() or {}
    with torch.inference_mode():
        g2 = ag.Graph(device="cpu", compile="inductor")
        t0 = time.perf_counter()
        with ag.graph(g2):
            model.decode_step(*args)
        again_wall = time.perf_counter() - t0
    again = g2.compile_info() or {}
    cache_info = compile_cache_info()
    # The same program again with our module cache emptied: Inductor's FX graph cache hits, and
    # the once-per-process costs of the first compile (imports aside: torch's source hash, the
    # vector-ISA probe build, compiler probes) are already paid.
    clear_compile_cache()
    before = _fxgraph()
    with torch.inference_mode():
        g3 = ag.Graph(device="cpu", compile="inductor")
        with ag.graph(g3):
            model.decode_step(*args)
    third = g3.compile_info() or {}
    after = _fxgraph()
    return {
        "first": {"compile_s": first.get("compile_s"), "cache": first.get("cache"),
                  "fallback": first.get("fallback"), "capture_wall_s": first_wall},
        "recapture": {"compile_s": again.get("compile_s"), "cache": again.get("cache"),
                      "capture_wall_s": again_wall},
        "fx_cache_hit_in_process": {"compile_s": third.get("compile_s"), "cache": third.get("cache"),
                                    "fxgraph_cache": {k: after[k] - before.get(k, 0) for k in after}},
        "fxgraph_cache": _fxgraph(),
        "compile_cache": cache_info,  # after the recapture, before the cache was cleared
    }


def _fxgraph() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters

        return {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    except Exception:  # private API
        return {}


def child_runner(buckets: list[int]) -> dict[str, Any]:
    """In a child process: capture a compiled GraphRunner over ``buckets``; its stats."""
    import torch

    from accel_graph import GraphRunner
    from accel_graph.models import Decoder, DecoderConfig

    torch.set_num_threads(1)
    from torch._inductor import config as inductor_config

    model = Decoder(DecoderConfig(max_batch=max(buckets)))
    example = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(model.decode_step, example, buckets=buckets, compile="inductor",
                         progress=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.capture()
    wall = time.perf_counter() - t0
    st = runner.stats()
    return {"compile_threads": inductor_config.compile_threads, "capture_wall_s": wall,
            "capture_seconds": st["capture_seconds"], "compile_seconds": st["compile_seconds"],
            "captured": st["captured_buckets"],
            "compile_ms": [b["compile_ms"] for b in st["buckets"]]}


def _spawn(mode: str, env: dict[str, str], extra: list[str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "failed", "reason": " | ".join(tail)}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - t0
    out["status"] = "ok"
    return out


def measure_cold_warm() -> dict[str, Any]:
    """(a)-(c): two child processes over one fresh Inductor cache directory."""
    with tempfile.TemporaryDirectory(prefix="ag-inductor-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        cold = _spawn("compile", env)
        warm = _spawn("compile", env)
    return {"cold": cold, "warm": warm}


def measure_cycles(n: int) -> dict[str, Any]:
    """(d): N capture/replay/reset cycles of one compiled program in this process."""
    import psutil
    import torch

    import accel_graph as ag
    from accel_graph.backends.recorder.compiled.inductor import compile_cache_info

    torch.set_num_threads(1)
    g, model, args = _capture_step()
    proc = psutil.Process()
    before = compile_cache_info()
    every = max(1, n // 100)
    points: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(n):
            g = ag.Graph(device="cpu", compile="inductor")
            with ag.graph(g):
                model.decode_step(*args)
            g.replay()
            g.reset()
            if i % every == 0 or i == n - 1:
                points.append((i, proc.memory_info().rss))
    wall = time.perf_counter() - t0
    half = points[len(points) // 2:]
    xs, ys = [p[0] for p in half], [p[1] for p in half]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0
    q = len(points) // 4
    quarters = [(points[a][1] - points[b][1]) / max(1, points[a][0] - points[b][0])
                for b, a in ((0, q), (q, 2 * q), (2 * q, 3 * q), (3 * q, len(points) - 1))]
    return {"cycles": n, "wall_s": wall, "ms_per_cycle": wall / n * 1e3,
            "growth_bytes_per_cycle_by_quarter": quarters,
            "rss_start_bytes": points[0][1], "rss_end_bytes": points[-1][1],
            "rss_slope_bytes_per_1000_cycles": slope * 1000,
            "compile_cache_before": before, "compile_cache_after": compile_cache_info()}


def measure_workers(workers: list[int], buckets: list[int], repeats: int) -> dict[str, Any]:
    """(e): cold runner captures per compile_threads value, interleaved, medians."""
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in workers}
    for _ in range(repeats):
        for w in workers:
            with tempfile.TemporaryDirectory(prefix="ag-inductor-") as cache:
                env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": str(w)}
                runs[w].append(_spawn("runner", env, ["--buckets", *map(str, buckets)]))
    rows = []
    for w, rs in runs.items():
        ok = [r for r in rs if r["status"] == "ok"]
        rows.append({
            "compile_threads": w, "runs": len(rs), "ok": len(ok),
            "reason": next((r["reason"] for r in rs if r["status"] != "ok"), None),
            "capture_seconds_median": statistics.median(r["capture_seconds"] for r in ok) if ok else None,
            "compile_seconds_median": statistics.median(r["compile_seconds"] for r in ok) if ok else None,
            "all": rs,
        })
    return {"buckets": buckets, "repeats": repeats, "rows": rows}


def _f(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def format_report(r: dict[str, Any]) -> str:
    lines = [f"tools/bench_compile.py: decoder decode step, batch 1 | torch {r['torch']} | "
             f"nproc {r['nproc']} | load avg {r['load_avg']['start']} -> {r['load_avg']['end']}", ""]
    cw = r.get("cold_warm")
    if cw:
        lines.append(f"{'measure':<34} {'compile_s':>9} {'cache':>6}  note")
        for name in ("cold", "warm"):
            c = cw[name]
            if c["status"] != "ok":
                lines.append(f"{name:<34} {'-':>9} {'-':>6}  failed: {c['reason']}")
                continue
            fx = c["fxgraph_cache"]
            lines.append(f"{name + ' (first compile, new process)':<34} {_f(c['first']['compile_s']):>9} "
                         f"{c['first']['cache'] or '-':>6}  FX graph cache {fx}, "
                         f"process {c['process_wall_s']:.1f} s")
            fh = c["fx_cache_hit_in_process"]
            lines.append(f"{name + ': same program, 2nd in process':<34} {_f(fh['compile_s']):>9} "
                         f"{fh['cache'] or '-':>6}  our module cache cleared first; FX graph cache "
                         f"{fh['fxgraph_cache']}")
            lines.append(f"{name + ': identical recapture':<34} {_f(c['recapture']['compile_s'], '.4f'):>9} "
                         f"{c['recapture']['cache'] or '-':>6}  capture {c['recapture']['capture_wall_s'] * 1e3:.1f} ms, "
                         f"compile_cache_info {c['compile_cache']}")
    cy = r.get("cycles")
    if cy:
        lines += ["", f"cycles: {cy['cycles']} capture/replay/reset of one compiled graph, "
                  f"{cy['ms_per_cycle']:.2f} ms/cycle, RSS {cy['rss_start_bytes'] / 2**20:.1f} -> "
                  f"{cy['rss_end_bytes'] / 2**20:.1f} MiB, slope (2nd half) "
                  f"{cy['rss_slope_bytes_per_1000_cycles'] / 1024:.1f} KiB per 1000 cycles",
                  "        RSS growth per cycle by quarter of the run: "
                  + ", ".join(f"{x:.0f} B" for x in cy["growth_bytes_per_cycle_by_quarter"]),
                  f"        compile_cache_info {cy['compile_cache_before']} -> {cy['compile_cache_after']}"]
    wk = r.get("workers")
    if wk:
        lines += ["", f"GraphRunner(compile='inductor') capture, buckets {wk['buckets']}, cold cache, "
                  f"{wk['repeats']} interleaved run(s) each, medians",
                  f"{'compile_threads':>15} {'capture s':>10} {'compile s':>10}  runs"]
        for row in wk["rows"]:
            each = ", ".join(_f(x.get("capture_seconds"), ".1f") for x in row["all"])
            lines.append(f"{row['compile_threads']:>15} {_f(row['capture_seconds_median'], '.1f'):>10} "
                         f"{_f(row['compile_seconds_median'], '.1f'):>10}  [{each}]"
                         + (f" failed: {row['reason']}" if row["reason"] else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=2000, help="capture/replay/reset cycles (default 2000)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                   help="Inductor compile_threads values to compare (default 1 2 4)")
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="the runner's bucket ladder for --workers (default 1 2 4 8)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs per workers value")
    p.add_argument("--skip", default="", help="comma list of cold_warm,cycles,workers to skip")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child == "compile":
        print(json.dumps(child_compile()))
        return 0
    if a.child == "runner":
        print(json.dumps(child_runner(a.buckets)))
        return 0
    skip = {s for s in a.skip.split(",") if s}
    if unknown := skip - {"cold_warm", "cycles", "workers"}:
        p.error(f"--skip: unknown {sorted(unknown)}")
    if a.cycles < 2 or a.repeats < 1 or any(w < 1 for w in a.workers):
        p.error("--cycles must be >= 2, --repeats >= 1 and --workers values >= 1")
    import torch

    from accel_graph.bench.timing import hardware_info

    report: dict[str, Any] = {"schema": SCHEMA, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "torch": torch.__version__, "nproc": hardware_info()["nproc"],
                              "hardware": hardware_info(), "load_avg": {"start": _load()}}
    if "cold_warm" not in skip:
        report["cold_warm"] = measure_cold_warm()
    if "cycles" not in skip:
        report["cycles"] = measure_cycles(a.cycles)
    if "workers" not in skip:
        report["workers"] = measure_workers(a.workers, sorted(set(a.buckets)), a.repeats)
    report["load_avg"]["end"] = _load()
    sys.stdout.write(format_report(report))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
