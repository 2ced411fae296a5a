"""``accel-alloc plot TRACE -o FILE``: allocated and reserved over time under one or more configs.

One matplotlib figure (Agg, never a window): per config (``--config``, repeatable; default the
settings the trace was recorded with) the simulated reserved bytes (solid), allocated bytes
(dashed) and the gap between them shaded, so the place where the waste appears is visible; the
recorded curves in black (``--no-recorded`` drops them); a marker at each curve's peak reserved,
whose value is in the legend. ``--config recorded`` names the recorded settings, so
``--config recorded --config expandable_segments:True`` compares the two. The x axis is the
position in the trace's alloc/free sequence, so every config of one trace lines up
(:mod:`accel_graph.allocator.analysis.timeline`).

Output by extension: ``.png``, ``.svg``, or ``.html`` (a self-contained page: the figure as
inline SVG plus a table of the peaks; no external resources). matplotlib is optional
(``pip install 'accel-graph[plot]'``); without it ``-o`` exits 7.

``--html FILE`` (with or without ``-o``; needs no matplotlib) writes the offline viewer
(:mod:`.viewer_html`): the timeline with every series' peak marked, and per series the segment
layout and the top allocation sites at its peak, in one self-contained HTML file.
"""

from __future__ import annotations

import argparse
import html
import io
import os
from typing import Any

from ...allocator.units import fmt_bytes
from ..output import emit, format_table
from .inputs import config_text, load_input, pick_device
from .options import (
    EXIT_MISSING_DEP,
    EXIT_USAGE,
    SCHEMA_VERSION,
    CliError,
    add_json_option,
    add_scenario_options,
    add_trace_options,
    guarded,
)

#: output extension -> kind
FORMATS = {".png": "png", ".svg": "svg", ".html": "html", ".htm": "html"}
DEFAULT_MAX_POINTS = 4000
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22", "#7f7f7f")  # fmt: skip
_RECORDED_COLOR = "#222222"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_options(parser)
    add_scenario_options(parser, multiple_configs=True)
    parser.add_argument("--recorded", action=argparse.BooleanOptionalAction, default=True,
                        help="also draw the curves the trace recorded (default: yes)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="figure file: .png, .svg or .html (self-contained page with the "
                        "figure as inline SVG and a table of the peaks); needs matplotlib")
    parser.add_argument("--html", metavar="FILE",
                        help="write the offline viewer: one self-contained HTML file with the "
                        "timeline, each series' segment layout at its peak and its top "
                        "allocation sites (no matplotlib needed, nothing loaded from a network)")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="allocation sites listed per series in --html (default 10)")
    parser.add_argument("--max-points", type=int, default=DEFAULT_MAX_POINTS, metavar="N",
                        help="points per curve after downsampling (peaks kept; default "
                        f"{DEFAULT_MAX_POINTS})")
    parser.add_argument("--title", default=None, help="figure title (default: the trace name)")
    add_json_option(parser, "docs/accel-alloc-plot-diff-generate.md")


def output_kind(path: str) -> str:
    """``png``/``svg``/``html`` from the output name; a usage error for anything else."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise CliError(f"cannot tell the output type from {path!r}: name it .png, .svg or "
                       ".html", EXIT_USAGE)
    return FORMATS[ext]


def import_matplotlib() -> Any:
    """matplotlib's ``Figure`` class (object-oriented API: no pyplot, no display, no global
    backend switch). Missing matplotlib is a :class:`CliError` with exit code 7."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError("plot needs matplotlib: pip install 'accel-graph[plot]'",
                       EXIT_MISSING_DEP) from None
    return Figure


# ---------------------------------------------------------------------------------------------
# data


