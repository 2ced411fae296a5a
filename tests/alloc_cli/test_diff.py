"""``accel-alloc diff``: two traces, or one trace under two configs or profiles."""

from __future__ import annotations

from pathlib import Path

from accel_graph.allocator.sim.scenario import make_scenario, simulate
from accel_graph.allocator.sim.trace_ops import recorded_summary
from accel_graph.allocator.traces import load_trace
from accel_graph.cli.alloc.diff import METRICS, RECORDED_METRICS

ES = "expandable_segments:True"


def _all_zero(section: dict) -> bool:
    return all(m["delta"] == 0 and m["relative"] == 0 for m in section.values())


def test_trace_against_itself_has_zero_deltas(cli, frag_trace: Path, train_trace: Path) -> None:
    for path in (frag_trace, train_trace):
        r = cli("diff", path, path, "--json")
        assert r.code == 0, r.err
        body = r.json()
        assert body["schema"] == "accel-alloc/diff/1" and body["mode"] == "traces"
        assert set(body["metrics"]) == set(METRICS)
        assert set(body["recorded"]) == set(RECORDED_METRICS)
        assert _all_zero(body["metrics"]) and _all_zero(body["recorded"])
        assert body["passed"] is True and body["fail_above_pct"] is None
    # the same config twice on one trace: zero as well
    r = cli("diff", frag_trace, "--config", ES, "--config-b", ES, "--json")
    assert r.code == 0 and _all_zero(r.json()["metrics"])


def test_frag_default_vs_expandable(cli, frag_trace: Path) -> None:
    r = cli("diff", frag_trace, "--config-b", ES, "--json")
    assert r.code == 0, r.err
    body = r.json()
    assert body["mode"] == "configs"
    assert body["a"]["scenario"]["config"] is None and body["b"]["scenario"]["config"] == ES
    peak = body["metrics"]["peak_reserved"]
    trace = load_trace(frag_trace)
    want_a = simulate(trace, make_scenario(trace, None)).peak_reserved
    want_b = simulate(trace, make_scenario(trace, ES)).peak_reserved
    assert (peak["a"], peak["b"]) == (want_a, want_b)
    assert peak["delta"] == want_b - want_a
    assert peak["relative"] < -0.8  # allocator-semantics/trace-generator: > 5x less
    assert body["metrics"]["device_mallocs"]["b"] == 0
    assert body["metrics"]["segment_maps"]["b"] > 0
    assert body["metrics"]["segment_maps"]["relative"] is None  # 0 -> n
    assert _all_zero(body["recorded"])  # one trace: one recording
    text = cli("diff", frag_trace, "--config-b", ES)
    assert text.code == 0 and "peak reserved" in text.out and "-93." in text.out


def test_fail_above_gate(cli, frag_trace: Path) -> None:
    # B = defaults: ~16x A's peak reserved -> regression
    worse = cli("diff", frag_trace, "--config", ES, "--config-b", "", "--fail-above", "10",
                "--json")
    assert worse.code == 1 and worse.json()["passed"] is False
    assert "FAILED" in cli("diff", frag_trace, "--config", ES, "--config-b", "",
                           "--fail-above", "10").out
    better = cli("diff", frag_trace, "--config-b", ES, "--fail-above", "0", "--json")
    assert better.code == 0 and better.json()["passed"] is True
    same = cli("diff", frag_trace, frag_trace, "--fail-above", "0")
    assert same.code == 0  # equal is not "more than 0 %"
    assert cli("diff", frag_trace, "--config", ES, "--config-b", "",
               "--fail-above", "100000").code == 0


def test_two_npu_traces(cli, npu_dir: Path) -> None:
    a, b = npu_dir / "snapshot_with_empty_cache.pkl", npu_dir / "snapshot_with_empty_cache_expandable.pkl"
    r = cli("diff", a, b, "--json")
    assert r.code == 0, r.err
    body = r.json()
    ra, rb = recorded_summary(load_trace(a)), recorded_summary(load_trace(b))
    for key in RECORDED_METRICS:
        m = body["recorded"][key]
        assert (m["a"], m["b"], m["delta"]) == (ra[key], rb[key], rb[key] - ra[key])
    assert body["a"]["trace"] == str(a) and body["b"]["trace"] == str(b)


def test_profile_b(cli, npu_dir: Path) -> None:
    path = npu_dir / "snapshot_with_empty_cache.pkl"
    r = cli("diff", path, "--profile", "cuda-2.13", "--profile-b", "cuda-2.9", "--json")
    assert r.code == 0, r.err
    body = r.json()
    assert body["a"]["scenario"]["profile"] == "cuda-2.13"
    assert body["b"]["scenario"]["profile"] == "cuda-2.9"
    # the profile reaches the replay: with max_split + ES the two versions are noted apart
    r = cli("diff", path, "--config", "expandable_segments:True,max_split_size_mb:64",
            "--profile", "cuda-2.13", "--profile-b", "cuda-2.9", "--json")
    assert r.code == 0, r.err
    assert any(n.startswith("cuda-2.9") for n in r.json()["b"]["notes"])
    assert any(n.startswith("cuda-2.13") for n in r.json()["a"]["notes"])


def test_diff_errors(cli, frag_trace: Path, tmp_path: Path) -> None:
    r = cli("diff", frag_trace)
    assert r.code == 2 and "--config-b" in r.err
    assert cli("diff", frag_trace, "--config-b", "bogus:1").code == 3
    assert cli("diff", frag_trace, "--profile-b", "nope-1.0").code == 5
    assert cli("diff", frag_trace, tmp_path / "missing.pkl").code == 4
    assert cli("diff", frag_trace, "--config-b", ES, "--fail-above", "x").code == 2
