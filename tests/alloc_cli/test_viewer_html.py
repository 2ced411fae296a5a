"""``accel-alloc plot --html``: one self-contained offline viewer.

Two layers of checks. Always: the page is parsed (no external URL anywhere, no src/href at all,
no fetch/XMLHttpRequest/import of remote modules, a Content-Security-Policy forbidding every
load, the data embedded, every peak marker inside the plot, also for a peak at event 0) and its
script is syntax-checked with node when node exists. When a headless Chromium exists (a
``chromium``/``google-chrome`` binary on PATH, or ``ACCEL_GRAPH_CHROME``): the page is opened
over the DevTools protocol, which lists every request the page makes (a control page proves a
remote load would be listed), its script must run, no load may be blocked, and the screenshot
must be non-blank with every peak marker drawn in its series' colour. CI installs only from the
repository's own files, which cannot bring a browser, so there the browser test skips and says
why.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from accel_graph.allocator.traces import Trace, save_trace
from accel_graph.allocator.traces.actions import ACTION_CODE
from accel_graph.cli.alloc import viewer_html
from accel_graph.cli.alloc.viewer_script import CSP_WATCH_JS, VIEWER_JS

ES = "expandable_segments:True"
MIB = 1 << 20


@pytest.fixture(scope="module")
def start_peak_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trace whose peak reserved is its start state (x = 0): a cached 64 MiB segment that an
    empty_cache releases first, then a little work in a 20 MiB segment."""
    a, b = 0x7F0000000000, 0x7F0010000000
    c = ACTION_CODE
    events = [(c["segment_free"], a, 64 * MIB, 0, 0), (c["segment_alloc"], b, 20 * MIB, 0, 0),
              (c["alloc"], b, 10 * MIB, 0, 0), (c["free_requested"], b, 10 * MIB, 0, 0),
              (c["free_completed"], b, 10 * MIB, 0, 0), (c["alloc"], b, 4 * MIB, 0, 0)]
    blocks = [{"address": b, "size": 4 * MIB, "requested_size": 4 * MIB,
               "state": "active_allocated", "frames": []},
              {"address": b + 4 * MIB, "size": 16 * MIB, "requested_size": 0,
               "state": "inactive", "frames": []}]
    seg = {"device": 0, "address": b, "total_size": 20 * MIB, "allocated_size": 4 * MIB,
           "active_size": 4 * MIB, "requested_size": 4 * MIB, "stream": 0,
           "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
           "frames": [], "blocks": blocks}
    path = tmp_path_factory.mktemp("start") / "start_peak.pickle"
    save_trace(Trace.from_events(events, segments=[seg]), path)
    return path


def _viewer(cli: Any, trace: Path, out: Path, *extra: str) -> dict[str, Any]:
    r = cli("plot", trace, "--config", "recorded", "--config", ES, "--html", out, "--json",
            *extra)
    assert r.code == 0, r.err
    body = r.json()
    assert body["html"] == str(out) and body["html_bytes"] == out.stat().st_size
    return body


def _check_offline(page: str) -> dict[str, Any]:
    """Static checks of a viewer page; returns its embedded data."""
    assert page.startswith("<!DOCTYPE html>")
    low = page.lower()
    for needle in ("http://", "https://", "//cdn", "src=", "href=", "<link", "<img", "<iframe",
                   "<object", "<embed", "@import", "url(", "fetch(", "xmlhttprequest",
                   "websocket", "eventsource", "sendbeacon", "import(", "import ",
                   "serviceworker", "<base"):
        assert needle not in low, needle
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert csp and "default-src 'none'" in html.unescape(csp.group(1))
    scripts = re.findall(r"<script([^>]*)>", page)
    assert scripts == ["", ' type="application/json" id="viewer-data"', ""]
    m = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', page, re.S)
    assert m
    return json.loads(m.group(1))


