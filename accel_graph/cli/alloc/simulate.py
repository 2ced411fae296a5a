"""``accel-alloc simulate TRACE --config STR``: what the trace would have done under a config.

JSON (``--json``; schema ``accel-alloc/simulate``, docs/accel-alloc.md): the scenario (config,
profile, policy, cap, notes) and the predicted peak reserved / allocated, device mallocs and
frees, expandable-segment maps and unmaps, retries, out-of-memory events and fragmentation at
the peak, next to what the trace recorded.

``--write-snapshot FILE`` also writes the predicted trace (the simulated allocator's events and
final segments under the chosen settings, :mod:`accel_graph.allocator.sim.predicted`) as a
PyTorch snapshot pickle for ``python -m torch.cuda._memory_viz`` and memory_viz; the file is
checked for consistency (:func:`~accel_graph.allocator.traces.snapshot_check.snapshot_problems`)
before it is written, and an inconsistent one is an internal error, never a file.
"""

from __future__ import annotations

import argparse
from typing import Any

from ...allocator.units import fmt_bytes, fmt_signed_bytes
from ..output import emit, format_table
from .inputs import load_input, pick_device, scenario_from_args
from .options import (
    EXIT_USAGE,
    SCHEMA_VERSION,
    CliError,
    add_json_option,
    add_scenario_options,
    add_trace_options,
    guarded,
    rules_line,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", nargs="?",
                        help="trace file (snapshot pickle, accel-graph JSON/compact, RMM CSV)")
    add_trace_options(parser, nargs="?")
    add_scenario_options(parser)
    parser.add_argument("--write-snapshot", metavar="FILE", default=None,
                        help="also write the predicted trace (simulated events and final "
                        "segments) as a PyTorch snapshot pickle that torch.cuda._memory_viz "
                        "and memory_viz open")
    parser.add_argument("--list-profiles", action="store_true",
                        help="list the profiles (torch version x device) and exit")
    add_json_option(parser)


def profiles_listing() -> tuple[list[dict[str, Any]], str]:
    from ...allocator.sim.profiles import PROFILES

    rows = []
    for p in PROFILES.values():
        lo, hi = p.torch_versions
        rows.append({"name": p.name, "device": p.device, "policy": p.policy,
                     "torch": f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}", "rounding": p.rounding,
                     "notes": p.notes})
    text = format_table(["profile", "device", "torch", "policy", "rounding"],
                        [[r["name"], r["device"], r["torch"], r["policy"], r["rounding"]]
                         for r in rows])
    return rows, text


def simulate_payload(trace: Any, args: argparse.Namespace, device: int) -> dict[str, Any]:
    from ...allocator.sim.scenario import simulate
    from ...allocator.sim.trace_ops import recorded_summary

    scenario = scenario_from_args(args, trace, device=device)
    snapshot_path = getattr(args, "write_snapshot", None)
    result = guarded(lambda: simulate(trace, scenario, device=device,
                                      keep_events=bool(snapshot_path),
                                      keep_layout=bool(snapshot_path)))
    rec = recorded_summary(trace, device)
    pred = result.to_json()
    body = {"predicted": pred, "recorded": rec,
            "start_state": start_state(rec, pred),
            "effects": effects(trace, scenario, result, device)}
    if snapshot_path:
        body["snapshot"] = write_predicted_snapshot(trace, result, snapshot_path, args.trace)
    return body


def start_state(rec: dict[str, Any], pred: dict[str, Any]) -> dict[str, Any]:
    """Start reserved as recorded and as the replay rebuilt it under the scenario's settings
    (the prologue allocates the pre-existing blocks and segments again, and a setting such as
    roundup_power2_divisions, max_split_size_mb or expandable segments can make them bigger)."""
    r, b = int(rec["start_reserved"]), int(pred["start_reserved"])
    return {"recorded": r, "rebuilt": b, "rebuilt_minus_recorded": b - r,
            "rebuilt_relative": round(b / r - 1, 6) if r else None}


def effects(trace: Any, scenario: Any, result: Any, device: int) -> dict[str, Any] | None:
    """The scenario's effect against the recorded settings, both simulated, split into its
    effect on the rebuilt start state and on the recording itself (its own peak: the highest
    reserved right after a growth event); None when the scenario is the recorded settings."""
    from ...allocator.sim.scenario import make_scenario, simulate

    if scenario.config is None and scenario.policy == scenario.profile.policy:
        return None
    base_sc = guarded(lambda: make_scenario(trace, None, profile=scenario.profile,
                                            cap=scenario.cap, device=device))
    base = guarded(lambda: simulate(trace, base_sc, device=device))
    d_rec = result.peak_reserved_recording - base.peak_reserved_recording
    return {
        "against": "the recorded settings, simulated with the same profile and cap",
        "on_start_state": result.start_reserved - base.start_reserved,
        "on_recording_peak": d_rec,
        "on_recording_peak_relative": (round(d_rec / base.peak_reserved_recording, 6)
                                       if base.peak_reserved_recording else None),
        "on_whole_trace_peak": result.peak_reserved - base.peak_reserved,
        "baseline_peak_reserved": base.peak_reserved,
        "baseline_peak_reserved_recording": base.peak_reserved_recording,
        "baseline_start_reserved": base.start_reserved,
    }


