"""``accel-alloc inspect TRACE``: what a trace recorded, and why reserved memory exceeded use.

Prints the device type and recorded allocator settings, events by action, streams, whether the
recording began mid-run; the peaks of reserved / allocated / requested / active bytes and
utilisation; the waste at the peak of reserved split into causes (internal rounding, free space
in segments holding live blocks, wholly free segments, other streams, the small/large pool
boundary, private pools), each with the knob or code change that removes it; and the top
allocation sites by bytes live at that moment.

JSON (``--json``): schema ``accel-alloc/inspect/1``, documented field by field in
docs/accel-alloc-inspect.md. The library behind it is
:func:`accel_graph.allocator.analysis.inspect.inspect_trace`.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import numpy as np

from ...allocator.units import fmt_bytes
from ..output import emit, format_table
from .inputs import load_input, pick_device
from .options import (
    EXIT_UNSUPPORTED,
    CliError,
    add_json_option,
    add_profile_option,
    add_trace_options,
    guarded,
    rules_line,
)

_LABELS = {
    "internal_rounding": "internal rounding (block - requested)",
    "free_in_live_segments": "free inside segments with live blocks",
    "wholly_free_segments": "wholly free segments (cached)",
    "other_streams": "tied to other streams",
    "pool_boundary": "small/large pool boundary",
    "private_pools": "private pools (graphs, MemPool)",
    "unattributed": "unattributed",
}


def _top(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_options(parser)
    # --profile/--torch mean what they mean in every command: the rounding profile and the
    # torch whose PYTORCH_ALLOC_CONF rules read the recorded config string
    add_profile_option(parser)
    parser.add_argument("--top", type=_top, default=10, metavar="K",
                        help="allocation sites to list (default 10)")
    add_json_option(parser, "docs/accel-alloc-inspect.md")


#: ``notes`` entry of a file that holds segments but no events (legacy list format)
STATE_ONLY = ("the file holds segments but no event history (legacy list format, or recorded "
              "without _record_memory_history()): every figure is the state at the moment of "
              "the snapshot")


def choose_device(trace: Any, device: int | None) -> tuple[int, list[str]]:
    """The device to inspect and the notes to print. A file with segments but no events (the
    legacy list format) is inspected as the state it captured; a trace without any segment
    information (an RMM log) cannot be split into segments and is refused (exit 5)."""
    from ...allocator.traces.actions import ACTION_CODE

    if any(len(a) for a in trace.device_traces) or not trace.segments:
        device = pick_device(trace, device, replay=False)
        ev = trace.events(device)
        seg_codes = [ACTION_CODE[a] for a in ("segment_alloc", "segment_free", "segment_map",
                                                "segment_unmap")]
        has_segments = any(int(seg.get("device", 0)) == device for seg in trace.segments)
        if len(ev) and not has_segments and not np.isin(ev["action"], seg_codes).any():
            raise CliError(
                "the trace records allocations but no segments (an RMM log, or a snapshot "
                "without segment events), so reserved memory cannot be split into its causes; "
                "`accel-alloc simulate` shows what PyTorch's caching allocator would reserve "
                "for it, `accel-alloc tune` what setting suits it", EXIT_UNSUPPORTED)
        return device, []
    per_device = Counter(int(seg.get("device", 0)) for seg in trace.segments)
    if device is None:
        device = max(per_device, key=lambda d: (per_device[d], -d))
    elif device not in per_device:
        have = ", ".join(str(d) for d in sorted(per_device))
        raise CliError(f"the snapshot has no segments on device {device} (devices with "
                       f"segments: {have}); pass --device with one of those", EXIT_UNSUPPORTED)
    return device, [STATE_ONLY]


def run(args: argparse.Namespace) -> int:
    from ...allocator.analysis.inspect import inspect_trace

    trace = load_input(args.trace, args.device_type)
    device, notes = choose_device(trace, args.device)
    from ...allocator.tune.versions import infer_torch, older_than_trace

    try:
        report = guarded(lambda: inspect_trace(trace, device, top=args.top, profile=args.profile,
                                               torch=args.torch))
    except KeyError as e:  # an unknown --profile: the message lists the known ones
        raise CliError(str(e.args[0]), EXIT_UNSUPPORTED) from None
    from ...allocator.alloc_conf import rules_for
    from ...allocator.sim.profiles import PROFILES
    from ...allocator.sim.scenario import recorded_refusal

    clash = older_than_trace(args.torch, infer_torch(trace, device))
    refused = recorded_refusal(trace, PROFILES[report["profile"]],
                               rules_for(report["config_rules"]["torch"]))
    payload = {"schema": report["schema"], "trace": args.trace, **report,
               "notes": [n for n in (clash, refused) if n] + notes}
    emit(args, payload, render(payload))
    return 0


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render(p: dict[str, Any]) -> str:
    """The text report of an ``accel-alloc/inspect/1`` document."""
    ev, pk, at, st, se = p["events"], p["peaks"], p["at_peak"], p["start"], p["settings"]
    lines = [f"{p['trace']}: device {p['device']} ({p.get('device_type') or 'unknown device type'}),"
             f" {ev['total']:,} events, rounding profile {p['profile']}"]
    if p.get("config_rules"):
        lines.append(rules_line(p["config_rules"]))
    if se["recorded"]:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(se["recorded"].items())
                          if not isinstance(v, (dict, list)))
        settings = f"recorded ({shown})" if shown else "recorded"
    else:
        settings = "not recorded"
    es = {True: "on", False: "off", None: "unknown"}[se["expandable_segments"]]
    lines.append(f"allocator settings: {settings}; expandable segments: {es} "
                 f"({se['expandable_segments_source']})")
    by_action = ", ".join(f"{k} {v:,}" for k, v in ev["by_action"].items()) or "none"
    lines.append(f"events: {by_action}")
    lines.append(f"streams: {ev['streams']}"
                 + (f" (most allocations on {ev['main_stream']})" if ev["streams"] > 1 else "")
                 + f"; timestamps: {'yes' if ev['has_timestamps'] else 'none'}"
                 + f"; stack frames: {'yes' if ev['has_stack_frames'] else 'none'}")
    if not ev["total"]:
        lines.append(f"state: {ev['pre_existing_blocks']:,} live blocks "
                     f"({fmt_bytes(st['requested'])} requested), {fmt_bytes(st['reserved'])} "
                     "reserved (no events: the snapshot's own state)")
    elif ev["starts_mid_run"]:
        lines.append(f"start: mid-run: {ev['pre_existing_blocks']:,} blocks live before the "
                     f"recording began ({fmt_bytes(st['requested'])} requested), "
                     f"{fmt_bytes(st['reserved'])} reserved "
                     f"({ev['pre_existing_frees']:,} frees of never-allocated addresses)")
    else:
        lines.append("start: from empty (nothing reserved or live before the first event)")

    rows = [
        ["peak reserved (whole trace)", fmt_bytes(pk["reserved"]), f"{pk['reserved']:,}",
         "segments (segment_alloc/map minus free/unmap), the start state included"
         + (": reached at the start" if pk.get("reserved_is_start_state") else "")],
        ["peak reserved (recording)", fmt_bytes(pk["reserved_in_recording"]),
         f"{pk['reserved_in_recording']:,}",
         "highest right after a segment_alloc/map event of the recording"],
        ["peak allocated", fmt_bytes(pk["allocated"]), f"{pk['allocated']:,}",
         "live blocks, block bytes"],
        ["peak requested", fmt_bytes(pk["requested"]), f"{pk['requested']:,}",
         "live allocations, requested bytes"],
        ["peak active", fmt_bytes(pk["active"]), f"{pk['active']:,}",
         "allocated + freed awaiting free_completed"],
        ["final reserved", fmt_bytes(pk["final_reserved"]), f"{pk['final_reserved']:,}",
         "the final segments"],
    ]
    util = pk["utilisation"]
    lines += ["", "Peaks", format_table(["metric", "size", "bytes", "what it counts"], rows, align="lrrl")]
    if util is not None:
        lines.append(f"utilisation: {100 * util:.1f}% = {pk['utilisation_definition']} (GMLake's "
                     "definition); "
                     f"{100 * pk['utilisation_at_peak_reserved']:.1f}% active/reserved at the "
                     "peak-reserved moment")

    waste = p["waste_at_peak"]
    total = at["reserved"] - at["requested"]
    moment = ("at the snapshot" if not ev["total"] else
              "at the start of the recording, the state it inherited"
              if at["state"] == 0 else f"after event {at['after_event_index']:,}")
    lines += ["", f"Waste at the peak of reserved ({moment}: "
              f"reserved {fmt_bytes(at['reserved'])}, requested {fmt_bytes(at['requested'])}, "
              f"{at['segments']} segments)"]
    wrows = [[_LABELS.get(c, c), fmt_bytes(v), f"{v:,}", _pct(v, total)]
             for c, v in waste.items() if v or c != "unattributed"]
    wrows.append(["total (reserved - requested)", fmt_bytes(total), f"{total:,}",
                  _pct(total, total)])
    lines.append(format_table(["component", "size", "bytes", "share"], wrows, align="lrrr"))
    trig = at.get("trigger")
    if trig:
        lines.append(f"peak set by a {trig['pool']}-pool request of {fmt_bytes(trig['requested'])}"
                     f" (event {trig['event_index']:,}); the pool boundary counts free bytes of "
                     f"the other pool in segments with live blocks")
    if p["advice"]:
        lines += ["", "What removes it"]
        lines += [f"- {_LABELS.get(a['component'], a['component'])} ({fmt_bytes(a['bytes'])}): "
                  f"{a['advice']}" for a in p["advice"]]

    lines += ["", "Top allocation sites (first user Python frame; rule below)"]
    if p["sites"]:
        for title, key, name in (
                (f"by requested bytes live at the peak of reserved ({moment})", "sites", "site"),
                ("by requested bytes allocated over the whole run", "sites_over_run", "site"),
                (f"by user call stack, live at the peak of reserved ({moment})", "stacks", "stack"),
                ("by user call stack, over the whole run", "stacks_over_run", "stack")):
            srows = [[s[name], fmt_bytes(s["live_at_peak_bytes"]), s["live_at_peak_count"],
                      fmt_bytes(s["allocated_bytes"]), s["allocations"]] for s in p.get(key, [])]
            if srows:
                lines += [title, format_table([name, "live at peak", "blocks", "allocated in run",
                                               "allocations"], srows, align="lrrrr")]
        ar = p.get("at_recording_peak") or {}
        for key, name in (("sites", "site"), ("stacks", "stack")):
            srows = [[s[name], fmt_bytes(s["live_at_peak_bytes"]), s["live_at_peak_count"],
                      fmt_bytes(s["allocated_bytes"]), s["allocations"]] for s in ar.get(key, [])]
            if srows:
                lines += [f"by {'site' if key == 'sites' else 'user call stack'}, live at the "
                          f"recording's own peak (after event {ar['after_event_index']:,}: "
                          f"reserved {fmt_bytes(ar['reserved'])})",
                          format_table([name, "live at peak", "blocks", "allocated in run",
                                        "allocations"], srows, align="lrrrr")]
        lines.append(f"frame rule: {p['sites_rule']}")
    else:
        lines.append(p.get("sites_note") or "no allocation sites to list")
    ann = p.get("annotations") or {}
    if ann.get("total"):
        live = ann["on_blocks_live_at_peak"]
        lines += ["", f"Annotations (torch 2.14 _annotate_tensor): {ann['total']:,} in the trace, "
                  f"{len(live):,} on blocks live at the peak of reserved ({moment})"]
        lines += [f"- {a['addr']:#x}: {a['text']} (event {a['event_index']:,})" for a in live[:20]]
        if len(live) > 20:
            lines.append(f"- ... and {len(live) - 20:,} more (--json lists all)")
    host = p.get("host_memory")
    if host:
        lines += ["", f"pinned host memory (torch 2.14 host_segments/host_traces): "
                  f"{host['host_segments']:,} segments, {host['host_traces']:,} events recorded; "
                  "not device memory, so no figure above includes them"]
    if p.get("notes"):
        lines += [""] + [f"note: {n}" for n in p["notes"]]
    return "\n".join(lines)
