"""GraphRunner for real model code: per-bucket state, fallback that keeps it, bucket_for, lazy
capture and the capture-time budget (issue 17 items 1, 2 and 4)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from accel_graph import ConfigError, GraphRunner

T = 6  # cache length


@dataclass
class Cache:
    """A stand-in for a static KV cache: one row per batch row, written at a position."""

    kv: torch.Tensor

    @classmethod
    def of(cls, rows: int, device: str = "cpu") -> Cache:
        return cls(torch.zeros(rows, T, device=device))


def step(tok: torch.Tensor, pos: torch.Tensor, *, state: Cache) -> torch.Tensor:
    """Write each row's token at ``pos`` into the cache, return what the row has seen."""
    state.kv.index_copy_(1, pos, tok.unsqueeze(1).to(state.kv.dtype))
    return state.kv.sum(1)


def illegal_at_4(tok: torch.Tensor, pos: torch.Tensor, *, state: Cache) -> torch.Tensor:
    """``step``, but bucket 4's capture is refused (a host read), so bucket 4 falls back."""
    out = step(tok, pos, state=state)
    if tok.shape[0] == 4:
        out = out * (tok.sum() * 0 + 1).item()
    return out


def make(fn=step, **kw) -> GraphRunner:
    example = (torch.zeros(1), torch.zeros(1, dtype=torch.int64))
    kw.setdefault("buckets", [1, 2, 4])
    kw.setdefault("progress", False)
    kw.setdefault("state", Cache.of)
    return GraphRunner(fn, example, batch_dim=(0, None), **kw)


def decode(runner: GraphRunner, rows: int, steps: int = 3) -> list[torch.Tensor]:
    """Prefill the bucket's cache eagerly (as a server does), then decode ``steps`` steps."""
    bucket = runner.bucket_for(rows)
    cache = runner.state(bucket)
    cache.kv.zero_()
    cache.kv[:rows, 0] = torch.arange(1, rows + 1, dtype=torch.float32)  # the "prefill"
    outs = []
    for i in range(1, steps + 1):
        tok = torch.full((rows,), float(10 * i)) + torch.arange(rows)
        outs.append(runner(tok, torch.tensor([i])).clone())
    return outs


def expected(rows: int, steps: int = 3) -> list[torch.Tensor]:
    cache = Cache.of(rows)
    cache.kv[:, 0] = torch.arange(1, rows + 1, dtype=torch.float32)
    outs = []
    for i in range(1, steps + 1):
        tok = torch.full((rows,), float(10 * i)) + torch.arange(rows)
        outs.append(step(tok, torch.tensor([i]), state=cache))
    return outs


def test_state_is_built_per_bucket_and_passed_to_fn() -> None:
    r = make().capture()
    states = [r.state(b) for b in (1, 2, 4)]
    assert [s.kv.shape[0] for s in states] == [1, 2, 4]
    assert r.state(4) is states[2]  # built once, kept
    for rows in (1, 3, 4):
        for got, want in zip(decode(r, rows), expected(rows)):
            torch.testing.assert_close(got, want)
    assert r.stats()["eager_calls"] == 0


def test_fallback_runs_at_the_padded_shape_with_the_buckets_state() -> None:
    """Bucket 4 cannot capture; a batch of 3 prefilled into bucket 4's cache must still decode
    from that cache (the silent wrong result of issue 17: the fallback used to run at the live
    size and never saw the bucket's state)."""
    r = make(illegal_at_4).capture()
    assert r.captured_buckets == [1, 2]
    assert r.bucket_for(3) == 4
    for got, want in zip(decode(r, 3), expected(3)):
        torch.testing.assert_close(got, want)
    assert r.stats()["eager_calls"] == 3


def test_live_fallback_is_an_option_and_uses_state_of_the_live_size() -> None:
    r = make(illegal_at_4, fallback="live").capture()
    tok, pos = torch.ones(3), torch.tensor([1])
    r(tok, pos)
    # The live call got a state of its own size, not bucket 4's.
    assert r.state(4).kv.abs().sum() == 0
    assert r.runtime.states.built[3].kv[:, 1].tolist() == [1.0, 1.0, 1.0]


