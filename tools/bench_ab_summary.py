"""Tables of an interleaved before/after sitting (``tools/bench_ab.sh``): medians over the runs
of each tree, with their ranges, printed as Markdown and written to ``DIR/summary.json``.

    python tools/bench_ab_summary.py DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def runs(directory: Path, name: str, tag: str) -> list[dict[str, Any]]:
    """The JSON reports ``{name}_{tag}_N.json`` of one tree, in run order."""
    return [json.loads(f.read_text()) for f in sorted(directory.glob(f"{name}_{tag}_*.json"))]


def spread(values: list[float]) -> dict[str, float | None]:
    """Median, minimum and maximum (None for no values)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(directory: Path) -> dict[str, Any]:
    """Every benchmark row of the sitting as {before, after} spreads."""
    out: dict[str, Any] = {"bench": {}, "capture_ms": {}, "allocator": {}, "replay_s": {}, "cli_s": {}}
    both = {tag: runs(directory, "bench", tag) for tag in ("old", "new")}
    for row in both["old"][0]["rows"] if both["old"] else []:
        key = (row["variant"], row["batch"])
        if row["variant"] == "eager":
            continue
        out["bench"][f"{key[0]} batch {key[1]}"] = {
            side: spread([r["ratio_vs_eager"] for d in both[tag] for r in d["rows"]
                          if (r["variant"], r["batch"]) == key and r.get("ratio_vs_eager") is not None])
            for side, tag in (("before", "old"), ("after", "new"))}
    for batch in (1, 8):
        out["capture_ms"][f"batch {batch}"] = {
            side: spread([r["median_ms"] for d in runs(directory, "cap", tag) for r in d["rows"]
                          if r["batch"] == batch])
            for side, tag in (("before", "old"), ("after", "new"))}
    alloc = {tag: runs(directory, "alloc", tag) for tag in ("old", "new")}
    for row in alloc["old"][0]["rows"] if alloc["old"] else []:
        out["allocator"][f"{row['name']} ({row['unit']})"] = {
            side: spread([r["value"] for d in alloc[tag] for r in d["rows"] if r["name"] == row["name"]])
            for side, tag in (("before", "old"), ("after", "new"))}
    for name, key in (("replay", "replay_s"), ("cli", "cli_s")):
        reports = {tag: runs(directory, name, tag) for tag in ("old", "new")}
        for stage in reports["old"][0]["median_s"] if reports["old"] else []:
            out[key][stage] = {side: spread([d["median_s"][stage] for d in reports[tag]])
                               for side, tag in (("before", "old"), ("after", "new"))}
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip(), file=sys.stderr)
        return 2
    directory = Path(argv[0])
    summary = summarise(directory)
    for section, rows in summary.items():
        print(f"\n{section}\n| row | before: median (min-max) | after: median (min-max) |\n|---|---|---|")
        for name, sides in rows.items():
            cells = [f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})" if s["median"] is not None else "-"
                     for s in (sides["before"], sides["after"])]
            print(f"| {name} | {cells[0]} | {cells[1]} |")
    (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
