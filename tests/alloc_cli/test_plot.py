"""``accel-alloc plot`` and the timelines it draws (accel_graph.allocator.analysis.timeline)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.analysis.timeline import Timeline, recorded_timeline, simulated_timeline
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.sim.scenario import make_scenario, simulate
from accel_graph.allocator.sim.trace_ops import recorded_summary
from accel_graph.allocator.traces import load_trace
from accel_graph.allocator.units import fmt_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ES = "expandable_segments:True"


def _busiest(trace) -> int:
    return max(range(len(trace.device_traces)), key=lambda i: len(trace.device_traces[i]))


def _check_timelines(trace, device: int) -> None:
    rec = recorded_summary(trace, device)
    rt = recorded_timeline(trace, device)
    assert rt.peak_reserved == rec["peak_reserved"]
    assert rt.final_reserved == rec["final_reserved"]
    assert int(rt.reserved[0]) == rec["start_reserved"]
    assert (rt.allocated >= 0).all()
    for cfg in (None, ES):
        sim = simulate(trace, make_scenario(trace, cfg, device=device), device=device,
                       keep_events=True)
        st = simulated_timeline(sim, trace)
        assert st.peak_reserved == sim.peak_reserved
        assert st.final_reserved == sim.final_reserved
        assert int(st.reserved[0]) == sim.start_reserved
        assert st.peak_allocated == sim.replay.peak_requested
        # one x axis for every config of the trace
        assert st.x[-1] == rt.x[-1]
        assert (np.diff(st.x) >= 0).all()
        assert len(st.x) == len(st.allocated) == len(st.reserved)


def test_timelines_match_summaries_on_npu_traces(npu_dir: Path) -> None:
    files = sorted(npu_dir.glob("*.pkl"))
    assert files
    for path in files:
        trace = load_trace(path)
        _check_timelines(trace, _busiest(trace))


@pytest.mark.parametrize("workload", ["train", "frag", "serve"])
def test_timelines_match_summaries_on_generated_traces(workload: str) -> None:
    trace = generate(workload, seed=0, steps=1 if workload != "frag" else None)
    _check_timelines(trace, 0)
    tl = recorded_timeline(trace, 0)
    assert tl.time_us is not None and len(tl.time_us) == len(tl)
    sim = simulate(trace, make_scenario(trace, None), keep_events=True)
    st = simulated_timeline(sim, trace)
    assert st.time_us is not None and (np.diff(st.time_us) >= 0).all()


def test_simulated_timeline_needs_events(frag_trace: Path) -> None:
    trace = load_trace(frag_trace)
    sim = simulate(trace, make_scenario(trace, None))
    with pytest.raises(ValueError, match="keep_events"):
        simulated_timeline(sim)


def test_downsample_keeps_peaks_and_ends() -> None:
    rng = np.random.default_rng(0)
    n = 100_003
    res = np.cumsum(rng.integers(-5, 6, n)).astype(np.int64) + 10_000
    alloc = res - rng.integers(0, 100, n)
    tl = Timeline(np.arange(n), alloc, res, None, "x")
    d = tl.downsample(1000)
    assert len(d) <= 1000
    assert d.peak_reserved == tl.peak_reserved and d.peak_allocated == tl.peak_allocated
    assert d.reserved.min() == tl.reserved.min() and d.allocated.min() == tl.allocated.min()
    assert d.x[0] == 0 and d.x[-1] == n - 1 and d.final_reserved == tl.final_reserved
    assert np.isin(d.x, tl.x).all() and (np.diff(d.x) > 0).all()
    assert tl.downsample(n) is tl
    with pytest.raises(ValueError):
        tl.downsample(3)


# ---------------------------------------------------------------------------------------------
# the command


def test_plot_png(cli, frag_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.png"
    r = cli("plot", frag_trace, "--config", "recorded", "--config", ES, "-o", out, "--json")
    assert r.code == 0, r.err
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    body = r.json()
    assert body["schema"] == "accel-alloc/plot/1" and body["format"] == "png"
    assert [s["kind"] for s in body["series"]] == ["simulated", "simulated", "recorded"]
    default, es, rec = body["series"]
    trace = load_trace(frag_trace)
    assert default["peak_reserved"] == rec["peak_reserved"] == \
        recorded_summary(trace)["peak_reserved"]
    assert es["peak_reserved"] * 5 < default["peak_reserved"]  # the known fragmentation
    assert es["config"] == ES and default["config"] is None


def test_plot_html_is_self_contained(cli, frag_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.html"
    r = cli("plot", frag_trace, "--config", ES, "-o", out, "--json")
    assert r.code == 0, r.err
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "</svg>" in page
    assert '<table id="peaks">' in page
    for s in r.json()["series"]:
        assert fmt_bytes(s["peak_reserved"]) in page
    assert "<?xml" not in page  # the SVG is inline
    for external in ("<script", "<link", "<img", 'href="http', "src=", "url(http"):
        assert external not in page


def test_plot_svg_without_recorded(cli, frag_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.svg"
    r = cli("plot", frag_trace, "--no-recorded", "--max-points", "50", "-o", out, "--json")
    assert r.code == 0, r.err
    text = out.read_text()
    assert "<svg" in text and text.rstrip().endswith("</svg>")
    assert [s["kind"] for s in r.json()["series"]] == ["simulated"]
    assert "wrote" not in r.out  # --json: only the document on stdout


def test_plot_text_summary(cli, train_trace: Path, tmp_path: Path) -> None:
    r = cli("plot", train_trace, "-o", tmp_path / "t.png")
    assert r.code == 0, r.err
    assert "wrote" in r.out and "peak reserved" in r.out


def test_plot_unknown_extension_is_a_usage_error(cli, frag_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.jpg"
    r = cli("plot", frag_trace, "-o", out)
    assert r.code == 2
    assert ".png" in r.err and ".html" in r.err
    assert not out.exists()


def test_plot_without_matplotlib(cli, frag_trace: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = cli("plot", frag_trace, "-o", tmp_path / "f.png")
    assert r.code == 7
    assert "pip install 'accel-graph[plot]'" in r.err
    assert not (tmp_path / "f.png").exists()


def test_plot_errors(cli, frag_trace: Path, tmp_path: Path) -> None:
    assert cli("plot", frag_trace, "--config", "bogus:1", "-o", tmp_path / "a.png").code == 3
    assert cli("plot", tmp_path / "missing.pkl", "-o", tmp_path / "a.png").code == 4
    assert cli("plot", frag_trace).code == 2  # -o is required
    assert cli("plot", frag_trace, "--cap", "1MiB", "-o", tmp_path / "a.png").code == 6
