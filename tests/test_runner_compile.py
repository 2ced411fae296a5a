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