def write_predicted_snapshot(trace: Any, result: Any, path: str, source: str) -> dict[str, Any]:
    """Write the predicted trace of ``result`` to ``path`` as a snapshot pickle, after checking
    that it is consistent; returns what the JSON reports about it."""
    from ...allocator.sim.predicted import predicted_trace
    from ...allocator.traces import save_trace
    from ...allocator.traces.snapshot_check import snapshot_problems

    predicted = predicted_trace(trace, result, source=source)
    device = int(result.device)
    problems = snapshot_problems(predicted.to_snapshot(), device)
    if problems:  # a bug of ours: never hand out a file memory_viz would draw wrongly
        raise RuntimeError("the predicted snapshot is inconsistent: " + "; ".join(problems[:3]))
    try:
        save_trace(predicted, path, "pickle")
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}", EXIT_USAGE) from None
    ev = predicted.events(device)
    return {"path": path, "device": device, "events": len(ev),
            "segments": len(predicted.segments),
            "events_with_frames": int((ev["frames"] >= 0).sum())}


def run(args: argparse.Namespace) -> int:
    if args.list_profiles:
        rows, text = profiles_listing()
        emit(args, {"schema": f"accel-alloc/profiles/{SCHEMA_VERSION}", "profiles": rows}, text)
        return 0
    if not args.trace:
        raise CliError("simulate needs a TRACE file (or --list-profiles)", EXIT_USAGE)
    trace = load_input(args.trace, args.device_type)
    device = pick_device(trace, args.device)
    body = simulate_payload(trace, args, device)
    payload = {"schema": f"accel-alloc/simulate/{SCHEMA_VERSION}", "trace": args.trace,
               "device_type": trace.device_type, **body}
    emit(args, payload, render(payload))
    return 0


def render(payload: dict[str, Any]) -> str:
    p, r = payload["predicted"], payload["recorded"]
    rows = [
        ["peak reserved (whole trace, start included)", fmt_bytes(p["peak_reserved"]),
         fmt_bytes(r["peak_reserved"])],
        ["peak reserved (the recording's own)", fmt_bytes(p["peak_reserved_recording"]),
         fmt_bytes(r["peak_reserved_recording"])],
        ["start reserved (rebuilt / recorded)", fmt_bytes(p["start_reserved"]),
         fmt_bytes(r["start_reserved"])],
        ["peak allocated", fmt_bytes(p["peak_allocated"]), "-"],
        ["final reserved", fmt_bytes(p["final_reserved"]), fmt_bytes(r["final_reserved"])],
        ["device mallocs (segment_alloc)", p["device_mallocs"], r["segment_alloc"]],
        ["device frees (segment_free)", p["device_frees"], r["segment_free"]],
        ["expandable maps", p["segment_maps"], r["segment_map"]],
        ["expandable unmaps", p["segment_unmaps"], r["segment_unmap"]],
        ["allocation retries", p["retries"], "-"],
        ["out-of-memory events", p["ooms"], "-"],
        ["fragmentation at peak", f"{100 * p['fragmentation_at_peak']:.1f}%", "-"],
    ]
    head = (f"{payload['trace']}: device {p['device']} ({payload.get('device_type') or 'unknown'}), "
            f"config {p['label']}, profile {p['profile']}, policy {p['policy']}"
            + (f", cap {fmt_bytes(p['cap'])}" if p["cap"] else ""))
    lines = [head, rules_line(p.get("config_rules")), "",
             format_table(["", "simulated", "recorded (its own settings)"], rows, align="lrr")]
    if p.get("fits") is not None:
        lines.append(
            f"fits in {fmt_bytes(p['cap'])}: " + (
                f"yes, {fmt_bytes(p['headroom'])} never reserved at the peak" if p["fits"] else
                f"no: {p['ooms']} allocation(s) failed after {p['retries']} retries"))
    st = payload.get("start_state")
    if st and st["rebuilt_minus_recorded"]:
        lines.append(f"start state: recorded {fmt_bytes(st['recorded'])}, rebuilt under this "
                     f"config {fmt_bytes(st['rebuilt'])} ({fmt_signed_bytes(st['rebuilt_minus_recorded'])}): "
                     "the blocks and segments that existed before the recording, allocated "
                     "again under these settings")
    e = payload.get("effects")
    if e:
        rel = e["on_recording_peak_relative"]
        lines.append(
            f"effect vs the recorded settings (both simulated): on the start state "
            f"{fmt_signed_bytes(e['on_start_state'])}; on the recording's own peak "
            f"{fmt_signed_bytes(e['on_recording_peak'])}" + ("" if rel is None else f" ({100 * rel:+.2f}%)")
            + f"; on the whole-trace peak {fmt_signed_bytes(e['on_whole_trace_peak'])}")
    lines += [f"note: {n}" for n in p["notes"]]
    snap = payload.get("snapshot")
    if snap:
        lines.append(f"wrote the predicted snapshot {snap['path']} ({snap['events']} events, "
                     f"{snap['segments']} segments; addresses are the simulated allocator's): "
                     f"python -m torch.cuda._memory_viz trace_plot {snap['path']} -o out.html")
    return "\n".join(lines)

