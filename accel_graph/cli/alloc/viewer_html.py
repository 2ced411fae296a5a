"""``accel-alloc plot --html FILE``: one self-contained, offline HTML viewer.

Everything is in the one file: the figures are inline SVG drawn here (so the page shows them
even with scripts off), the data the script uses is an inline JSON block, the stylesheet and
the script are inline, and a Content-Security-Policy ``default-src 'none'`` forbids the page
any network or file request at all. No CDN, no fonts, no images: the page renders the same
offline as online (memory_viz's page imports its code and d3 from a CDN and renders nothing
offline). The script only adds interaction: a readout of every series at the pointer's
position on the timeline, and the choice of which series' peak layout and sites to show.

Sections: the timeline (reserved solid, allocated = requested bytes dashed, per series, with a
marker at each series' peak reserved that stays inside the plot even at event 0), a table of
the peaks, and per series the segment layout at its peak and its top allocation sites
(:mod:`.viewer_data`).
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from ...allocator.units import fmt_bytes
from .viewer_script import CSP_WATCH_JS, VIEWER_CSS, VIEWER_JS

__all__ = ["CSP", "render_viewer"]

#: Nothing may be loaded: scripts and styles only inline, images only as data: URIs.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "img-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")

# timeline geometry (px): the SVG has a fixed viewBox; CSS scales it to the page width
W, H = 960, 380
L, R, T, B = 84, 24, 28, 46
PAD = 14  # x padding inside the plot, so a marker at event 0 (or at the end) is whole
LAYOUT_ROW, LAYOUT_GAP = 18, 6
_BLOCK_COLORS = ("#4e79a7", "#f28e2c", "#e15759")  # requested bytes, rounding slack, pending free


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ticks(top: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values from 0 to ``top``."""
    if top <= 0:
        return [0.0]
    raw = top / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(top // step) + 1)]


def _unit(peak: int) -> tuple[int, str]:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if peak >= 2 * scale:
            return scale, name
    return 1, "B"


def timeline_svg(views: list[dict[str, Any]], names: list[str], colors: list[str]) -> str:
    """The timeline as inline SVG: every series' curves and its peak marker."""
    xmax = max([v["x"][-1] for v in views if v["x"]] + [1])
    ymax_raw = max([max(v["reserved"] + v["allocated"] + [0]) for v in views] + [0])
    ymax = ymax_raw * 1.12 or 1.0
    scale, unit = _unit(ymax_raw)

    def px(x: float) -> float:
        return L + PAD + x / xmax * (W - L - R - 2 * PAD)

    def py(y: float) -> float:
        return T + (1 - y / ymax) * (H - T - B)

    out = [f'<svg id="timeline-svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
           'role="img" aria-label="allocated and reserved bytes over the trace">',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="#fff" '
           'stroke="#bbb"/>']
    for t in _ticks(ymax_raw * 1.05 / scale):
        y = py(t * scale)
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                   f'{t:g} {unit}</text>')
    for t in _ticks(xmax):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{H - B}" y2="{H - B + 4}" '
                   f'stroke="#888"/><text x="{x:.1f}" y="{H - B + 17}" text-anchor="middle" '
                   f'class="tick">{int(t)}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 8}" text-anchor="middle" class="axis">'
               "position in the trace's alloc/free sequence</text>")
    for v, color in zip(views, colors, strict=True):
        res = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(v["x"], v["reserved"], strict=True))
        alloc = " ".join(f"{px(x):.1f},{py(y):.1f}"
                         for x, y in zip(v["x"], v["allocated"], strict=True))
        width = "3.2" if v["kind"] == "recorded" else "1.6"
        opacity = "0.45" if v["kind"] == "recorded" else "1"
        out.append(f'<g class="series" opacity="{opacity}">'
                   f'<polyline points="{res}" fill="none" stroke="{color}" stroke-width="{width}"/>'
                   f'<polyline points="{alloc}" fill="none" stroke="{color}" stroke-width="1.1" '
                   'stroke-dasharray="5 3"/></g>')
    # peak markers last, over every curve; labels stacked so they never overlap each other,
    # and a triangle that would cover another series' is raised above it (equal peaks)
    placed: list[tuple[float, float]] = []
    for i, (v, name, color) in enumerate(zip(views, names, colors, strict=True)):
        x, y = px(v["peak_x"]), py(v["peak_reserved"])
        y_tip = y
        while any(abs(x - px_) < 14 and abs(y_tip - py_) < 13 for px_, py_ in placed):
            y_tip -= 13
        placed.append((x, y_tip))
        left_half = x < (L + W - R) / 2
        lx = x + 9 if left_half else x - 9
        ly = T + 14 + 14 * i
        out.append(
            f'<g class="peak-marker" data-series="{i}" data-x="{v["peak_x"]}" '
            f'data-bytes="{v["peak_reserved"]}">'
            f'<title>{_e(name)}: peak reserved {_e(v["peak_text"])} at position {v["peak_x"]}'
            f'</title><line x1="{x:.1f}" x2="{x:.1f}" y1="{T}" y2="{H - B}" stroke="{color}" '
            'stroke-width="1" stroke-dasharray="2 3"/>'
            f'<path d="M{x - 7:.1f},{y_tip - 13:.1f} L{x + 7:.1f},{y_tip - 13:.1f} '
            f'L{x:.1f},{y_tip - 1:.1f} Z" '
            f'fill="{color}" stroke="#fff" stroke-width="1"/>'
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>'
            f'<text x="{lx:.1f}" y="{ly}" text-anchor="{"start" if left_half else "end"}" '
            f'fill="{color}" class="peak-label">peak {_e(v["peak_text"])} @ {v["peak_x"]}</text>'
            "</g>")
    out.append(f'<line id="guide" x1="0" x2="0" y1="{T}" y2="{H - B}" stroke="#333" '
               'stroke-width="0.8" visibility="hidden"/>')
    out.append("</svg>")
    return "\n".join(out)


