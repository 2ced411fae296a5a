"""The stylesheet and script inlined into ``accel-alloc plot --html`` pages (:mod:`.viewer_html`).

Plain ES2017 with no imports and no network calls: it reads the page's inline JSON block
(``#viewer-data``) and the SVG already in the page. It adds the timeline readout (every
series' reserved and allocated bytes at the pointer's position) and buttons choosing which
series' peak layout and sites are shown; with scripts off every panel stays visible. When it
has run it sets ``data-viewer="ready"`` on ``<html>`` and records the on-screen boxes of the
peak markers in ``data-peak-boxes`` (what the headless-browser test reads).
"""

from __future__ import annotations

__all__ = ["CSP_WATCH_JS", "VIEWER_CSS", "VIEWER_JS"]

#: Runs first (in <head>): every load the Content-Security-Policy blocks is appended to
#: ``data-csp-violations`` on <html> (none is expected; a test checks the attribute is absent).
CSP_WATCH_JS = r"""'use strict';
document.addEventListener('securitypolicyviolation', function (e) {
  const root = document.documentElement;
  root.setAttribute('data-csp-violations',
                    (root.getAttribute('data-csp-violations') || '') + e.blockedURI + ' ');
});
"""

VIEWER_CSS = """\
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 1.6em;color:#222;
  max-width:1000px}
h1{font-size:1.25em;margin:.2em 0}h2{font-size:1.08em;margin:1.4em 0 .4em;
  border-bottom:1px solid #ddd}h3{font-size:1em;margin:.8em 0 .3em}h4{font-size:.95em;margin:.8em 0 .3em}
p{margin:.3em 0}.meta{color:#555}.foot{color:#888;font-size:.8em;margin-top:2em}
svg{max-width:100%;height:auto;display:block}
.tick{font-size:11px;fill:#555}.axis{font-size:12px;fill:#333}.peak-label{font-size:11px;font-weight:600}
table{border-collapse:collapse;margin:.4em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:2px 7px;text-align:right}th{background:#f3f3f3;text-align:left}
td.l{text-align:left;word-break:break-all}
.keys{display:flex;flex-wrap:wrap;gap:.3em 1.2em;font-size:.85em;margin:.3em 0}
.swatch{display:inline-block;width:.9em;height:.9em;margin-right:.35em;vertical-align:-.1em;
  border:1px solid #999}.swatch.free{background:#f4f4f4}
#readout{font-family:ui-monospace,monospace;font-size:.85em;min-height:3.6em;white-space:pre;
  color:#333}
#series-nav button{margin:0 .4em .4em 0;padding:.2em .7em;border:1px solid #999;background:#fff;
  cursor:pointer;border-radius:3px}#series-nav button[aria-pressed="true"]{background:#e8eefc;
  border-color:#4e79a7}
.js .panel{display:none}.js .panel.shown{display:block}.empty{color:#777}
"""

VIEWER_JS = r"""'use strict';
(function () {
  const root = document.documentElement;
  const data = JSON.parse(document.getElementById('viewer-data').textContent);
  const g = data.geometry;
  const units = [[1 << 30, 'GiB'], [1 << 20, 'MiB'], [1 << 10, 'KiB']];
  function fmt(n) {
    for (const [scale, name] of units) {
      if (Math.abs(n) >= scale) { return (n / scale).toFixed(1) + ' ' + name; }
    }
    return n + ' B';
  }
  // index of the last point at or before x (points sorted by x)
  function at(xs, x) {
    let lo = 0, hi = xs.length - 1;
    if (hi < 0 || x < xs[0]) { return 0; }
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (xs[mid] <= x) { lo = mid; } else { hi = mid - 1; }
    }
    return lo;
  }
  const svg = document.getElementById('timeline-svg');
  const guide = document.getElementById('guide');
  const readout = document.getElementById('readout');
  function toX(clientX) {
    const box = svg.getBoundingClientRect();
    const px = (clientX - box.left) * g.W / box.width;
    const frac = (px - g.L - g.PAD) / (g.W - g.L - g.R - 2 * g.PAD);
    return [px, Math.max(0, Math.min(g.xmax, Math.round(frac * g.xmax)))];
  }
  svg.addEventListener('mousemove', function (ev) {
    const [px, x] = toX(ev.clientX);
    if (px < g.L || px > g.W - g.R) { return; }
    guide.setAttribute('x1', px);
    guide.setAttribute('x2', px);
    guide.setAttribute('visibility', 'visible');
    const lines = ['position ' + x];
    for (const s of data.series) {
      const i = at(s.x, x);
      lines.push(s.name + ': reserved ' + fmt(s.reserved[i]) + ', allocated ' +
                 fmt(s.allocated[i]));
    }
    readout.textContent = lines.join('\n');
  });
  svg.addEventListener('mouseleave', function () {
    guide.setAttribute('visibility', 'hidden');
  });
  // series buttons: one panel (peak layout and sites) at a time
  const nav = document.getElementById('series-nav');
  const panels = Array.from(document.querySelectorAll('.panel'));
  const buttons = data.series.map(function (s, i) {
    const b = document.createElement('button');
    b.type = 'button';
    b.textContent = s.name;
    b.style.borderLeft = '6px solid ' + s.color;
    b.addEventListener('click', function () { show(i); });
    nav.appendChild(b);
    return b;
  });
  function show(i) {
    panels.forEach(function (p, j) { p.classList.toggle('shown', j === i); });
    buttons.forEach(function (b, j) { b.setAttribute('aria-pressed', String(j === i)); });
  }
  root.classList.add('js');
  show(0);
  const boxes = Array.from(document.querySelectorAll('.peak-marker path')).map(function (p) {
    const r = p.getBoundingClientRect();
    return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height];
  });
  root.setAttribute('data-peak-boxes', JSON.stringify(boxes));
  root.setAttribute('data-viewer', 'ready');
})();
"""