def build_series(trace: Any, args: argparse.Namespace, device: int,
                 keep_layout: bool = False) -> list[dict[str, Any]]:
    """One entry per simulated config (and the recording): the timeline and its summary.
    ``keep_layout``: keep each replay (``"sim"``, with its events and final layout) for the
    viewer's predicted traces."""
    from ...allocator.analysis.timeline import recorded_timeline, simulated_timeline
    from ...allocator.sim.scenario import make_scenario, simulate

    series: list[dict[str, Any]] = []
    for cfg in args.config or [None]:
        cfg = config_text(cfg)
        sc = guarded(lambda cfg=cfg: make_scenario(trace, cfg, policy=args.policy,
                                                   profile=args.profile, cap=args.cap,
                                                   device=device, torch=args.torch))
        sim = guarded(lambda sc=sc: simulate(trace, sc, device=device, keep_events=True,
                                             keep_layout=keep_layout))
        tl = simulated_timeline(sim, trace)
        series.append({
            "kind": "simulated", "label": sc.label, "config": sc.config,
            "profile": sc.profile.name, "policy": sc.policy, "cap": sc.cap,
            "config_rules": sc.describe()["config_rules"],
            "timeline": tl, "peak_reserved": sim.peak_reserved,
            "peak_allocated": sim.peak_allocated, "peak_requested": tl.peak_allocated,
            "final_reserved": sim.final_reserved, "device_mallocs": sim.device_mallocs,
            "segment_maps": sim.maps, "ooms": sim.ooms,
            "notes": list(sc.notes) + list(sim.notes),
            **({"sim": sim} if keep_layout else {}),
        })
    if args.recorded:
        from ...allocator.sim.trace_ops import recorded_summary

        tl = recorded_timeline(trace, device)
        rec = recorded_summary(trace, device)
        series.append({
            "kind": "recorded", "label": "recorded", "config": None, "profile": None,
            "policy": None, "cap": None, "config_rules": None, "timeline": tl,
            "peak_reserved": rec["peak_reserved"], "peak_allocated": None,
            "peak_requested": tl.peak_allocated, "final_reserved": rec["final_reserved"],
            "device_mallocs": rec["segment_alloc"], "segment_maps": rec["segment_map"],
            "ooms": None, "notes": [],
        })
    for s in series:
        tl = s["timeline"]
        i = tl.peak_index
        s["peak_x"] = int(tl.x[i])
        s["allocated_at_peak"] = int(tl.allocated[i])
        s["waste_at_peak"] = int(tl.reserved[i] - tl.allocated[i])
        s["points"] = len(tl)
    return series


def series_name(s: dict[str, Any]) -> str:
    """How a series is named in the legend, the HTML table and the text summary."""
    if s["kind"] == "recorded":
        return "recorded (trace)"
    return "simulated, recorded settings" if s["config"] is None else f"simulated {s['label']}"


# ---------------------------------------------------------------------------------------------
# drawing


