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
    r = GraphRunner(fn, torch.zeros(1, 8), buckets=[1, 2], compile="inductor",
                    compile_options={"replay": "interpreted"}, progress=False).capture()
    modes = [b.graph.replay_mode() for b in r.runtime.buckets]
    assert [m.mode for m in modes] == ["interpreted", "interpreted"]
    assert all("forced" in m.reason for m in modes), modes
    assert [row["replay_mode"] for row in r.memory_report()["buckets"]] == ["interpreted"] * 2
    x = torch.randn(2, 8)
    torch.testing.assert_close(r(x), fn(x))
