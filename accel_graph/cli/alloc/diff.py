"""``accel-alloc diff``: two traces, or one trace under two configs / profiles, side by side.

- ``diff A.pkl B.pkl [--config STR]``: both traces simulated under the same config (default:
  each trace's recorded settings), next to what each recorded (``--config-b`` gives B its own);
- ``diff TRACE --config X --config-b Y``: one trace under two configs;
- ``diff TRACE --profile cuda-2.13 --profile-b cuda-2.9``: one trace under two torch versions /
  devices ("your upgrade changes peak reserved by X"); ``--policy-b`` likewise.

Every metric (peak reserved and allocated, final reserved, device mallocs/frees, expandable
maps/unmaps, retries, out-of-memory events, fragmentation at the peak) gets A, B, B - A and
(B - A) / A. ``--fail-above PCT`` is a regression gate: exit 1 when B's simulated peak reserved
(the whole trace's, or the recording's own) exceeds A's by more than PCT percent. JSON schema ``accel-alloc/diff/1``
(docs/accel-alloc-plot-diff-generate.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from ...allocator.units import fmt_bytes
from ..output import emit, format_table
from .inputs import config_text, load_input, pick_device
from .options import (
    EXIT_CHECK_FAILED,
    EXIT_USAGE,
    SCHEMA_VERSION,
    CliError,
    add_json_option,
    add_scenario_options,
    add_trace_options,
    guarded,
)

#: metric name -> (SimResult.to_json key, kind) in table order; kind: bytes, count or ratio
METRICS: dict[str, tuple[str, str]] = {
    "peak_reserved": ("peak_reserved", "bytes"),  # the whole trace, start state included
    "peak_reserved_recording": ("peak_reserved_recording", "bytes"),  # the recording's own
    "start_reserved": ("start_reserved", "bytes"),  # as rebuilt under the scenario
    "peak_allocated": ("peak_allocated", "bytes"),
    "final_reserved": ("final_reserved", "bytes"),
    "device_mallocs": ("device_mallocs", "count"),
    "device_frees": ("device_frees", "count"),
    "segment_maps": ("segment_maps", "count"),
    "segment_unmaps": ("segment_unmaps", "count"),
    "retries": ("retries", "count"),
    "ooms": ("ooms", "count"),
    "fragmentation_at_peak": ("fragmentation_at_peak", "ratio"),
}
RECORDED_METRICS: dict[str, str] = {
    "peak_reserved": "bytes", "peak_reserved_recording": "bytes", "final_reserved": "bytes",
    "start_reserved": "bytes",
    "segment_alloc": "count", "segment_free": "count", "segment_map": "count",
    "segment_unmap": "count",
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="A", help="trace file (the baseline)")
    parser.add_argument("trace_b", metavar="B", nargs="?", default=None,
                        help="second trace file; omit it to compare A under two configs or "
                        "profiles (--config-b / --profile-b / --policy-b)")
    add_trace_options(parser, nargs="?")
    add_scenario_options(parser)
    parser.add_argument("--config-b", default=None, metavar="STR",
                        help="config for B (default: --config; 'recorded' = B's recorded "
                        "settings)")
    parser.add_argument("--profile-b", default=None, metavar="NAME",
                        help="profile for B (default: --profile), e.g. --profile cuda-2.13 "
                        "--profile-b cuda-2.9 to see what a torch version change does")
    parser.add_argument("--policy-b", default=None, metavar="NAME",
                        help="policy for B (default: --policy)")
    parser.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                        help="regression gate: exit 1 when B's simulated peak reserved (the "
                        "whole trace's, or the recording's own) exceeds "
                        "A's by more than PCT percent")
    add_json_option(parser, "docs/accel-alloc-plot-diff-generate.md")


def _config(value: str | None) -> str | None:
    return config_text(value)


def change(a: Any, b: Any, kind: str = "count") -> dict[str, Any]:
    """``{"a", "b", "delta", "relative"}``; relative is None when A is 0 and B is not."""
    if a is None or b is None:
        return {"a": a, "b": b, "delta": None, "relative": None}
    if kind == "ratio":
        a, b = round(float(a), 6), round(float(b), 6)
        delta: Any = round(b - a, 6)
    else:
        a, b = int(a), int(b)
        delta = b - a
    rel = round(delta / a, 6) if a else (0.0 if delta == 0 else None)
    return {"a": a, "b": b, "delta": delta, "relative": rel}


def _side(trace: Any, path: str, device: int, config: str | None, profile: str | None,
          policy: str | None, cap: int | None, torch: str | None = None,
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    from ...allocator.sim.scenario import make_scenario, simulate
    from ...allocator.sim.trace_ops import recorded_summary

    sc = guarded(lambda: make_scenario(trace, config, policy=policy, profile=profile, cap=cap,
                                       device=device, torch=torch))
    sim = guarded(lambda: simulate(trace, sc, device=device)).to_json()
    info = {"trace": path, "device": device, "device_type": trace.device_type,
            "scenario": sc.describe(), "recorded": recorded_summary(trace, device),
            "notes": sim["notes"]}
    return info, sim


def diff_payload(args: argparse.Namespace) -> dict[str, Any]:
    b_overrides = (args.config_b, args.profile_b, args.policy_b)
    if args.trace_b is None and all(v is None for v in b_overrides):
        raise CliError("diff needs a second trace (diff A B) or something to change for B "
                       "(--config-b, --profile-b or --policy-b)", EXIT_USAGE)
    trace_a = load_input(args.trace, args.device_type)
    dev_a = pick_device(trace_a, args.device)
    if args.trace_b is None:
        mode, trace_b, path_b, dev_b = "configs", trace_a, args.trace, dev_a
    else:
        mode, path_b = "traces", args.trace_b
        trace_b = load_input(args.trace_b, args.device_type)
        dev_b = pick_device(trace_b, args.device)
    cfg_a = _config(args.config)
    cfg_b = _config(args.config_b) if args.config_b is not None else cfg_a
    a, sim_a = _side(trace_a, args.trace, dev_a, cfg_a, args.profile, args.policy, args.cap,
                     args.torch)
    b, sim_b = _side(trace_b, path_b, dev_b, cfg_b, args.profile_b or args.profile,
                     args.policy_b or args.policy, args.cap, args.torch)
    metrics = {name: change(sim_a[key], sim_b[key], kind)
               for name, (key, kind) in METRICS.items()}
    recorded = {name: change(a["recorded"][name], b["recorded"][name], kind)
                for name, kind in RECORDED_METRICS.items()}
    failed = False
    if args.fail_above is not None:
        # either peak: a trace that inherits a full cache hides the recording's growth in the
        # whole-trace peak (the start state), and a rebuilt start state can grow on its own
        failed = any(m["delta"] * 100 > args.fail_above * m["a"]
                     for m in (metrics["peak_reserved"], metrics["peak_reserved_recording"]))
    return {"schema": f"accel-alloc/diff/{SCHEMA_VERSION}", "mode": mode, "a": a, "b": b,
            "metrics": metrics, "recorded": recorded,
            "fail_above_pct": args.fail_above, "passed": not failed}


def run(args: argparse.Namespace) -> int:
    payload = diff_payload(args)
    emit(args, payload, render(payload))
    return EXIT_CHECK_FAILED if not payload["passed"] else 0


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return fmt_bytes(value)
    if kind == "ratio":
        return f"{100 * value:.1f}%"
    return str(value)


def _fmt_delta(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return ("+" if value > 0 else "") + fmt_bytes(value) if value else "0"
    if kind == "ratio":
        return f"{100 * value:+.1f} pt" if value else "0"
    return f"{value:+d}" if value else "0"


def _fmt_rel(rel: Any) -> str:
    return "-" if rel is None else ("0%" if rel == 0 else f"{100 * rel:+.1f}%")


def _table(rows_in: dict[str, dict[str, Any]], kinds: dict[str, str]) -> str:
    rows = [[name.replace("_", " "), _fmt(m["a"], kinds[name]), _fmt(m["b"], kinds[name]),
             _fmt_delta(m["delta"], kinds[name]), _fmt_rel(m["relative"])]
            for name, m in rows_in.items()]
    return format_table(["metric", "A", "B", "B - A", "relative"], rows, align="lrrrr")


def _describe(side: dict[str, Any]) -> str:
    sc = side["scenario"]
    return (f"{side['trace']} device {side['device']} ({side['device_type'] or 'unknown'}), "
            f"config {sc['label']}, profile {sc['profile']}, policy {sc['policy']}"
            + (f", cap {fmt_bytes(sc['cap'])}" if sc["cap"] else "")
            + (f", torch {sc['config_rules']['torch']} config rules"
               if sc.get("config_rules") else ""))


def render(payload: dict[str, Any]) -> str:
    kinds = {name: kind for name, (_, kind) in METRICS.items()}
    peak = payload["metrics"]["peak_reserved"]
    lines = [f"A: {_describe(payload['a'])}", f"B: {_describe(payload['b'])}", "",
             "simulated:", _table(payload["metrics"], kinds)]
    if payload["mode"] == "traces":
        lines += ["", "recorded:", _table(payload["recorded"], RECORDED_METRICS)]
    rec = payload["metrics"]["peak_reserved_recording"]
    verdict = (f"B changes simulated peak reserved by {_fmt_delta(peak['delta'], 'bytes')} "
               f"({_fmt_rel(peak['relative'])}) over the whole trace, and the recording's own "
               f"peak by {_fmt_delta(rec['delta'], 'bytes')} ({_fmt_rel(rec['relative'])})")
    if payload["fail_above_pct"] is not None:
        verdict += (f"; gate {payload['fail_above_pct']}%: "
                    + ("passed" if payload["passed"] else "FAILED"))
    lines += ["", verdict]
    notes = [("A", n) for n in payload["a"]["notes"]] + [("B", n) for n in payload["b"]["notes"]]
    lines += [f"note ({who}): {n}" for who, n in notes]
    return "\n".join(lines)
