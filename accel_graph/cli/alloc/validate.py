"""``accel-alloc validate TRACE``: replay under the recorded settings, compare with the recording.

The error reported here (segment allocations, frees, maps, unmaps, the sizes of the segments
allocated, peak and final reserved) is the accuracy to expect from every other answer about
this trace. ``--max-error PCT`` turns it into a gate: exit status 1 when the peak-reserved
error exceeds PCT percent.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ...allocator.units import fmt_bytes
from ..output import emit, format_table
from .inputs import load_input, pick_device
from .options import (
    EXIT_CHECK_FAILED,
    SCHEMA_VERSION,
    add_cap_option,
    add_json_option,
    add_profile_option,
    add_trace_options,
    guarded,
    rules_line,
)

_COUNTS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
_BYTES = ("peak_reserved", "peak_reserved_recording", "final_reserved")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_options(parser)
    add_profile_option(parser)
    add_cap_option(parser, "the size of the device the trace was recorded on (needed when it "
                   "was recorded with per_process_memory_fraction)")
    parser.add_argument("--max-error", type=float, default=None, metavar="PCT",
                        help="exit 1 when |peak reserved error| exceeds PCT percent, or cannot "
                        "be measured (the trace records no segment events)")
    add_json_option(parser)


def _segment_sizes(trace: Any, device: int, replayed: np.ndarray) -> dict[str, Any]:
    from ...allocator.traces.actions import ACTION_CODE

    codes = (ACTION_CODE["segment_alloc"], ACTION_CODE["segment_map"])
    ev = trace.events(device)
    rec = ev["size"][np.isin(ev["action"], codes)].astype(np.int64)
    sim = replayed["size"][np.isin(replayed["action"], codes)].astype(np.int64)
    n = min(len(rec), len(sim))
    in_order = int((rec[:n] == sim[:n]).sum())
    # multiset agreement: sizes present in both, with multiplicity
    rv, rc = np.unique(rec, return_counts=True)
    sv, sc = np.unique(sim, return_counts=True)
    common, ri, si = np.intersect1d(rv, sv, return_indices=True)
    matched = int(np.minimum(rc[ri], sc[si]).sum()) if len(common) else 0
    denom = max(len(rec), len(sim), 1)
    return {"recorded": len(rec), "simulated": len(sim), "equal_in_order": in_order,
            "equal_as_multiset": matched, "match_fraction": round(matched / denom, 6)}


def validate_payload(trace: Any, device: int, profile: str | None,
                     cap: int | None = None, torch: str | None = None) -> dict[str, Any]:
    from ...allocator.sim.scenario import make_scenario, simulate
    from ...allocator.sim.trace_ops import recorded_summary

    scenario = guarded(lambda: make_scenario(trace, None, profile=profile, cap=cap,
                                             device=device, torch=torch))
    result = guarded(lambda: simulate(trace, scenario, device=device))
    sim = result.to_json()
    rec = recorded_summary(trace, device)
    pairs = {"segment_alloc": "device_mallocs", "segment_free": "device_frees",
             "segment_map": "segment_maps", "segment_unmap": "segment_unmaps",
             "peak_reserved": "peak_reserved",
             "peak_reserved_recording": "peak_reserved_recording",
             "final_reserved": "final_reserved"}
    metrics = {}
    for key, skey in pairs.items():
        s, r = int(sim[skey]), int(rec[key])
        metrics[key] = {"simulated": s, "recorded": r, "error": s - r,
                        "relative_error": round((s - r) / r, 6) if r else (0.0 if s == 0 else None)}
    # a log without segment events (RMM CSV) records no reserved memory: nothing to compare
    comparable = any(rec[k] for k in _COUNTS) or bool(rec["start_reserved"])
    notes = list(sim["notes"])
    from ...allocator.sim.scenario import recorded_settings

    backend = recorded_settings(trace, device).backend
    if backend != "native":  # the recording is not of the allocator that was replayed
        comparable = False
        notes.append(f"backend:{backend} recordings cannot be validated against the native "
                     "model: the comparison is shown for information only")
    elif not comparable:
        notes.append("the trace records no segment events (segment_alloc/free/map/unmap), so "
                     "the replay has nothing to be compared with: its accuracy is unknown")
    return {
        "scenario": scenario.describe(),
        "device": device,
        "start_reserved": {"simulated": result.start_reserved, "recorded": rec["start_reserved"]},
        "metrics": metrics,
        "segment_sizes": _segment_sizes(trace, device, result.replay.segment_events),
        "comparable": comparable,
        "exact": comparable and all(m["error"] == 0 for m in metrics.values()),
        "notes": notes,
    }


def run(args: argparse.Namespace) -> int:
    trace = load_input(args.trace, args.device_type)
    device = pick_device(trace, args.device)
    body = validate_payload(trace, device, args.profile, args.cap, args.torch)
    peak = body["metrics"]["peak_reserved"]
    rel = peak["relative_error"]
    # an error that cannot be measured (nothing recorded to compare with) fails the gate
    failed = args.max_error is not None and (
        not body["comparable"] or rel is None or abs(rel) * 100 > args.max_error)
    payload = {"schema": f"accel-alloc/validate/{SCHEMA_VERSION}", "trace": args.trace,
               "device_type": trace.device_type, **body,
               "max_error_pct": args.max_error, "passed": not failed}
    emit(args, payload, render(payload))
    return EXIT_CHECK_FAILED if failed else 0


def render(payload: dict[str, Any]) -> str:
    rows = []
    for key, m in payload["metrics"].items():
        fmt = fmt_bytes if key in _BYTES else str
        rel = m["relative_error"]
        rows.append([key, fmt(m["simulated"]), fmt(m["recorded"]),
                     (fmt_bytes(m["error"]) if key in _BYTES else f"{m['error']:+d}"),
                     "-" if rel is None else f"{100 * rel:+.2f}%"])
    sz = payload["segment_sizes"]
    sc = payload["scenario"]
    lines = [
        f"{payload['trace']}: device {payload['device']} ({payload.get('device_type') or 'unknown'}), "
        f"recorded settings {sc['label']}, profile {sc['profile']}",
        rules_line(sc.get("config_rules")),
        "",
        format_table(["metric", "simulated", "recorded", "error", "relative"], rows, align="lrrrr"),
        "",
        f"start reserved: recorded {fmt_bytes(payload['start_reserved']['recorded'])}, rebuilt "
        f"{fmt_bytes(payload['start_reserved']['simulated'])} (the state before the first "
        "event, allocated again by the replay's prologue)",
        f"segment sizes: {sz['equal_in_order']} of {sz['recorded']} recorded equal in order, "
        f"{sz['equal_as_multiset']} as a multiset (simulated {sz['simulated']})",
        "verdict: " + ("exact" if payload["exact"] else
                       "differs (see the error column)" if payload["comparable"] else
                       "cannot be validated (see the notes)")
        + ("" if payload["max_error_pct"] is None else
           f"; gate {payload['max_error_pct']}% on peak reserved: "
           + ("passed" if payload["passed"] else "FAILED")),
    ]
    lines += [f"note: {n}" for n in payload["notes"]]
    return "\n".join(lines)