def test_batch_above_the_ladder_runs_at_its_own_size_with_its_own_state() -> None:
    r = make().capture()
    assert r.bucket_for(5) is None
    out = r(torch.ones(5), torch.tensor([2]))
    assert out.shape == (5,)
    assert r.state(5).kv.shape == (5, T)


def test_bucket_for_and_state_refuse_bad_sizes() -> None:
    r = make(strict=True).capture()
    assert [r.bucket_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ConfigError, match="at least 1"):
        r.bucket_for(0)
    with pytest.raises(ConfigError, match="above the largest bucket.*strict"):
        r.bucket_for(5)
    with pytest.raises(ConfigError, match="not a bucket.*bucket_for\\(3\\) = 4"):
        r.state(3)
    with pytest.raises(ConfigError, match="no per-bucket state"):
        GraphRunner(lambda x: x, torch.zeros(1), buckets=[1]).state(1)


def test_state_factory_on_another_device_is_refused() -> None:
    r = make(state=lambda b: Cache.of(b, device="meta"))
    with pytest.raises(ConfigError, match="state\\(bucket=4\\) returned tensors on meta.*runs on cpu"):
        r.capture()
    with pytest.raises(ConfigError, match="state must be a callable"):
        make(state=Cache.of(2))


def test_lazy_capture_captures_each_bucket_on_first_use_and_keeps_state_exact() -> None:
    eager_mode = make().capture()
    lazy = make(capture="lazy")  # capture() is optional
    assert lazy.stats()["captured_buckets"] == []
    for rows in (3, 1, 3):
        for got, want in zip(decode(lazy, rows), decode(eager_mode, rows)):
            torch.testing.assert_close(got, want)
        for got, want in zip(decode(lazy, rows), expected(rows)):
            torch.testing.assert_close(got, want)
    st = lazy.stats()
    assert st["capture_mode"] == "lazy"
    assert st["captured_buckets"] == [1, 4]  # bucket 2 was never used, never captured
    when = {b["bucket"]: b["captured_at_call"] for b in st["buckets"]}
    assert when == {1: 6, 2: None, 4: 0}  # two decodes of 3 calls at batch 3 came first
    assert lazy.memory_report()["buckets"][1]["status"] == "pending"
    assert st["eager_calls"] == 0


def test_lazy_warmup_does_not_apply_side_effects_twice() -> None:
    def counting(x: torch.Tensor, *, state: torch.Tensor) -> torch.Tensor:
        state.add_(1)  # a step counter: applied once per call, never by warm-up
        return x + state

    r = GraphRunner(counting, torch.zeros(1, 2), buckets=[2], state=lambda b: torch.zeros(1),
                    capture="lazy", progress=False)
    outs = [r(torch.zeros(2, 2)).clone() for _ in range(3)]
    assert [o[0, 0].item() for o in outs] == [1.0, 2.0, 3.0]
    assert r.state(2).item() == 3.0


def test_capture_time_budget_leaves_later_buckets_to_the_fallback() -> None:
    r = make(capture_time_budget=1e-9).capture()  # the first (largest) capture spends it
    rep = r.memory_report()
    assert [b["status"] for b in rep["buckets"]] == ["over_time_budget", "over_time_budget", "captured"]
    assert "capture_time_budget" in rep["buckets"][0]["reason"]
    for got, want in zip(decode(r, 1), expected(1)):  # bucket 1 serves by the padded fallback
        torch.testing.assert_close(got, want)
    with pytest.raises(ConfigError, match="capture_time_budget"):
        make(capture_time_budget=0)
    with pytest.raises(ConfigError, match="fallback must be"):
        make(fallback="padding")
    with pytest.raises(ConfigError, match="capture must be"):
        make(capture="later")
