"""What ``accel-alloc plot --html`` shows, as plain data: per series the timeline, the segment
layout at its peak and the allocation sites at its peak.

A *series* is :func:`~accel_graph.cli.alloc.plot.build_series`' entry: the recording, or a
simulated config. The peak layout and the sites of a simulated config are read from its
predicted trace (:func:`~accel_graph.allocator.sim.predicted.predicted_trace`, the same trace
``simulate --write-snapshot`` writes), so a recorded and a simulated series go through the same
analysis: ``inspect_trace`` (the peak moment and the sites; the sites rule is whatever
``accel-alloc inspect`` uses) and ``layout_at`` (the segments and live blocks at that moment).
"""

from __future__ import annotations

from typing import Any

from ...allocator.traces.actions import A_ALLOC, A_FREE, A_FREE_REQ, A_OOM
from ...allocator.units import fmt_bytes

__all__ = ["MAX_LAYOUT_BLOCKS", "MAX_LAYOUT_SEGMENTS", "series_view"]

#: Segments drawn in one peak layout (the largest); the rest are summed in one line.
MAX_LAYOUT_SEGMENTS = 400
#: Blocks drawn in one peak layout; beyond that segments are drawn with their fill level only.
MAX_LAYOUT_BLOCKS = 6000


def _sites(report: dict[str, Any], top: int) -> dict[str, Any]:
    """The sites section of an inspect report as rows of (label, numbers): the one place the
    viewer depends on the sites' shape (a list of dicts with a ``site`` label and counts)."""
    rows = report.get("sites") or []
    if isinstance(rows, dict):  # a richer shape (by site / by stack): take the first list
        rows = next((v for v in rows.values() if isinstance(v, list)), [])
    rows = [r for r in rows if isinstance(r, dict)][:top]
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if isinstance(v, int) and not isinstance(v, bool)
                 and k not in keys]
    return {"columns": keys, "rows": [{"site": str(r.get("site", "?")),
                                       **{k: r.get(k) for k in keys}} for r in rows],
            "note": report.get("sites_note")}


def _layout(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Segments (largest first, at most :data:`MAX_LAYOUT_SEGMENTS`) with their live blocks
    as offsets into the segment (at most :data:`MAX_LAYOUT_BLOCKS` in all)."""
    segs = sorted(segments, key=lambda s: (-int(s["total_size"]), int(s["address"])))
    shown, rest = segs[:MAX_LAYOUT_SEGMENTS], segs[MAX_LAYOUT_SEGMENTS:]
    budget = MAX_LAYOUT_BLOCKS
    out = []
    for s in shown:
        blocks = s.get("blocks") or []
        base = int(s["address"])
        used = sum(int(b["size"]) for b in blocks)
        req = sum(int(b["requested_size"]) for b in blocks)
        entry: dict[str, Any] = {
            "address": base, "size": int(s["total_size"]), "stream": s.get("stream"),
            "expandable": bool(s.get("is_expandable")), "private": bool(s.get("private")),
            "used": used, "requested": req, "n_blocks": len(blocks), "blocks": None}
        if len(blocks) <= budget:
            entry["blocks"] = [[int(b["address"]) - base, int(b["size"]),
                                int(b["requested_size"]),
                                0 if b["state"] == "active_allocated" else 1] for b in blocks]
            budget -= len(blocks)
        out.append(entry)
    return {"segments": out, "hidden_segments": len(rest),
            "hidden_bytes": sum(int(s["total_size"]) for s in rest),
            "total_segments": len(segs), "reserved": sum(int(s["total_size"]) for s in segs)}


def series_view(trace: Any, s: dict[str, Any], device: int, top: int,
                max_points: int) -> dict[str, Any]:
    """The viewer's data for one series of ``build_series`` (plain JSON types only).

    For a simulated series ``s["sim"]`` must come from ``simulate(..., keep_events=True,
    keep_layout=True)``."""
    from ...allocator.analysis.inspect import inspect_trace
    from ...allocator.analysis.layout import layout_at

    if s["kind"] == "simulated":
        from ...allocator.sim.predicted import predicted_trace

        source = predicted_trace(trace, s["sim"])
    else:
        source = trace
    report = inspect_trace(source, device, top=top)
    k = int(report["at_peak"]["state"])
    every = source.events(device)["action"]
    # the free that advances the timeline's x: free_completed, unless the trace records only
    # free_requested (timeline.py's rule)
    free_code = A_FREE if (every == A_FREE).any() or not (every == A_FREE_REQ).any() else A_FREE_REQ
    act = every[:k]
    tl = s["timeline"]
    d = tl.downsample(max(8, max_points))
    i = tl.peak_index
    return {
        "kind": s["kind"],
        "peak_reserved": int(s["peak_reserved"]),
        "peak_x": int(tl.x[i]),
        "peak_allocated_at_peak": int(tl.allocated[i]),
        "x": d.x.tolist(), "reserved": d.reserved.tolist(), "allocated": d.allocated.tolist(),
        "layout_event": k - 1,
        # the layout's moment on the timeline's axis (alloc/free sequence, as timeline.py)
        "layout_x": int(((act == A_ALLOC) | (act == A_OOM) | (act == free_code)).sum()),
        "layout_reserved": int(report["at_peak"]["reserved"]),
        "layout_requested": int(report["at_peak"]["requested"]),
        "layout": _layout(layout_at(source, device, state=k)),
        "sites": _sites(report, top),
        "peak_text": fmt_bytes(s["peak_reserved"]),
    }
