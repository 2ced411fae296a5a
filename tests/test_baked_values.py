"""Baked host values (issue 17 item 5): Python numbers read from mutable state that a graph
would freeze at capture, found by ``check_capturable(steps=2)`` and by the runner's second
checked replay."""

from __future__ import annotations

import pytest
import torch

from accel_graph import ConfigError, GraphRunner, check_capturable


class Position:
    """Mutable host state: a step counter kept as a Python int (the bug under test)."""

    def __init__(self) -> None:
        self.n = 5


def test_a_python_int_read_from_state_is_reported_with_op_and_line() -> None:
    pos = Position()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = x + pos.n  # baked: the graph would add 5 forever
        pos.n += 1
        return out * 2

    rep = check_capturable(step, torch.zeros(3), steps=2)
    baked = [f for f in rep.findings if f.level == "baked"]
    assert len(baked) == 1
    assert baked[0].op == "aten.add.Tensor"
    assert "other was 5 then 6" in baked[0].reason
    assert "test_baked_values.py" in baked[0].location and "in step" in baked[0].location
    assert not rep.ok


def test_values_kept_in_tensors_are_not_reported() -> None:
    pos = torch.tensor([5])

    def step(x: torch.Tensor) -> torch.Tensor:
        out = x + pos
        pos.add_(1)
        return out.narrow(0, 0, 2) * 2.5

    rep = check_capturable(step, torch.zeros(3), steps=3)
    assert rep.ok, rep.format()


def test_advance_runs_between_steps() -> None:
    state = {"len": 4}

    def step(x: torch.Tensor) -> torch.Tensor:
        return x.narrow(0, 0, state["len"]).sum()

    assert check_capturable(step, torch.ones(8), steps=2).ok  # nothing moves the state
    rep = check_capturable(step, torch.ones(8), steps=2, advance=lambda: state.update(len=5))
    assert [f.op for f in rep.findings] == ["aten.slice.Tensor"]  # narrow decomposes to slice
    assert "end was 4 then 5" in rep.findings[0].reason


def test_host_dependent_control_flow_is_reported_as_a_program_change() -> None:
    pos = Position()

    def step(x: torch.Tensor) -> torch.Tensor:
        pos.n += 1
        return x * 2 if pos.n % 2 else x.exp()

    rep = check_capturable(step, torch.zeros(3), steps=2)
    assert len(rep.findings) == 1 and "recorded program changed" in rep.findings[0].reason


def test_bad_steps_are_refused() -> None:
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ConfigError, match=f"steps={bad!r}"):
            check_capturable(lambda x: x + 1, torch.zeros(1), steps=bad)
    with pytest.raises(ConfigError, match="advance= is run between steps"):
        check_capturable(lambda x: x + 1, torch.zeros(1), steps=1, advance=lambda: None)


def test_default_looks_for_baked_values_and_steps_1_runs_once() -> None:
    """Issue 29 item 3: the default (no steps=) finds a host value a graph would freeze: a
    plain Graph cannot see it, and steps=2 had to be asked for. steps=1 is one run, unchecked."""
    pos = Position()
    runs = []

    def step(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        pos.n += 1  # host state the function itself advances, as transformers 5's caches do
        return x + pos.n

    rep = check_capturable(step, torch.zeros(2))
    assert not rep.ok and [f.level for f in rep.findings] == ["baked"], rep.format()
    assert len(runs) == 2
    runs.clear()
    assert check_capturable(step, torch.zeros(2), steps=1).ok and len(runs) == 1
    assert check_capturable(step, torch.zeros(2), steps=None).ok and len(runs) == 2


def test_runner_second_checked_replay_catches_a_value_baked_at_capture() -> None:
    """The first replay matches eager (the baked value is still current); the second does not.
    verify=True checks both, so the bucket is disabled and the call returns eager's result."""
    pos = Position()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + pos.n

    r = GraphRunner(step, torch.zeros(1, 2), buckets=[2], progress=False).capture()  # bakes 5
    assert torch.equal(r(torch.zeros(2, 2)), torch.full((2, 2), 5.0))  # check 1: equal
    pos.n = 6
    assert torch.equal(r(torch.zeros(2, 2)), torch.full((2, 2), 6.0))  # check 2: caught
    assert r.captured_buckets == []
    assert "disabled by verification" in r.stats()["eager_fallbacks"][0]["reason"]

    once = GraphRunner(step, torch.zeros(1, 2), buckets=[2], verify=1, progress=False).capture()
    once(torch.zeros(2, 2))  # bakes and checks 6
    pos.n = 9
    # With one check only the frozen value is replayed: the silent wrong result this guards.
    assert torch.equal(once(torch.zeros(2, 2)), torch.full((2, 2), 6.0))


def test_gemma2_bakes_a_cache_length_and_llama_does_not() -> None:
    """transformers 5.x Gemma2 reads sequence lengths from its cache as Python ints (the issue's
    case); Llama with the same cache keeps them in tensors."""
    pytest.importorskip("transformers", reason="transformers is a test dependency (pyproject [test])")
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        StaticCache,
    )

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
    cases = [(Gemma2ForCausalLM, Gemma2Config(**common, head_dim=16, sliding_window=4), True),
             (LlamaForCausalLM, LlamaConfig(**common), False)]
    for model_cls, config, bakes in cases:
        torch.manual_seed(0)
        model = model_cls(config).eval()
        cache = StaticCache(config=config, max_cache_len=16)
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 5)), cache=cache, cache_position=torch.arange(5))
        pos = torch.tensor([5])

        def step(ids: torch.Tensor, cache_position: torch.Tensor, model=model, cache=cache) -> torch.Tensor:
            return model(input_ids=ids, cache=cache, cache_position=cache_position).logits

        rep = check_capturable(step, torch.zeros(2, 1, dtype=torch.long), pos, steps=2,
                               advance=lambda pos=pos: pos.add_(1))
        baked = [f for f in rep.findings if f.level == "baked"]
        assert bool(baked) is bakes, (model_cls.__name__, rep.format())
        if bakes:
            assert any("transformers" in f.location for f in baked)


def test_gemma2_sliding_window_cache_is_found_by_default() -> None:
    """Issue 29 item 3 on the reported model: a tiny transformers 5 Gemma2 (sliding-window cache,
    built from a config, no download) with the default check_capturable(fn, *args): no steps=,
    no advance=. Its cache counts its own length, so two plain calls differ."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the cache counting its own length is transformers 5 behaviour")
    from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)), cache=cache, use_cache=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, cache=cache, use_cache=True).logits

    rep = check_capturable(step, torch.zeros(1, 1, dtype=torch.long))
    assert any(f.level == "baked" for f in rep.findings), rep.format()


def test_baked_value_check_leaves_eager_cond_working() -> None:
    """The baked-value log runs torch.cond under a dispatch mode; torch then caches a Dynamo skip
    on cond's wrapper (pytorch#163013) and every later eager torch.cond failed with Unsupported
    (a GraphRunner's warm-up after a check_capturable of the same step)."""
    import accel_graph

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))

    x = torch.ones(3)
    assert accel_graph.check_capturable(step, x).ok
    torch.testing.assert_close(step(x), x * 2)       # eager torch.cond still compiles
    torch.testing.assert_close(step(-x), -x - 1)
