"""KV-cache sizing from a memory budget (Engine.from_memory_budget) with FAKE executors and
FAKE runners (plumbing only: the arithmetic and which source is used). The real executors'
sizing runs in tests/test_serve_bench.py."""

from __future__ import annotations

import pytest
import torch
from serving_engine_fakes import FakeStepExecutor, fake_reference
from torch import nn

from accel_graph.errors import ConfigError
from accel_graph.serving.engine import Engine
from accel_graph.serving.requests import Request

SLOT_BYTES = 2 * 2 * 8 * 4  # two layers, k and v, 8 floats per slot each


class _FakeModel(nn.Module):
    def __init__(self, slots: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(250))  # 1000 bytes of weights
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.register_buffer("k_cache", torch.zeros(slots, 8))
            layer.register_buffer("v_cache", torch.zeros(slots, 8))


class _FakeRunner:
    def __init__(self, plan: bool) -> None:
        self.captures = 0
        if plan:
            self.plan_memory = lambda: {"pool_peak_reserved_bytes": 3000,
                                        "warmup_peak_bytes": 500}

    def memory_report(self) -> dict:
        assert self.captures, "measured before capture"
        return {"pool_peak_reserved_bytes": 4000}


class _FakeGraphExecutor(FakeStepExecutor):
    """FAKE: the fake executor with a model (weights, caches) and a fake runner."""

    def __init__(self, slots: int, capture: bool, plan: bool) -> None:
        super().__init__(num_slots=slots)
        self.model, self.runner, self.captured = _FakeModel(slots), _FakeRunner(plan), False
        if capture:
            self.capture()

    def capture(self) -> None:
        self.runner.captures += 1
        self.captured = True


@pytest.mark.parametrize("plan", [True, False])
def test_slots_from_budget(plan: bool) -> None:
    built: list[tuple[int, bool]] = []

    def build(slots: int, capture: bool) -> _FakeGraphExecutor:
        built.append((slots, capture))
        return _FakeGraphExecutor(slots, capture, plan)

    budget = 20_000
    eng = Engine.from_memory_budget(build, budget)
    kv = eng.kv_cache
    assert kv is not None
    pool, warm = (3000, 500) if plan else (4000, 0)
    assert kv.source == ("plan" if plan else "measured")
    assert (kv.pool_bytes, kv.warmup_peak_bytes, kv.weights_bytes) == (pool, warm, 1000)
    assert kv.bytes_per_slot == SLOT_BYTES
    assert kv.slots == (budget - 1000 - pool - warm) // SLOT_BYTES == eng.executor.num_slots
    assert built == [(1, False), (kv.slots, not plan)] and eng.executor.captured
    # The engine built this way serves requests.
    res = eng.submit(Request([1, 2, 3], 4))
    while eng.has_work():
        eng.step()
    assert res.tokens == fake_reference([1, 2, 3], 4, None, 97)


def test_budget_too_small_says_what_to_raise() -> None:
    with pytest.raises(ConfigError, match=r"raise the budget to at least 4628"):
        Engine.from_memory_budget(lambda s, capture: _FakeGraphExecutor(s, capture, True), 4000)


def test_max_slots_caps() -> None:
    eng = Engine.from_memory_budget(lambda s, capture: _FakeGraphExecutor(s, capture, True),
                                    10**6, max_slots=5)
    assert eng.executor.num_slots == 5 == eng.kv_cache.slots


def test_planned_pool_that_grows_with_slots_is_rechecked() -> None:
    """FAKE runner whose planned pool grows with the slots (as decode graphs' rows do): the
    final executor is planned again and given fewer slots, so weights + pool + warm-up + KV
    stay within the budget."""
    per_slot_pool = 200

    class _GrowingExecutor(_FakeGraphExecutor):
        def __init__(self, slots: int, capture: bool) -> None:
            super().__init__(slots, capture, True)
            self.runner.plan_memory = lambda: {"pool_peak_reserved_bytes": 3000 + per_slot_pool * slots,
                                               "warmup_peak_bytes": 500}

    budget = 20_000
    eng = Engine.from_memory_budget(lambda s, capture: _GrowingExecutor(s, capture), budget)
    kv = eng.kv_cache
    assert kv is not None and eng.executor.captured
    probe_slots = (budget - 1000 - 3200 - 500) // SLOT_BYTES
    assert kv.slots < probe_slots
    assert kv.pool_bytes == 3000 + per_slot_pool * kv.slots
    assert 1000 + kv.pool_bytes + 500 + kv.slots * SLOT_BYTES <= budget