def _markers(page: str) -> list[dict[str, Any]]:
    """Each peak marker: its series, x position in the trace, and its triangle's corners."""
    out = []
    for m in re.finditer(r'<g class="peak-marker" data-series="(\d+)" data-x="(\d+)" '
                         r'data-bytes="(\d+)">.*?<path d="([^"]+)"', page, re.S):
        pts = [tuple(map(float, p.split(","))) for p in re.findall(r"[\d.]+,[\d.]+", m.group(4))]
        out.append({"series": int(m.group(1)), "x": int(m.group(2)),
                    "bytes": int(m.group(3)), "points": pts})
    return out


def _check_markers_inside(page: str, series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    marks = _markers(page)
    assert [m["series"] for m in marks] == list(range(len(series)))
    g = viewer_html
    for m, s in zip(marks, series, strict=True):
        assert m["x"] == s["peak_x"] and m["bytes"] == s["peak_reserved"]
        xs = [p[0] for p in m["points"]]
        ys = [p[1] for p in m["points"]]
        # the whole triangle inside the plot's x range and inside the picture
        assert g.L <= min(xs) and max(xs) <= g.W - g.R, m
        assert 0 <= min(ys) and max(ys) <= g.H - g.B, m
    return marks


def test_viewer_on_npu_trace(cli, npu_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "v.html"
    body = _viewer(cli, npu_dir / "snapshot_with_empty_cache.pkl", out)
    page = out.read_text()
    data = _check_offline(page)
    series = body["series"]
    assert [s["name"] for s in data["series"]] == [
        "simulated, recorded settings", f"simulated {ES}", "recorded (trace)"]
    for d, s in zip(data["series"], series, strict=True):
        assert d["peak_reserved"] == s["peak_reserved"] and d["peak_x"] == s["peak_x"]
        assert max(d["reserved"]) == s["peak_reserved"]  # downsampling keeps the peak
    _check_markers_inside(page, series)
    # a layout and a sites table per series; the sites are the recorded stacks' files
    assert page.count('class="layout-svg"') == 3 and page.count('class="sites"') == 3
    assert "memory_leaks_demo.py" in page
    assert '<table id="peaks">' in page


def test_viewer_marks_a_peak_at_the_start(cli, start_peak_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "start.html"
    body = _viewer(cli, start_peak_trace, out)
    page = out.read_text()
    _check_offline(page)
    assert all(s["peak_x"] == 0 for s in body["series"])
    marks = _check_markers_inside(page, body["series"])
    # no triangle hides another: equal peaks at one point are stacked
    boxes = [(min(p[0] for p in m["points"]), min(p[1] for p in m["points"])) for m in marks]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert abs(a[0] - b[0]) >= 14 or abs(a[1] - b[1]) >= 12


def test_viewer_needs_no_matplotlib(cli, train_trace: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "t.html"
    r = cli("plot", train_trace, "--no-recorded", "--html", out, "--top", "3")
    assert r.code == 0, r.err
    assert f"wrote {out} (offline viewer" in r.out
    _check_offline(out.read_text())
    assert cli("plot", train_trace, "-o", tmp_path / "t.png").code == 7


def test_plot_needs_an_output(cli, train_trace: Path) -> None:
    r = cli("plot", train_trace)
    assert r.code == 2 and "--html" in r.err and "-o" in r.err
    assert cli("plot", train_trace, "--html", "x.html", "--top", "0").code == 2


def test_viewer_script_syntax() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not found: the viewer script is not syntax-checked here")
    for name, code in (("viewer.js", VIEWER_JS), ("watch.js", CSP_WATCH_JS)):
        r = subprocess.run([node, "--check", "-"], input=code, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, f"{name}: {r.stderr}"


# ---------------------------------------------------------------------------------------------
# headless Chromium


def _chrome() -> str:
    for name in (os.environ.get("ACCEL_GRAPH_CHROME"), "chromium", "chromium-browser",
                 "google-chrome", "google-chrome-stable", "chrome"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    pytest.skip("no headless browser (chromium/google-chrome not on PATH, ACCEL_GRAPH_CHROME "
                "unset): CI installs only from pyproject/constraints, which cannot bring one; "
                "the static checks above cover the page there")


class _DevTools:
    """Chromium driven over its DevTools pipe (``--remote-debugging-pipe``: commands as JSON
    on fd 3, replies and events on fd 4, each ended by a NUL). Only the page's own session is
    listened to, so the browser's background traffic (update checks, network time) is not
    mistaken for the page's: every request the page makes shows as Network.requestWillBeSent
    in its session."""

    def __init__(self, chrome: str, profile: Path) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def fds() -> None:  # in the child: the pipe ends at 3 and 4 (copied first, so that
            # neither overwrites the other); pass_fds keeps 3 and 4 open past close_fds
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from the browser")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 120) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self._next:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_for(self, method: str, session: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method and e.get("sessionId") == session
                      for e in self.events):
            self.events.append(self._read(deadline))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=20)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


def _open(dt: _DevTools, url: str) -> str:
    """Open ``url`` in a new 1100x1400 page; returns its session once it has loaded."""
    target = dt.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = dt.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for method in ("Network.enable", "Page.enable", "Runtime.enable"):
        dt.call(method, session=session)
    dt.call("Emulation.setDeviceMetricsOverride", {"width": 1100, "height": 1400,
                                                   "deviceScaleFactor": 1, "mobile": False},
            session=session)
    dt.call("Page.navigate", {"url": url}, session=session)
    dt.wait_for("Page.loadEventFired", session)
    return session


def _requests(dt: _DevTools, session: str) -> list[str]:
    return [e["params"]["request"]["url"] for e in dt.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session]


def _evaluate(dt: _DevTools, session: str, expression: str) -> Any:
    r = dt.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                session=session)
    return r["result"].get("value")


@pytest.fixture
def devtools(tmp_path: Path) -> Any:
    dt = _DevTools(_chrome(), tmp_path / "profile")
    yield dt
    dt.close()


def test_viewer_in_headless_chromium(cli, start_peak_trace: Path, tmp_path: Path,
                                     devtools: _DevTools) -> None:
    image = pytest.importorskip("PIL.Image")
    # control: a page's remote load does show up as a request of its session
    control = tmp_path / "control.html"
    control.write_text('<!DOCTYPE html><img src="http://accel-graph-test.invalid/x.png">')
    s0 = _open(devtools, control.as_uri())
    assert any("accel-graph-test.invalid" in u for u in _requests(devtools, s0))

    out = tmp_path / "start.html"
    body = _viewer(cli, start_peak_trace, out)
    s1 = _open(devtools, out.as_uri())
    assert _requests(devtools, s1) == [out.as_uri()]  # the page itself and nothing else
    assert _evaluate(devtools, s1, "document.documentElement.dataset.viewer") == "ready"
    assert _evaluate(devtools, s1, "document.documentElement.dataset.cspViolations") is None
    boxes = json.loads(_evaluate(devtools, s1, "document.documentElement.dataset.peakBoxes"))
    assert len(boxes) == len(body["series"])
    shot = devtools.call("Page.captureScreenshot", {"format": "png"}, session=s1)["data"]
    img = image.open(io.BytesIO(base64.b64decode(shot))).convert("RGB")
    px = np.asarray(img, dtype=np.int64)
    white = int((px == 255).all(axis=2).sum())
    assert white < 0.97 * px.shape[0] * px.shape[1]  # non-blank
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 50
    colors = [d["color"] for d in _check_offline(out.read_text())["series"]]
    for (left, top, w, h), color in zip(boxes, colors, strict=True):
        assert w > 5 and h > 5 and left >= 0 and top >= 0
        want = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        box = px[int(top):int(top + h) + 1, int(left):int(left + w) + 1]
        hits = int((np.abs(box - want) <= 8).all(axis=2).sum())
        assert hits >= 10, (color, hits)  # the marker is drawn, in its colour, not covered
