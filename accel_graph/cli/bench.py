"""``accel-graph bench``: the decode-step benchmark as a command (table on stdout, JSON on request);
``accel-graph bench --models``: the model benchmark (decoder, ResNet, MoE decoder; five variants).

The measurements live in :mod:`accel_graph.bench.decode` and :mod:`accel_graph.bench.models`;
this module parses options, prints the table and writes the JSON report (schemas in
``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .output import write_json

__all__ = ["add_arguments", "format_models_report", "format_report", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph bench``."""
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1, 8],
        metavar="B",
        help="batch sizes of the decode step (default: 1 8; with --models: the decoder's)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        metavar="N",
        default=None,
        help="timed calls per variant and batch size (default: 1000; --models: at most 300)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        metavar="N",
        default=None,
        help="untimed calls per variant and batch size first (default: 20; --models: 5)",
    )
    parser.add_argument(
        "--calls-per-round",
        type=int,
        metavar="N",
        default=None,
        help="calls of one variant in a row within each interleaved round (default: 10; "
        "--models: 5)",
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
        help="skip the compiled variants (they need a C++ compiler and time)",
    )
    models = parser.add_argument_group("model benchmark (--models)")
    models.add_argument(
        "--models",
        action="store_true",
        help="benchmark eager, replay, compiled replay and torch.compile (default and "
        "max-autotune-no-cudagraphs) on the decoder, a small ResNet and the decoder with a "
        "mixture of experts (its experts an eager island) instead",
    )
    models.add_argument(
        "--only",
        nargs="+",
        choices=("decoder", "resnet", "moe"),
        default=["decoder", "resnet", "moe"],
        help="models to run (default: decoder resnet moe)",
    )
    models.add_argument(
        "--moe-batch",
        type=int,
        nargs="+",
        default=[1],
        metavar="B",
        help="batch sizes of the MoE decoder's decode step (default: 1)",
    )
    models.add_argument(
        "--resnet-batch",
        type=int,
        nargs="+",
        default=[1, 4],
        metavar="B",
        help="batch sizes of the ResNet (default: 1 4)",
    )
    models.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        metavar="S",
        help="timed seconds per model and batch at most (fewer rounds than --iters then; "
        "default: 8)",
    )
    models.add_argument(
        "--cold-cache",
        action="store_true",
        help="compile into a new, empty Inductor cache directory (TORCHINDUCTOR_CACHE_DIR), "
        "removed afterwards, so compile seconds are cold",
    )
    models.add_argument(
        "--no-autotune",
        action="store_true",
        help="skip torch.compile max-autotune-no-cudagraphs (slow to compile on a CPU)",
    )


def _given(args: argparse.Namespace, name: str, default: int) -> int:
    value = getattr(args, name)
    return default if value is None else value


def _run_models(args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.models import ModelBenchSettings, run_models_bench

    d = ModelBenchSettings()
    settings = ModelBenchSettings(
        models=tuple(args.only),
        decoder_batches=tuple(args.batch),
        resnet_batches=tuple(args.resnet_batch),
        moe_batches=tuple(args.moe_batch),
        iters=_given(args, "iters", d.iters),
        seconds=args.seconds,
        warmup=_given(args, "warmup", d.warmup),
        calls_per_round=_given(args, "calls_per_round", d.calls_per_round),
        threads=args.threads,
        compile=not args.no_compile,
        autotune=not args.no_autotune,
    )
    try:
        settings.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not args.cold_cache:
        report = run_models_bench(settings)
    else:
        # Before anything compiles: Inductor reads the variable whenever it needs the directory.
        saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        with tempfile.TemporaryDirectory(prefix="accel-graph-inductor-") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                report = run_models_bench(settings)
            finally:
                if saved is None:
                    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
                else:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        report["settings"]["cold_cache"] = True
    sys.stdout.write(format_models_report(report))
    return report


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with ``args``, print the table, write ``--json``; returns 0."""
    from ..bench.decode import DecodeBenchSettings, run_decode_bench

    if args.models:
        report = _run_models(args)
    else:
        settings = DecodeBenchSettings(
            batches=tuple(args.batch),
            iters=_given(args, "iters", 1000),
            warmup=_given(args, "warmup", 20),
            calls_per_round=_given(args, "calls_per_round", 10),
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


def format_models_report(report: dict[str, Any]) -> str:
    """The human-readable table of a report from ``run_models_bench`` (``--models``)."""
    hw, st, load = report["hardware"], report["settings"], report["load_avg"]
    load_s = (f"{load['start'][0]:.2f} -> {load['end'][0]:.2f}"
              if load.get("start") and load.get("end") else "-")
    lines = [
        "accel-graph bench --models: eager (inference_mode) vs replay vs compiled replay vs torch.compile",
        f"cpu: {hw['cpu']} | nproc {hw['nproc']} | torch {hw['torch']} | threads {st['threads']} | "
        f"load avg {load_s} | wall {report['wall_s']:.0f} s",
        "",
        f"{'model':<8} {'batch':>5} {'variant':<21} {'median us':>10} {'p10':>9} {'p90':>9} "
        f"{'x eager':>7} {'x compile':>9} {'compile s':>9} {'match':>5}  note",
    ]
    for r in report["rows"]:
        note = r["note"] or ""
        if r["status"] != "ok":
            note = f"{r['status']}: {r['reason']}"
        elif isinstance(r["replay_mode"], dict):
            m = r["replay_mode"]
            where = f", decided at {m['decided_at']}" if m.get("decided_at") else ""
            note = f"ran {m.get('mode')}{where} {note}".strip()
        elif r["replay_mode"] is not None:
            note = f"replay_mode {r['replay_mode']} {note}".strip()
        if r["compile_cache"] == "hit":
            note = f"(compile cache hit) {note}".strip()
        fx = r.get("fxgraph_cache") or {}
        if fx.get("fxgraph_cache_hit") or fx.get("fxgraph_cache_miss"):
            note = (f"FX cache {fx.get('fxgraph_cache_hit', 0)} hit/"
                    f"{fx.get('fxgraph_cache_miss', 0)} miss {note}").strip()
        match = "-" if r["matches_eager"] is None else ("yes" if r["matches_eager"] else "NO")
        lines.append(
            f"{r['model']:<8} {r['batch']:>5} {r['variant']:<21} {_num(r['median_us'], '.1f'):>10} "
            f"{_num(r['p10_us'], '.1f'):>9} {_num(r['p90_us'], '.1f'):>9} "
            f"{_num(r['ratio_vs_eager'], '.3f'):>7} {_num(r['ratio_vs_torch_compile'], '.3f'):>9} "
            f"{_num(r['compile_s'], '.1f'):>9} {match:>5}  {note}"
        )
    warm = report.get("inductor_warmup")
    if warm:
        lines += ["", f"Inductor warm-up (once-per-process costs, before the compiles above): "
                  f"{warm['seconds']:.1f} s" + (f", {warm['reason']}" if warm["reason"] else "")]
    rounds = ", ".join(f"{k} {v}" for k, v in st["rounds"].items())
    lines += ["", f"rounds of {st['calls_per_round']} calls per variant: {rounds}; "
              "x compile = median / torch.compile (default) median; compile s not counted above"]
    return "\n".join(lines) + "\n"
