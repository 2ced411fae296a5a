"""Eager islands and pool reuse: the pool tensors alive at an island are held until the next
island, so the stretch after an island never reuses memory it reads from before it, and every
stretch of a compiled replay compiles (none replays interpreted for aliasing)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch

import accel_graph


@accel_graph.eager_island
def _negate(t: torch.Tensor) -> torch.Tensor:
    return -t


def _dies_after_the_island(x: torch.Tensor) -> torch.Tensor:
    """``a`` is made before the island, read after it and dies there; ``d`` (same size) is
    made after its death: without the hold, ``d`` takes ``a``'s memory in the stretch that
    reads ``a``."""
    a = x * 2
    b = _negate(a)
    c = a + b * 0.5
    del a, b
    return c * 3


def _capture(fn, x: torch.Tensor, compile: str | None):
    g = accel_graph.Graph(device="cpu", compile=compile,
                          compile_options={"replay": "compiled"} if compile else None)
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = fn(x)
    return g, out


def test_a_stretch_reading_a_tensor_that_dies_in_it_compiles_whole() -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g, out = _capture(_dies_after_the_island, x, "inductor")
    with torch.inference_mode():
        for i in range(3):
            x.copy_(torch.randn(64, generator=torch.Generator().manual_seed(i + 1)))
            g.replay()
            torch.testing.assert_close(out, _dies_after_the_island(x), rtol=1e-6, atol=1e-6)
    info = g.compile_info()
    assert not info.get("fallback"), info
    assert info["interpreted_stretches"] == [], info  # was [3]: the stretch after the island
    assert info["stretches"] == 2 and info["host_steps"] == 1, info
    assert g.replay_mode().mode == "compiled"


def test_interpreted_replay_is_bitwise_equal_and_held_tensors_are_no_outputs(tmp_path: Path) -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g, out = _capture(_dies_after_the_island, x, None)
    with torch.inference_mode():
        for i in range(3):
            x.copy_(torch.randn(64, generator=torch.Generator().manual_seed(i + 1)))
            g.replay()
            assert torch.equal(out, _dies_after_the_island(x))
    g.debug_dump(str(tmp_path / "g.dot"))
    dump = json.loads((tmp_path / "g.dot.json").read_text())
    # Tensors held at the island were let go before capture_end read the live ones: the
    # graph's only output is what the caller holds.
    assert len(dump["outputs"]) == 1 and dump["outputs"][0]["shape"] == [64]


def test_held_until_the_next_island_then_let_go() -> None:
    """``a`` dies after island 1: its memory is held through the stretch after island 1 (so
    that stretch cannot write over it) and let go at island 2 (later stretches cannot read it,
    so the pool may reuse it)."""
    seen: dict[str, bool] = {}

    @accel_graph.eager_island
    def probe(t: torch.Tensor) -> torch.Tensor:
        seen["alive at island 2"] = ref() is not None
        return t * 1

    def program(x: torch.Tensor) -> torch.Tensor:
        nonlocal ref
        a = x * 2
        ref = weakref.ref(a)
        b = _negate(a)  # island 1
        c = a + b
        del a
        seen["alive after its last use"] = ref() is not None
        d = probe(c)  # island 2
        return d + 1

    ref: weakref.ref | None = None
    x = torch.randn(8)
    g, out = _capture(program, x, None)
    assert seen == {"alive after its last use": True, "alive at island 2": False}
    with torch.inference_mode():
        g.replay()
        assert torch.equal(out, program(x))
    # Outside a capture nothing is held: ``a`` dies at ``del``.
    assert seen == {"alive after its last use": False, "alive at island 2": False}


@pytest.mark.slow
def test_hf_mixtral_decode_step_compiles_every_stretch() -> None:
    """The transformers 5 Mixtral decode step with its experts as islands: each stretch between
    islands is one Inductor program (the residual read after the MoE block used to die in the
    stretch that reads it, which then replayed interpreted)."""
    from moe_models import MOE_FAMILIES, build_moe, moe_decode_step, require_transformers_5

    transformers = require_transformers_5()
    model, config = build_moe("mixtral", experts="eager")
    eager_model, _ = build_moe("mixtral", experts="eager")
    for m in model.modules():
        if type(m).__name__ == MOE_FAMILIES["mixtral"].experts:
            accel_graph.eager_island(m)
    step, eager_step = moe_decode_step(model), moe_decode_step(eager_model)
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(3))
    caches = [transformers.StaticCache(config=config, max_cache_len=16) for _ in range(2)]
    ids = torch.tensor([[5]])
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with torch.inference_mode():
        model(input_ids=prompt, cache=caches[0])
        eager_model(input_ids=prompt, cache=caches[1])
        with accel_graph.graph(g):
            out = step(ids, caches[0])
        eager_step(ids.clone(), caches[1])  # capture ran the pieces once (the cache moved)
        for tok in (5, 77, 120):
            ids.fill_(tok)
            g.replay()
            torch.testing.assert_close(out, eager_step(torch.tensor([[tok]]), caches[1]),
                                       rtol=1e-5, atol=1e-5)
    info = g.compile_info()
    assert info["interpreted_stretches"] == [] and info["stretches"] == 3, info
