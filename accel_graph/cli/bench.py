"""``accel-graph bench``: the decode-step benchmark as a command (table on stdout, JSON on request).

The measurement itself lives in :mod:`accel_graph.bench.decode`; this module parses options,
prints the table and writes the JSON report (schema in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .output import write_json

__all__ = ["add_arguments", "format_report", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph bench``."""
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1, 8],
        metavar="B",
        help="batch sizes of the decode step (default: 1 8)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        metavar="N",
        default=1000,
        help="timed calls per variant and batch size (default: 1000)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        default=20,
        help="untimed calls per variant and batch size first (default: 20)",
    )
    parser.add_argument(
        "--calls-per-round",
        type=int,
        metavar="N",
        default=10,
        help="calls of one variant in a row within each interleaved round (default: 10)",
    )
    parser.add_argument(
        "--alloc-calls",
        type=int,
        metavar="N",
        default=20,
        help="profiled calls per variant for the allocation count (default: 20)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="T",
        help="torch intra-op threads during the run (default: 1)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the report as JSON to PATH",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the torch.compile variant (it needs a C++ compiler and time)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with ``args``, print the table, write ``--json``; returns 0."""
    from ..bench.decode import DecodeBenchSettings, run_decode_bench

    settings = DecodeBenchSettings(
        batches=tuple(args.batch),
        iters=args.iters,
        warmup=args.warmup,
        calls_per_round=args.calls_per_round,
        threads=args.threads,
        compile=not args.no_compile,
        alloc_calls=args.alloc_calls,
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    report = run_decode_bench(settings)
    sys.stdout.write(format_report(report))
    if args.json is not None:
        write_json(args.json, report)  # strict JSON, keys in the report's order
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


def _load(load: dict[str, Any] | None) -> str:
    if not load or not load.get("start") or not load.get("end"):
        return "-"
    return f"{load['start'][0]:.2f} -> {load['end'][0]:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of a report from ``run_decode_bench``."""
    hw, st = report["hardware"], report["settings"]
    lines = [
        f"accel-graph bench: decode step of {report['model']['name']} "
        f"({report['model']['parameters']:,} parameters)",
        f"cpu: {hw['cpu']} | nproc {hw['nproc']} | torch {hw['torch']} | threads {hw['threads']} | "
        f"{st['iters']} timed calls per row, interleaved in {st['rounds']} rounds | "
        f"load avg {_load(report.get('load_avg'))}",
        "",
        f"{'variant':<15} {'batch':>5} {'median us':>10} {'p10 us':>9} {'p90 us':>9} "
        f"{'x eager':>8} {'x compile':>9} {'allocs/call':>11}  note",
    ]
    for row in report["rows"]:
        note = "" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"
        lines.append(
            f"{row['variant']:<15} {row['batch']:>5} {_num(row['median_us'], '.1f'):>10} "
            f"{_num(row['p10_us'], '.1f'):>9} {_num(row['p90_us'], '.1f'):>9} "
            f"{_num(row['ratio_vs_eager'], '.3f'):>8} "
            f"{_num(row.get('ratio_vs_torch_compile'), '.3f'):>9} "
            f"{_num(row['allocs_per_call'], '.1f'):>11}  {note}"
        )
    lines.append("")
    for cap in report["capture"]["batches"]:
        if cap["status"] != "ok":
            lines.append(f"capture  batch {cap['batch']}: {cap['status']}: {cap['reason']}")
            continue
        mem, alone, pool = cap["graph_memory_bytes"], cap.get("standalone_bytes"), cap.get("pool_reserved_bytes")
        kib = lambda v: "-" if v is None else f"{v / 1024:.0f} KiB"  # noqa: E731
        kind = "capture+compile" if cap.get("compile") else "capture"
        lines.append(
            f"{kind:<15} batch {cap['batch']}: {cap['capture_ms']:.2f} ms "
            f"({_num(cap['capture_vs_eager_call'], '.1f')}x one eager call; first capture "
            f"{_num(cap['first_capture_ms'], '.1f')} ms), "
            f"{_num(cap['ops_per_graph'], 'd')} ops, graph {kib(mem)} incremental / "
            f"{kib(alone)} standalone, pool {kib(pool)}, "
            + (f"bitwise equal to eager: {cap['bitwise_equal_to_eager']}" if not cap.get("compile")
               else f"max |replay - eager| {_num(cap['max_abs_diff_vs_eager'], '.2e')}"
                    " (Inductor intermediates allocated per call outside the pool)")
        )
    for comp in report["compile"]["batches"]:
        if comp["status"] != "ok":
            lines.append(f"compile  batch {comp['batch']}: {comp['status']}: {comp['reason']}")
            continue
        lines.append(
            f"compile  batch {comp['batch']}: {comp['compile_s']:.2f} s (not counted above), "
            f"max |compiled - eager| {comp['max_abs_diff_vs_eager']:.2e}"
        )
    return "\n".join(lines) + "\n"
