"""``accel-alloc tune TRACE``: search allocator settings for a trace, recommend one.

Evaluates a structured sample (default 256) of the ``PYTORCH_ALLOC_CONF`` grid the profile
honours (:mod:`accel_graph.allocator.tune.search`), ranks it by ``--objective``, prints the ranked
table, the Pareto front of peak reserved vs device calls, the recommendation with the line to
paste and the warnings that apply (:mod:`accel_graph.allocator.tune.advice`), and the accuracy to
expect (the ``validate`` comparison). ``--json``: schema ``accel-alloc/tune/1``, documented
field by field in docs/accel-alloc-tune.md. The text form of that document is
:mod:`.tune_text`'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ...allocator.devices import config_dialect_of
from ...allocator.units import fmt_signed_bytes
from ..output import emit
from .inputs import load_input, pick_device
from .options import (
    EXIT_USAGE,
    SCHEMA_VERSION,
    CliError,
    add_cap_option,
    add_json_option,
    add_profile_option,
    add_trace_options,
    guarded,
)
from .tune_text import render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ...allocator.tune.ranking import OBJECTIVES, PEAK_SCOPES
    from ...allocator.tune.search import DEFAULT_BUDGET

    add_trace_options(parser)
    parser.add_argument("--objective", choices=OBJECTIVES, default="peak",
                        help="peak: lowest peak reserved; mallocs: fewest device mallocs/frees/"
                        "maps/unmaps within 5%% of the lowest peak; pareto: the knee of the "
                        "peak-vs-device-calls front (default: peak)")
    parser.add_argument("--peak", choices=PEAK_SCOPES, default="recording",
                        help="which peak reserved the objective minimises: recording = the "
                        "peak the recording itself produced (highest reserved right after a "
                        "segment_alloc/map event; the default), trace = the whole trace's, the "
                        "start state rebuilt under each config included")
    add_cap_option(parser, "configurations that run out of memory rank last; enables "
                   "garbage_collection_threshold + per_process_memory_fraction candidates")
    add_profile_option(parser)
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, metavar="N",
                        help=f"configurations to evaluate (default {DEFAULT_BUDGET})")
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="rows of the ranked table (default 10; 0: all)")
    parser.add_argument("--uses", default=None, metavar="LIST",
                        help="features the program uses that conflict with expandable segments, "
                        "comma-separated: ipc, mempool, custom-allreduce, nccl-register")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="worker processes (default 1)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr (also off with --json)")
    add_json_option(parser, "docs/accel-alloc-tune.md")


class _Bar:
    """tqdm on stderr, created on the first tick (after any worker processes have forked)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar = enabled, None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm  # optional progress bar: imported when first drawn

            tqdm.monitor_interval = 0
            self.bar = tqdm(total=total, desc="configs", unit="cfg", file=sys.stderr,
                            leave=False, dynamic_ncols=True)
        if total != self.bar.total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    from ...allocator.tune.advice import parse_uses

    if args.budget < 2:
        raise CliError(f"--budget must be at least 2, got {args.budget}", EXIT_USAGE)
    if args.jobs < 1:
        raise CliError(f"--jobs must be at least 1, got {args.jobs}", EXIT_USAGE)
    if args.top < 0:
        raise CliError(f"--top must be >= 0, got {args.top}", EXIT_USAGE)
    try:
        uses = parse_uses(args.uses)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    trace = load_input(args.trace, args.device_type)
    device = pick_device(trace, args.device)
    payload = tune_payload(trace, args, device, uses, environ=os.environ,
                           progress=not (args.no_progress or args.json))
    emit(args, payload, render(payload))
    return 0


def tune_payload(trace: Any, args: argparse.Namespace, device: int, uses: tuple[str, ...],
                 environ: Any = None, progress: bool = False) -> dict[str, Any]:
    from ...allocator.tune.search import tune

    bar = _Bar(progress)
    try:
        result = guarded(lambda: tune(trace, objective=args.objective, cap=args.cap,
                                      profile=args.profile, budget=args.budget, progress=bar,
                                      device=device, jobs=args.jobs,
                                      peak=getattr(args, "peak", "recording"), uses=uses,
                                      torch=getattr(args, "torch", None)))
    finally:
        bar.close()
    from ...allocator.tune.versions import infer_torch

    payload = result_payload(result, trace=args.trace, device_type=trace.device_type,
                             top=args.top, uses=uses, environ=environ,
                             trace_torch=infer_torch(trace, device),
                             given_torch=getattr(args, "torch", None))
    payload["floor"] = _floor(trace, device, payload["recommendation"]["peak_reserved"])
    return payload


def _floor(trace: Any, device: int, recommended_peak: int) -> dict[str, Any]:
    """The lower bound no allocator can beat: the peak of bytes live at once (requested sizes,
    start state included), and how far the recommendation is above it."""
    from ...allocator.sim.scenario import make_scenario, simulate

    live = int(simulate(trace, make_scenario(trace, "", device=device), device=device)
               .replay.peak_requested)
    return {"peak_requested": live, "recommended_over_floor": recommended_peak - live,
            "recommended_over_floor_relative": round(recommended_peak / live - 1, 6) if live else None}


