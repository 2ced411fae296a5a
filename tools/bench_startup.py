"""Start-up time of the command-line tools, before vs after: interleaved subprocess runs.

    python tools/bench_startup.py --old TREE --new TREE [--rounds 21] [--json PATH]

Each tree needs its own venv at ``TREE/.venv``. One round runs every command once with each
tree's console scripts, old then new; the table gives the median wall time per command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

COMMANDS: dict[str, list[str]] = {
    "accel-alloc --version": ["accel-alloc", "--version"],
    "accel-alloc tune --help": ["accel-alloc", "tune", "--help"],
    "accel-alloc simulate --help": ["accel-alloc", "simulate", "--help"],
    "accel-alloc inspect --help": ["accel-alloc", "inspect", "--help"],
    "accel-graph --help": ["accel-graph", "--help"],
}


def wall(argv: list[str]) -> float:
    """Seconds one run of ``argv`` takes; raises if it fails."""
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, cwd="/")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args(argv)
    trees = {"before": a.old.resolve(), "after": a.new.resolve()}
    runs: dict[str, dict[str, list[float]]] = {c: {k: [] for k in trees} for c in COMMANDS}
    for _ in range(a.rounds):
        for name, args in COMMANDS.items():
            for side, tree in trees.items():
                runs[name][side].append(wall([str(tree / ".venv" / "bin" / args[0]), *args[1:]]))
    print(f"{'command':<30}{'before s':>10}{'after s':>10}{'after/before':>14}")
    rows = []
    for name, sides in runs.items():
        b, n = statistics.median(sides["before"]), statistics.median(sides["after"])
        rows.append({"command": name, "before_s": b, "after_s": n, "ratio": n / b})
        print(f"{name:<30}{b:>10.3f}{n:>10.3f}{n / b:>14.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "tool": "tools/bench_startup.py", "rounds": a.rounds, "trees": {k: str(v) for k, v in trees.items()},
            "nproc": os.cpu_count(), "loadavg": os.getloadavg(), "rows": rows, "runs_s": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
