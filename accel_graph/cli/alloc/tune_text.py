"""The text form of an ``accel-alloc/tune/1`` document (``accel-alloc tune`` without ``--json``):
the ranked table, the Pareto front (points worse than the baseline on peak set apart), the
other policies, the recommendation with the line to paste, its warnings and the accuracy to
expect. Reads only the document :func:`~.tune.result_payload` builds.
"""

from __future__ import annotations

from typing import Any

from ...allocator.units import fmt_bytes, fmt_signed_bytes
from ..output import format_table

__all__ = ["render"]


def _pct(d: dict[str, Any], scope: str = "trace") -> str:
    key = "peak_reserved" if scope == "trace" else "peak_reserved_recording"
    rel = d["delta"].get(f"{key}_relative")
    n = d["delta"].get(key, 0)
    head = fmt_signed_bytes(n)
    return head if rel is None else f"{head} ({100 * rel:+.1f}%)"


def _table(rows: list[dict[str, Any]], rank: bool = False, policy: bool = False,
           scope: str = "recording") -> str:
    headers = (["rank"] if rank else []) + ["config"] + (["policy"] if policy else []) + [
        "peak (recording)", "peak (whole trace)", "start (rebuilt)", "vs baseline",
        "mallocs/frees", "maps/unmaps", "ooms", "frag"]
    body = []
    for r in rows:
        label = r["label"] + (f"  (+{r['equivalent']} equivalent)" if r.get("equivalent") else "")
        body.append(([r["rank"]] if rank else []) + [label] + ([r["policy"]] if policy else []) + [
            fmt_bytes(r["peak_reserved_recording"]), fmt_bytes(r["peak_reserved"]),
            fmt_bytes(r["start_reserved"]), _pct(r, scope),
            f"{r['device_mallocs']}/{r['device_frees']}",
            f"{r['segment_maps']}/{r['segment_unmaps']}",
            f"{r['ooms']}" + (" OOM" if r["oom"] else ""),
            f"{100 * r['fragmentation_at_peak']:.1f}%"])
    align = ("r" if rank else "") + "l" + ("l" if policy else "") + "rrrrrrrr"
    return format_table(headers, body, align=align)


def _front_lines(rows: list[dict[str, Any]], scope: str) -> list[str]:
    """The front as text: points no worse than the baseline on peak, then, apart and saying
    so, those on the front only because they trade peak for fewer device calls."""
    good = [r for r in rows if not r.get("worse_peak_than_baseline")]
    trade = [r for r in rows if r.get("worse_peak_than_baseline")]
    lines = ["Pareto front (peak reserved vs device mallocs + frees + maps + unmaps), no worse "
             "than the baseline on peak:", _table(good, scope=scope) if good else "  (none)"]
    if trade:
        lines += ["", "also on the front, WORSE than the baseline on peak: listed only because they "
                  "make fewer device calls (not recommended for memory):",
                  _table(trade, scope=scope)]
        lines += [f"  {r['label']}: {r['why']}" for r in trade]
    return lines


