#!/usr/bin/env python
"""``accel-graph bench --models`` on several torch versions, side by side.

    python tools/bench_versions.py --venv .venv --venv .venv-2.14 --json docs/bench-versions.json
    python tools/bench_versions.py --from a.json --from b.json            # existing reports

Each ``--venv`` runs ``accel-graph bench --models`` in that venv (one after the other, never at
once: both would share the two cores) and keeps its JSON report next to ``--json``. Every ratio
comes from inside one report (one torch, one run, interleaved medians, eager under
``inference_mode`` as the baseline); this tool only lines the reports up, so a ratio is compared
across versions, never an absolute time measured in two different runs.

Prints one table (model, batch, and per torch: compiled replay vs eager, vs ``torch.compile``,
and the replay mode auto chose) and writes JSON, schema ``accel_graph.bench.versions/1``:
``{"schema", "reports": [{"torch", "file", "load_avg"}], "rows": [{"model", "batch", "by_torch":
{torch: {"compiled_vs_eager", "compiled_vs_torch_compile", "interpreted_vs_eager",
"replay_mode", "compiled_median_us"}}}]}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = "accel_graph.bench.versions/1"


def run_bench(venv: Path, out: Path, extra: list[str]) -> Path:
    """Run ``accel-graph bench --models`` in ``venv``, writing its report to ``out``."""
    exe = venv / "bin" / "accel-graph"
    if not exe.exists():
        raise SystemExit(f"bench_versions: {exe} not found: create the venv first (tools/dev.sh)")
    cmd = [str(exe), "bench", "--models", "--json", str(out), *extra]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out


def _row(rows: list[dict[str, Any]], model: str, batch: int, variant: str) -> dict[str, Any] | None:
    for r in rows:
        if (r["model"], r["batch"], r["variant"]) == (model, batch, variant) and r["status"] == "ok":
            return r
    return None


def side_by_side(reports: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The ``accel_graph.bench.versions/1`` document for ``reports`` ((file, report) pairs)."""
    keys: list[tuple[str, int]] = []
    for _, rep in reports:
        for r in rep["rows"]:
            if (r["model"], r["batch"]) not in keys:
                keys.append((r["model"], r["batch"]))
    rows = []
    for model, batch in keys:
        by_torch: dict[str, Any] = {}
        for _, rep in reports:
            comp = _row(rep["rows"], model, batch, "replay_compiled")
            interp = _row(rep["rows"], model, batch, "replay")
            mode = (comp or {}).get("replay_mode") or {}
            by_torch[rep["hardware"]["torch"]] = {
                "compiled_vs_eager": comp and comp["ratio_vs_eager"],
                "compiled_vs_torch_compile": comp and comp["ratio_vs_torch_compile"],
                "interpreted_vs_eager": interp and interp["ratio_vs_eager"],
                "replay_mode": mode.get("mode"),
                "compiled_median_us": comp and comp["median_us"],
            }
        rows.append({"model": model, "batch": batch, "by_torch": by_torch})
    return {
        "schema": SCHEMA,
        "reports": [{"torch": rep["hardware"]["torch"], "file": f, "load_avg": rep.get("load_avg"),
                     "hardware": rep["hardware"]} for f, rep in reports],
        "rows": rows,
    }


def table(doc: dict[str, Any]) -> str:
    versions = [r["torch"] for r in doc["reports"]]
    head = ["model", "batch"] + [f"{v}: {c}" for v in versions
                                 for c in ("compiled/eager", "compiled/torch.compile", "mode")]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))

    for row in doc["rows"]:
        cells = [row["model"], str(row["batch"])]
        for v in versions:
            d = row["by_torch"].get(v, {})
            cells += [fmt(d.get("compiled_vs_eager")), fmt(d.get("compiled_vs_torch_compile")),
                      fmt(d.get("replay_mode"))]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", action="append", type=Path, default=[], help="run the bench in this venv")
    p.add_argument("--from", dest="files", action="append", type=Path, default=[],
                   help="an existing accel-graph bench --models JSON report")
    p.add_argument("--json", type=Path, required=True, help="where to write the side-by-side JSON")
    args, extra = p.parse_known_args(argv)
    files = list(args.files)
    for venv in args.venv:
        out = args.json.with_name(f"{args.json.stem}-{venv.name.lstrip('.')}.json")
        files.append(run_bench(venv, out, extra))
    if len(files) < 2:
        p.error("give at least two reports (--venv or --from)")
    reports = [(str(f), json.loads(Path(f).read_text())) for f in files]
    doc = side_by_side(reports)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
