"""GraphRunner with compiled replay (Inductor): one small case, marked slow (compiles C++)."""

from __future__ import annotations

import pytest
import torch

from accel_graph import GraphRunner


@pytest.mark.slow
def test_compiled_replay_serves_and_verifies() -> None:
    w = torch.randn(16, 16)

    def fn(x):
        return torch.relu(x @ w) * 2 + 1

    r = GraphRunner(fn, torch.zeros(1, 16), buckets=[2, 4], compile="inductor",
                    progress=False).capture()
    for n in (1, 3, 4):
        x = torch.randn(n, 16)
        torch.testing.assert_close(r(x), fn(x), rtol=1e-5, atol=1e-6)
    st = r.stats()
    assert st["eager_calls"] == 0 and all(b["verified"] for b in st["buckets"])
    assert r.memory_report()["compile"] == "inductor"


def test_compile_options_reach_every_bucket_graph() -> None:
    from accel_graph.errors import ConfigError

    w = torch.randn(8, 8)

    def fn(x):
        return x @ w + 1

    with pytest.raises(ConfigError, match="accepted"):  # checked at construction
        GraphRunner(fn, torch.zeros(1, 8), buckets=[2], compile="inductor",
                    compile_options={"replay": "interpreted", "nope": 1})
    with pytest.raises(ConfigError, match="compiled replay only"):  # as Graph(...): not lazily
        GraphRunner(fn, torch.zeros(1, 8), buckets=[2], capture="lazy",
                    compile_options={"replay": "compiled"})
    with pytest.raises(ConfigError, match="unknown compile"):
        GraphRunner(fn, torch.zeros(1, 8), buckets=[2], capture="lazy", compile="inductr")
    r = GraphRunner(fn, torch.zeros(1, 8), buckets=[1, 2], compile="inductor",
                    compile_options={"replay": "interpreted"}, progress=False).capture()
    modes = [b.graph.replay_mode() for b in r.runtime.buckets]
    assert [m.mode for m in modes] == ["interpreted", "interpreted"]
    assert all("forced" in m.reason for m in modes), modes
    assert [row["replay_mode"] for row in r.memory_report()["buckets"]] == ["interpreted"] * 2
    x = torch.randn(2, 8)
    torch.testing.assert_close(r(x), fn(x))

@pytest.mark.slow
def test_compile_time_reported_apart_from_capture() -> None:
    """Each bucket's compile_ms is part of its capture_ms; stats add them up; a second runner
    over the same programs compiles nothing (process-wide module cache: "hit")."""
    w = torch.randn(8, 8)

    def fn(x):
        return torch.tanh(x @ w) - 3

    def run() -> dict:
        r = GraphRunner(fn, torch.zeros(1, 8), buckets=[1, 2], compile="inductor",
                        progress=False).capture()
        g = r.graph(2)
        assert g is not None
        info = g.compile_info()
        assert info is not None and info["backend"] == "inductor"
        info["cache"] = "changed"  # a copy: the graph's own record is not the caller's
        assert g.compile_info()["cache"] != "changed"
        return r.stats()

    first = run()
    buckets = first["buckets"]
    if any(b["compile_cache"] == "fallback" for b in buckets):
        pytest.skip("Inductor cannot compile here")
    for b in buckets:
        assert b["compile_cache"] in ("hit", "miss")
        assert 0 < b["compile_ms"] <= b["capture_ms"]
    total = sum(b["compile_ms"] for b in buckets) / 1e3
    assert first["compile_seconds"] == pytest.approx(total)
    assert first["compile_seconds"] <= first["capture_seconds"]
    again = run()
    assert [b["compile_cache"] for b in again["buckets"]] == ["hit", "hit"]


def test_uncompiled_runner_reports_no_compile_time() -> None:
    r = GraphRunner(lambda x: x * 2, torch.zeros(1, 4), buckets=[1, 2], progress=False).capture()
    st, mem = r.stats(), r.memory_report()
    assert st["compile_seconds"] == 0.0 and st["capture_seconds"] > 0
    assert all(b["compile_ms"] is None and b["compile_cache"] is None for b in st["buckets"])
    assert all(b["compile_ms"] is None for b in mem["buckets"])
    g = r.graph(1)
    assert g is not None and g.compile_info() is None