def layout_svg(layout: dict[str, Any], index: int) -> str:
    """One series' segments at its peak, packed in rows (largest first), blocks inside."""
    segs = layout["segments"]
    if not segs:
        return '<p class="empty">no segments at the peak</p>'
    width = W - 2 * 10
    cap = max(segs[0]["size"], layout["reserved"] // 14 or 1)
    gap = 3 * cap / width  # 3 px between segments, in bytes
    rows: list[list[tuple[float, dict[str, Any]]]] = [[]]
    used = 0.0
    for s in segs:
        if rows[-1] and used + s["size"] > cap:
            rows.append([])
            used = 0.0
        rows[-1].append((used, s))
        used += s["size"] + gap
    k = width / cap
    height = len(rows) * (LAYOUT_ROW + LAYOUT_GAP) + 4
    out = [f'<svg class="layout-svg" data-series="{index}" viewBox="0 0 {W} {height}" '
           f'width="{W}" height="{height}" role="img" aria-label="segments at the peak">']
    for r, row in enumerate(rows):
        y = 2 + r * (LAYOUT_ROW + LAYOUT_GAP)
        for off, s in row:
            x0 = 10 + off * k
            free = s["size"] - s["used"]
            tip = (f"segment {s['address']:#x}: {fmt_bytes(s['size'])}"
                   f"{' expandable' if s['expandable'] else ''}"
                   f"{' private pool' if s['private'] else ''}, stream {s['stream']}, "
                   f"{s['n_blocks']} live block(s), requested {fmt_bytes(s['requested'])}, "
                   f"rounding {fmt_bytes(s['used'] - s['requested'])}, free {fmt_bytes(free)}")
            out.append(f'<g class="segment"><title>{_e(tip)}</title>'
                       f'<rect x="{x0:.2f}" y="{y}" width="{max(s["size"] * k, 0.6):.2f}" '
                       f'height="{LAYOUT_ROW}" fill="#f4f4f4" stroke="#777" stroke-width="0.6"/>')
            if s["blocks"] is None:  # too many blocks to draw: the fill level
                out.append(f'<rect x="{x0:.2f}" y="{y + 4}" width="{s["used"] * k:.2f}" '
                           f'height="{LAYOUT_ROW - 8}" fill="{_BLOCK_COLORS[0]}" opacity="0.6"/>')
            else:
                for b_off, size, req, pending in s["blocks"]:
                    bx = x0 + b_off * k
                    if pending:
                        out.append(f'<rect x="{bx:.2f}" y="{y + 1}" width="{size * k:.2f}" '
                                   f'height="{LAYOUT_ROW - 2}" fill="{_BLOCK_COLORS[2]}"/>')
                        continue
                    out.append(f'<rect x="{bx:.2f}" y="{y + 1}" width="{req * k:.2f}" '
                               f'height="{LAYOUT_ROW - 2}" fill="{_BLOCK_COLORS[0]}"/>')
                    if size > req:
                        out.append(f'<rect x="{bx + req * k:.2f}" y="{y + 1}" '
                                   f'width="{(size - req) * k:.2f}" height="{LAYOUT_ROW - 2}" '
                                   f'fill="{_BLOCK_COLORS[1]}"/>')
            out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _sites_table(sites: dict[str, Any]) -> str:
    if not sites["rows"]:
        return f'<p class="empty">{_e(sites.get("note") or "no allocation sites")}</p>'
    cols = sites["columns"]
    head = "".join(f"<th>{_e(c.replace('_', ' '))}</th>" for c in cols)
    body = []
    for r in sites["rows"]:
        cells = "".join(
            f"<td>{_e(fmt_bytes(r[c]) if 'bytes' in c and r[c] is not None else r[c])}</td>"
            for c in cols)
        body.append(f'<tr><td class="l">{_e(r["site"])}</td>{cells}</tr>')
    return (f'<table class="sites"><thead><tr><th>site</th>{head}</tr></thead><tbody>'
            + "".join(body) + "</tbody></table>")


def _json_for_script(data: Any) -> str:
    """JSON safe inside a <script> element (no "</", no HTML comment openers)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_viewer(title: str, subtitle: str, views: list[dict[str, Any]], names: list[str],
                  colors: list[str], peaks_table: str, notes: list[str]) -> str:
    """The whole page. ``views`` from :func:`.viewer_data.series_view`, ``names``/``colors``
    one per view, ``peaks_table`` ready-made HTML (the plot command's table)."""
    panels = []
    for i, (v, name) in enumerate(zip(views, names, strict=True)):
        lay = v["layout"]
        hidden = (f"; {lay['hidden_segments']} smaller segment(s) of "
                  f"{fmt_bytes(lay['hidden_bytes'])} not drawn" if lay["hidden_segments"] else "")
        panels.append(
            f'<div class="panel" id="panel-{i}" data-series="{i}">'
            f'<h3><span class="swatch" style="background:{colors[i]}"></span>{_e(name)}</h3>'
            f'<p>Segments after event {v["layout_event"]} (timeline position {v["layout_x"]}): '
            f'reserved {_e(fmt_bytes(v["layout_reserved"]))}, requested '
            f'{_e(fmt_bytes(v["layout_requested"]))}, {lay["total_segments"]} segment(s){_e(hidden)}.'
            "</p>" + layout_svg(lay, i) + "<h4>Top allocation sites at this peak</h4>"
            + _sites_table(v["sites"]) + "</div>")
    legend = ("".join(f'<span class="key"><span class="swatch" style="background:{c}"></span>'
                      f"{_e(t)}</span>" for c, t in zip(
                          _BLOCK_COLORS, ("requested bytes", "rounding slack",
                                          "freed, awaiting its stream"), strict=True))
              + '<span class="key"><span class="swatch free"></span>free in the segment</span>')
    series_keys = "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{_e(n)}: '
        f'peak reserved {_e(v["peak_text"])}</span>' for v, n, c in zip(views, names, colors, strict=True))
    data = {"series": [{"name": n, "color": c, "x": v["x"], "reserved": v["reserved"],
                        "allocated": v["allocated"], "peak_x": v["peak_x"],
                        "peak_reserved": v["peak_reserved"]}
                       for v, n, c in zip(views, names, colors, strict=True)],
            "geometry": {"W": W, "H": H, "L": L, "R": R, "T": T, "B": B, "PAD": PAD,
                         "xmax": max([v["x"][-1] for v in views if v["x"]] + [1])}}
    note_html = "".join(f"<li>{_e(n)}</li>" for n in notes)
    t = _e(title)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{t}</title>\n<style>\n{VIEWER_CSS}</style>\n"
        # first thing in the page: record any blocked load, so a test can tell it apart
        f"<script>\n{CSP_WATCH_JS}</script>\n</head>\n<body>\n"
        f"<h1>{t}</h1>\n<p class=\"meta\">{_e(subtitle)}</p>\n"
        '<section id="timeline"><h2>Timeline</h2>\n'
        "<p>Reserved (solid) and allocated (dashed: requested bytes) device memory per series; "
        "a triangle and a dotted line mark each series' peak reserved. Hover for values.</p>\n"
        f'<div class="keys">{series_keys}</div>\n'
        + timeline_svg(views, names, colors)
        + '\n<div id="readout" aria-live="polite"></div>\n</section>\n'
        f"<section id=\"peaks-section\"><h2>Peaks</h2>\n{peaks_table}\n</section>\n"
        '<section id="layouts"><h2>At each peak: segments and allocation sites</h2>\n'
        '<nav id="series-nav"></nav>\n'
        f'<div class="keys">{legend}</div>\n' + "\n".join(panels) + "\n</section>\n"
        + (f"<section><h2>Notes</h2><ul>{note_html}</ul></section>\n" if notes else "")
        + '<p class="foot">accel-alloc plot --html: self-contained, works offline.</p>\n'
        f'<script type="application/json" id="viewer-data">{_json_for_script(data)}</script>\n'
        f"<script>\n{VIEWER_JS}</script>\n</body>\n</html>\n"
    )