def _unit(peak: int) -> tuple[float, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if peak >= 2 * scale:
            return float(scale), name
    return 1.0, "B"


def draw(series: list[dict[str, Any]], title: str, max_points: int,
         figsize: tuple[float, float] = (10.0, 6.2)) -> Any:
    """The figure (a matplotlib ``Figure``) for ``series`` from :func:`build_series`."""
    Figure = import_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = Figure(figsize=figsize, dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    scale, unit = _unit(max((s["timeline"].peak_reserved for s in series), default=0))
    handles = []
    n_sim = 0
    for s in series:
        tl = s["timeline"].downsample(max(8, max_points))
        x, res, alloc = tl.x, tl.reserved / scale, tl.allocated / scale
        if s["kind"] == "recorded":
            # underneath, wide and grey: the simulated curves drawn over it show the agreement
            color = _RECORDED_COLOR
            kw = {"linewidth": 3.2, "alpha": 0.45, "zorder": 2}
        else:
            color = _COLORS[n_sim % len(_COLORS)]
            n_sim += 1
            kw = {"linewidth": 1.4, "zorder": 3}
            ax.fill_between(x, alloc, res, color=color, alpha=0.12, linewidth=0, zorder=1)
        (line,) = ax.plot(x, res, color=color,
                          label=f"{series_name(s)}: peak reserved {fmt_bytes(s['peak_reserved'])}", **kw)
        ax.plot(x, alloc, color=color, linestyle="--", **{**kw, "linewidth": kw["linewidth"] * 0.6})
        full = s["timeline"]
        i = full.peak_index
        ax.plot([float(full.x[i])], [full.reserved[i] / scale], marker="v", markersize=8,
                color=color, zorder=5, markeredgecolor="white", markeredgewidth=0.8)
        handles.append(line)
    handles += [
        Line2D([], [], color="#555555", linewidth=1.5, label="solid: reserved"),
        Line2D([], [], color="#555555", linewidth=0.9, linestyle="--",
               label="dashed: allocated (requested bytes)"),
        Patch(facecolor="#555555", alpha=0.2, label="shaded: reserved - allocated (waste)"),
        Line2D([], [], color="#555555", marker="v", linestyle="", label="peak reserved"),
    ]
    # below the axes: never over a curve
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2,
              fontsize=8, frameon=False)
    top = max((s["timeline"].peak_reserved for s in series), default=0) / scale
    ax.set_ylim(0, top * 1.06 or 1.0)
    ax.set_xlim(left=0)
    ax.set_xlabel("position in the trace's alloc/free sequence (allocations + frees)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    fig.tight_layout()
    return fig


def save(fig: Any, path: str, kind: str, series: list[dict[str, Any]], title: str) -> None:
    """Write ``fig`` as png/svg, or as a self-contained HTML page with the peaks table.

    The same input gives the same bytes: no dates, and SVG element ids from a fixed salt
    (matplotlib otherwise salts them with a random number on every run)."""
    import matplotlib

    if kind == "png":
        fig.savefig(path, format="png", metadata={"Software": None})
        return
    with matplotlib.rc_context({"svg.hashsalt": "accel-alloc"}):
        if kind == "svg":
            fig.savefig(path, format="svg", metadata={"Date": None})
            return
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.find("<svg"):]  # drop the XML declaration and DOCTYPE: inline SVG in HTML
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(svg, series, title))


def peaks_table(series: list[dict[str, Any]]) -> str:
    """The ``<table id="peaks">`` of both HTML outputs: one row per series."""
    head = ["series", "profile", "peak reserved", "peak allocated (requested)",
            "waste at peak", "final reserved", "device mallocs", "maps"]
    rows = []
    for s in series:
        cells = [series_name(s), s["profile"] or "-", fmt_bytes(s["peak_reserved"]),
                 fmt_bytes(s["peak_requested"]), fmt_bytes(s["waste_at_peak"]),
                 fmt_bytes(s["final_reserved"]), s["device_mallocs"], s["segment_maps"]]
        rows.append("<tr>" + "".join(
            ('<td class="l">' if j < 2 else "<td>") + html.escape(str(c)) + "</td>"
            for j, c in enumerate(cells)) + "</tr>")
    return ("<table id=\"peaks\">\n<thead><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>")


def render_html(svg: str, series: list[dict[str, Any]], title: str) -> str:
    notes = sorted({n for s in series for n in s["notes"]})
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    t = html.escape(title)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{t}</title>\n<style>\n"
        "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\n"
        "table{border-collapse:collapse;margin-top:1em}\n"
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}\n"
        "td.l,th{text-align:left}\nth{background:#f3f3f3}\nsvg{max-width:100%;height:auto}\n"
        "</style>\n</head>\n<body>\n"
        f"<h1 style=\"font-size:1.2em\">{t}</h1>\n"
        "<p>Allocated (dashed) and reserved (solid) device memory; the shaded band is "
        "reserved minus allocated. x: position in the trace's alloc/free sequence.</p>\n"
        f"{svg}\n" + peaks_table(series) + "\n"
        + (f"<ul>{note_html}</ul>\n" if notes else "")
        + "<p style=\"font-size:.8em;color:#777\">accel-alloc plot</p>\n</body>\n</html>\n"
    )