def result_payload(result: Any, *, trace: str, device_type: str | None, top: int = 10,
                   uses: tuple[str, ...] = (), environ: Any = None,
                   trace_torch: dict[str, Any] | None = None,
                   given_torch: str | None = None) -> dict[str, Any]:
    """The ``accel-alloc/tune/1`` document for a :class:`~accel_graph.allocator.tune.search.TuneResult`."""
    from ...allocator.alloc_conf import parse_config
    from ...allocator.tune.advice import advise, env_assignment
    from ...allocator.tune.ranking import Candidate, rank
    from ...allocator.tune.versions import older_than_trace, version_warnings

    base = result.baseline
    prof = result.profile

    def row(c: Candidate, rank: int | None = None, equivalent: list[Candidate] | None = None
            ) -> dict[str, Any]:
        out = c.to_json(base)
        if rank is not None:
            out["rank"] = rank
        if equivalent is not None:
            out["equivalent"] = len(equivalent)
            out["equivalent_configs"] = [e.config for e in equivalent[:5]]
        return out

    groups = result.groups()
    shown = groups if top == 0 else groups[:top]
    rec = result.recommended
    cfg = rec.config or ""
    settings = parse_config(cfg, config_dialect_of(prof.device))
    assign = env_assignment(cfg, prof)
    warnings = [a.to_json() for a in advise(settings, prof, environ=environ, uses=uses,
                                            private_pools=result.private_pools,
                                            env_var=assign.env_var)]
    if any(c.ooms for c in result.candidates) and all(c.ooms for c in result.candidates):
        warnings.insert(0, {"code": "all-oom", "severity": "high", "reference":
                            "allocator-semantics.md 6 item 5",
                            "message": "every configuration runs out of memory under the cap: "
                            "no setting makes this trace fit; raise --cap or reduce the workload"})
    elif rec.ooms:
        warnings.insert(0, {"code": "recommended-oom", "severity": "high",
                            "reference": "allocator-semantics.md 6 item 5",
                            "message": "the recommended configuration still runs out of memory "
                            "under the cap"})
    if trace_torch is None:
        trace_torch = {"at_least": None, "evidence": [], "exact": False}
    warnings += [a.to_json() for a in version_warnings(cfg, prof, trace_torch)]
    clash = older_than_trace(given_torch, trace_torch)
    if clash:  # first: the whole recommendation rests on it
        warnings.insert(0, {"code": "torch-older-than-trace", "severity": "high",
                            "reference": "docs/accel-alloc.md --torch", "message": clash})
    without_es = None
    if settings.expandable_segments:
        # the objective's own rule over the configurations without expandable segments (for
        # mallocs: within 5 % of *their* lowest peak), not the first of them in the full order
        no_es = [c for c in result.candidates if c.config is not None
                 and "expandable_segments:True" not in c.config]
        if no_es:
            without_es = row(rank(no_es, result.objective, result.peak_scope)[0])
    lo, hi = prof.torch_versions
    torch_info = {
        "assumed": f"{lo[0]}.{lo[1]}" + (" or later" if hi[1] >= 99 else
                                         "" if lo == hi else f"-{hi[0]}.{hi[1]}"),
        "given": given_torch,
        "older_than_trace": clash is not None,
        "profile": prof.name,
        "trace": trace_torch,
        "config_rules": result.config_rules,
    }
    acc = result.accuracy
    recommendation = {
        **row(rec),
        "same_as_baseline": rec is base or (rec.config == result.baseline_config
                                            and rec.metrics() == base.metrics()),
        **assign.to_json(),
        "expected_peak_error_pct": acc["peak_error_pct"],
        "best_without_expandable_segments": without_es,
        "passed_over": result.passed_over,
        "torch": torch_info,
    }
    return {
        "schema": f"accel-alloc/tune/{SCHEMA_VERSION}",
        "trace": trace,
        "device_type": device_type,
        "device": result.device,
        "profile": prof.name,
        "policy": result.policy,
        "objective": result.objective,
        "peak_scope": result.peak_scope,
        "cap": result.cap,
        "budget": result.budget,
        "evaluated": result.evaluated,
        "distinct_results": len(groups),
        "alternatives_evaluated": len(result.alternatives),
        "rejected": result.rejected,
        "space_size": result.space_size,
        "stages": dict(result.stages),
        "skipped_knobs": [{"knob": k, "reason": r} for k, r in result.skipped],
        "baseline": {**row(base), "recorded_config": result.baseline_config},
        "ranked": [row(c, i + 1, eq) for i, (c, eq) in enumerate(shown)],
        "pareto": _front_rows([row(c) for c in result.pareto], row(base), result.peak_scope),
        "alternative_policies": [row(c) for c in result.alternatives],
        "recommendation": recommendation,
        "warnings": warnings,
        "uses": list(uses),
        "private_pools": result.private_pools,
        "accuracy": acc,
        "seconds": round(result.seconds, 3),
    }


def _calls(r: dict[str, Any]) -> int:
    return r["device_mallocs"] + r["device_frees"] + r["segment_maps"] + r["segment_unmaps"]


def _peak(r: dict[str, Any], scope: str) -> int:
    return r["peak_reserved_recording"] if scope == "recording" else r["peak_reserved"]


def _front_rows(rows: list[dict[str, Any]], base: dict[str, Any], scope: str) -> list[dict[str, Any]]:
    """Front rows with ``why``: None for a point no worse than the baseline on peak; for one
    worse on peak, the trade that puts it on the front (it has fewer device calls). A bare
    table row 620 MiB above the baseline read as a recommendation (issue 29)."""
    out = []
    for r in rows:
        worse = _peak(r, scope) - _peak(base, scope)
        why = None
        if worse > 0:
            why = (f"{fmt_signed_bytes(worse)} peak vs the baseline for "
                   f"{_calls(base) - _calls(r)} fewer device calls")
        out.append({**r, "worse_peak_than_baseline": worse > 0, "why": why})
    return out