def render(p: dict[str, Any]) -> str:
    b = p["baseline"]
    scope = p.get("peak_scope", "recording")
    lines = [
        f"{p['trace']}: device {p['device']} ({p.get('device_type') or 'unknown'}), profile "
        f"{p['profile']}, policy {p['policy']}, objective {p['objective']} on the "
        + ("recording's own peak reserved" if p.get("peak_scope", "recording") == "recording"
           else "whole-trace peak reserved (start state included)")
        + (f", cap {fmt_bytes(p['cap'])}" if p["cap"] else ""),
        f"evaluated {p['evaluated']} configurations ({p['distinct_results']} distinct results) "
        f"of {p['space_size']} in the search space, plus {p['alternatives_evaluated']} under "
        f"other policies, in {p['seconds']:.1f} s",
    ]
    for s in p["skipped_knobs"]:
        lines.append(f"skipped {s['knob']}: {s['reason']}")
    lines += [
        "",
        f"baseline (recorded settings: {b['label']}): peak reserved "
        f"{fmt_bytes(b['peak_reserved_recording'])} in the recording, "
        f"{fmt_bytes(b['peak_reserved'])} over the whole trace (start "
        f"{fmt_bytes(b['start_reserved'])}), "
        f"device mallocs/frees {b['device_mallocs']}/{b['device_frees']}, maps/unmaps "
        f"{b['segment_maps']}/{b['segment_unmaps']}, ooms {b['ooms']}, fragmentation at peak "
        f"{100 * b['fragmentation_at_peak']:.1f}%",
        "",
        f"ranked by {p['objective']} (top {len(p['ranked'])} of {p['distinct_results']} distinct "
        "results; equivalent configs folded):",
        _table(p["ranked"], rank=True, scope=scope),
        "",
        *_front_lines(p["pareto"], scope),
    ]
    if p["alternative_policies"]:
        lines += ["", "other allocator policies, for comparison (not selectable with an "
                  "environment variable):", _table(p["alternative_policies"], policy=True, scope=scope)]
    r = p["recommendation"]
    acc = p["accuracy"]
    err = acc["peak_error_pct"]
    lines += ["", f"recommendation: {r['label']}"]
    t = r.get("torch")
    if t:
        seen = t["trace"]["at_least"]
        lines.append(f"  assumes torch {t['assumed']} (profile {t['profile']}); the trace shows "
                     + (f"torch {seen} or later" if seen else "no torch version")
                     + (f" ({'; '.join(t['trace']['evidence'])})" if t["trace"]["evidence"]
                        else ""))
        if t.get("older_than_trace"):
            lines.append(f"  WARNING: --torch {t['given']} is older than the trace shows: see "
                         "torch-older-than-trace below")
        if t.get("config_rules"):
            lines.append(f"  configs read with torch {t['config_rules']['torch']}'s "
                         f"PYTORCH_ALLOC_CONF rules (chosen by {t['config_rules']['chosen_by']}; "
                         "--torch X.Y sets the trace's torch)")
    po = r.get("passed_over")
    if po:
        lines.append(f"  preferred over {po['label']} (ranked first, {fmt_signed_bytes(po['peak_difference'])} "
                     f"peak): it carries the high-severity warning(s) {', '.join(po['codes'])}, "
                     "and this warning-free one is within 0.1 %")
    if r["same_as_baseline"]:
        lines.append("  the recorded settings are already the best found for this objective")
    lines += [
        f"  peak reserved {fmt_bytes(r['peak_reserved_recording'])} in the recording "
        f"({_pct(r, 'recording')} vs baseline), {fmt_bytes(r['peak_reserved'])} over the whole "
        f"trace ({_pct(r)}), start rebuilt at {fmt_bytes(r['start_reserved'])}"
        + (f" ({fmt_signed_bytes(r['delta']['start_reserved'])} vs the recorded settings: the "
           "setting's effect on the state before the recording)"
           if r["delta"].get("start_reserved") else "")
        + "; device "
        f"calls {r['device_calls']} (baseline {b['device_calls']}); ooms {r['ooms']}",
    ]
    fl = p.get("floor")
    if fl:
        rel = fl["recommended_over_floor_relative"]
        lines.append(
            f"  floor: {fmt_bytes(fl['peak_requested'])} live at once (no allocator reserves less); "
            f"the recommendation is {fmt_bytes(fl['recommended_over_floor'])} above it"
            + ("" if rel is None else f" (+{100 * rel:.1f}%)"))
    lines += [
        "  expected accuracy: peak error "
        + ("unknown (the trace records no segment events)" if err is None else f"{err:.2f}%")
        + " (replay under the recorded settings vs the recorded peak; `accel-alloc validate`)",
        "",
        "  paste:",
        f"    {r['env_line']}",
    ]
    for a in r["also"]:
        if "PYTORCH_ALLOC_CONF=" in a:  # a pre-2.12 profile: the extra line is the newer name
            why = "same string under the newer name (torch 2.12+); the older one wins while both are set"
        else:
            why = ("same string under the older name: older releases read only this one, and it "
                   "wins when both are set")
        lines.append(f"    {a}    # {why}")
    lines += [f"  or at run time: {r['snippet']}", f"  note: {r['note']}"]
    alt = r["best_without_expandable_segments"]
    if alt is not None:
        lines.append(f"  best without expandable segments: {alt['label']} "
                     f"(peak {fmt_bytes(alt['peak_reserved_recording'])} in the recording, "
                     f"{_pct(alt, 'recording')}; whole trace {fmt_bytes(alt['peak_reserved'])}; "
                     "device calls "
                     f"{alt['device_calls']})")
    if p["warnings"]:
        lines += ["", "warnings:"]
        for w in p["warnings"]:
            lines.append(f"  [{w['severity']}] {w['code']}: {w['message']} ({w['reference']})")
    notes = sorted(set(r["notes"]))
    if b["peak_reserved"] != b["peak_reserved_recording"]:
        which = ("the recording's own peak (the default; --peak trace ranks on the whole trace)"
                 if scope == "recording" else "the whole-trace peak (--peak trace)")
        notes.append(f"the whole-trace peak ({fmt_bytes(b['peak_reserved'])}) is not the "
                     f"recording's own ({fmt_bytes(b['peak_reserved_recording'])}): the trace "
                     "inherits its start state (a cache filled before the recording); ranked on "
                     + which)
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    return "\n".join(lines)