# ---------------------------------------------------------------------------------------------
# command


def series_colors(series: list[dict[str, Any]]) -> list[str]:
    """The colour of each series, as :func:`draw` gives them."""
    out, n_sim = [], 0
    for s in series:
        if s["kind"] == "recorded":
            out.append(_RECORDED_COLOR)
        else:
            out.append(_COLORS[n_sim % len(_COLORS)])
            n_sim += 1
    return out


def write_viewer(path: str, trace: Any, series: list[dict[str, Any]], device: int,
                 title: str, args: argparse.Namespace) -> int:
    """Write the offline viewer (``--html``); returns its size in bytes."""
    from .viewer_data import series_view
    from .viewer_html import render_viewer

    views = [guarded(lambda s=s: series_view(trace, s, device, args.top, args.max_points))
             for s in series]
    notes = sorted({n for s in series for n in s["notes"]})
    subtitle = (f"{args.trace}: device {device} ({trace.device_type or 'unknown'}), "
                f"{len(trace.events(device))} events")
    page = render_viewer(title, subtitle, views, [series_name(s) for s in series],
                         series_colors(series), peaks_table(series), notes)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}", EXIT_USAGE) from None
    return len(page.encode("utf-8"))


def run(args: argparse.Namespace) -> int:
    if not args.output and not args.html:
        raise CliError("plot needs -o FILE (.png/.svg/.html figure) or --html FILE (the "
                       "offline viewer), or both", EXIT_USAGE)
    kind = output_kind(args.output) if args.output else None
    if args.output:
        import_matplotlib()  # fail before the (possibly long) replays
    if args.max_points < 8:
        raise CliError("--max-points must be >= 8", EXIT_USAGE)
    if args.top < 1:
        raise CliError("--top must be >= 1", EXIT_USAGE)
    trace = load_input(args.trace, args.device_type)
    device = pick_device(trace, args.device)
    series = build_series(trace, args, device, keep_layout=bool(args.html))
    profile = next((s["profile"] for s in series if s["profile"]), None)
    title = args.title or (f"{os.path.basename(args.trace)}: device {device} "
                           f"({trace.device_type or 'unknown'})"
                           + (f", profile {profile}" if profile else ""))
    if args.output:
        fig = draw(series, title, args.max_points)
        try:
            save(fig, args.output, kind or "png", series, title)
        except OSError as e:
            raise CliError(f"cannot write {args.output}: {e.strerror or e}",
                           EXIT_USAGE) from None
    html_bytes = write_viewer(args.html, trace, series, device, title, args) if args.html else None
    out = [{k: v for k, v in s.items() if k not in ("timeline", "sim")} for s in series]
    payload = {"schema": f"accel-alloc/plot/{SCHEMA_VERSION}", "trace": args.trace,
               "device": device, "device_type": trace.device_type, "output": args.output,
               "format": kind,
               "bytes": os.path.getsize(args.output) if args.output else None,
               "html": args.html, "html_bytes": html_bytes, "series": out}
    emit(args, payload, render(payload))
    return 0


def render(payload: dict[str, Any]) -> str:
    rows = [[series_name(s), fmt_bytes(s["peak_reserved"]), fmt_bytes(s["peak_requested"]),
             fmt_bytes(s["waste_at_peak"]), fmt_bytes(s["final_reserved"])]
            for s in payload["series"]]
    lines = []
    if payload["output"]:
        lines.append(f"wrote {payload['output']} ({payload['format']}, "
                     f"{fmt_bytes(payload['bytes'])})")
    if payload["html"]:
        lines.append(f"wrote {payload['html']} (offline viewer, "
                     f"{fmt_bytes(payload['html_bytes'])})")
    lines += ["", format_table(["series", "peak reserved", "peak allocated", "waste at peak",
                               "final reserved"], rows, align="lrrrr"),
             "(allocated: requested bytes; waste: reserved - allocated at the peak of reserved)"]
    notes = sorted({n for s in payload["series"] for n in s["notes"]})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
