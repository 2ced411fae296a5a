"""``accel-graph demo --tp N``: the tensor-parallel decoder on N local CPU processes.

The measurement is :func:`accel_graph.bench.tp.run_tp` (N spawned processes, gloo over
loopback, one :class:`~accel_graph.GraphRunner` with ``process_group=`` per rank); this module
turns the demo's options into its settings and prints the report. Exit status 0 when every rank's
greedy tokens (eager TP and replay TP) equal the single-process model's (near-ties excepted, as
in the one-process demo) and its logits are within float32 tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .output import write_json

__all__ = ["format_tp_report", "run_tp_demo"]


def run_tp_demo(args: argparse.Namespace, compile: bool) -> int:
    """Run the TP demo with the demo's parsed options; the exit status."""
    from ..bench.tp import TPSettings, run_tp

    settings = TPSettings(
        world=args.tp, buckets=tuple(sorted(set(args.buckets))), new_tokens=args.new_tokens,
        threads=args.threads, iters=args.bench_iters,
        gen_rounds=max(3, args.bench_iters // 20) if args.bench_iters else 0,
        compile="inductor" if compile else None, collective=args.collective, seed=args.seed,
    )
    report = run_tp(settings)
    report["tool"] = "accel-graph demo --tp"
    sys.stdout.write(format_tp_report(report))
    if args.json is not None:
        write_json(args.json, report)
        sys.stdout.write(f"wrote {args.json}\n")
    return 0 if report["check"]["ok"] else 1


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_tp_report(report: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`~accel_graph.bench.tp.run_tp` report."""
    hw, st = report["hardware"], report["settings"]
    r0 = report["ranks"][0]
    lines = [
        f"accel-graph demo --tp {st['world']}: TPDecoder on {st['world']} CPU processes (gloo over "
        f"loopback), buckets {st['buckets']}, replay "
        f"{'compiled (inductor)' if st['compile'] else 'interpreted'}, all-reduce {st['collective']}",
        f"cpu: {hw['cpu']} | nproc {hw['nproc']} | torch {hw['torch']} | threads per rank "
        f"{st['threads']}",
    ]
    served = ", ".join(f"{b['bucket']} {b['status']}" for b in r0["buckets"])
    lines.append(f"buckets (rank 0): {served}; the same on every rank: "
                 f"{'yes' if report['check']['same_buckets_on_every_rank'] else 'NO'}")
    for b in r0["buckets"]:
        if b["status"] != "captured":
            lines.append(f"  bucket {b['bucket']}: {b['reason']}")
    lines.append("greedy tokens vs the single-process model, every rank:")
    for name in ("eager_tp", "replay_tp"):
        c = sum(r["tokens"][name]["compared"] for r in report["ranks"])
        t = sum(r["tokens"][name]["near_ties"] for r in report["ranks"])
        bad = [m for r in report["ranks"] for m in r["tokens"][name]["mismatches"]]
        verdict = "equal" if not bad else "DIFFERENT"
        lines.append(f"  {name.replace('_', ' ')}: {verdict}: {c} compared, {t} near-ties, "
                     f"{len(bad)} other differences")
        for m in bad[:3]:
            lines.append(f"    batch {m['batch']} row {m['row']} position {m['position']}: "
                         f"single {m['eager']} vs TP {m['graph']} (top-2 gap {m['top2_gap']:.3g})")
    lg = r0["logits"]
    lines.append(
        f"logits vs single-process, one step: eager TP max |diff| "
        f"{lg['eager_tp']['max_abs_diff']:.2g}, replay TP {lg['replay_tp']['max_abs_diff']:.2g} "
        f"({'within' if lg['eager_tp']['close'] and lg['replay_tp']['close'] else 'NOT within'} "
        f"float32 tolerance)")
    step, single = report["step_us"], report["single_process"]
    if step:
        lines.append(
            f"batch-1 step, median us: eager TP {step['eager_tp']:.0f} | replay TP "
            f"{step['replay_tp']:.0f} ({report['replay_over_eager']:.2f}x eager) | the step's "
            f"all-reduces alone {step['allreduce_only']:.0f} | one rank's compute alone "
            f"{step['eager_compute_only']:.0f} eager, {step['replay_compute_only']:.0f} replay")
        ss = single.get("step_us")
        if ss:
            lines.append(f"  single process for reference: eager {ss['eager']:.0f} | replay "
                         f"{ss['replay']:.0f}")
    tps, stps = r0.get("tokens_per_s"), single.get("tokens_per_s")
    if tps:
        line = (f"batch-1 greedy tokens/s ({st['new_tokens']} tokens, median of {st['gen_rounds']}): "
                f"eager TP {tps['eager_tp']:.0f} | replay TP {tps['replay_tp']:.0f}")
        if stps:
            line += f" | single process: eager {stps['eager']:.0f}, replay {stps['replay']:.0f}"
        lines.append(line)
    lines.append(f"check: {'OK' if report['check']['ok'] else 'FAILED'}; wall time "
                 f"{report['wall_s']:.1f} s ({report['group_wall_s']:.1f} s in the process group)")
    return "\n".join(lines) + "\n"
