"""GraphRunner's live-rows check (runner/rows.py): padded rows must not change live rows.

The runner pads a batch of 3 to its bucket of 4. A step that reduces over the batch dimension
(``softmax(0)``) mixes the padded row into the live ones; replay and eager on the same padded
inputs agree with each other, so only a comparison with ``fn`` on the live rows alone sees it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from accel_graph import CaptureError, GraphRunner
from accel_graph.models import Decoder, DecoderConfig, greedy_generate

torch.manual_seed(0)
LINEAR = nn.Linear(16, 16).requires_grad_(False)


def mixing(x: torch.Tensor) -> torch.Tensor:
    """The reviewer's repro: a softmax over the batch dimension."""
    return LINEAR(x).softmax(0)


def runner_for(fn, example=None, **kw) -> GraphRunner:
    kw.setdefault("buckets", [4])
    kw.setdefault("progress", False)
    example = torch.zeros(1, 16) if example is None else example
    return GraphRunner(fn, (example,), **kw).capture()


def test_batch_mixing_fn_falls_back_with_the_reason_and_returns_eager(caplog) -> None:
    r = runner_for(mixing)
    x = torch.randn(3, 16)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        out = r(x)
    torch.testing.assert_close(out, mixing(x))  # eager on the live rows, not the padded mix
    rep = r.memory_report()["buckets"][0]
    assert rep["status"] == "disabled"
    for words in ("mixes rows across the batch dimension", "bucket 4", "result",
                  "max abs difference", "row-independent", "rows_independent=True"):
        assert words in rep["reason"], words
    assert "mixes rows" in caplog.text
    # Later calls of the bucket run eagerly on their live rows (not padded: padding is the bug).
    y = torch.randn(2, 16)
    torch.testing.assert_close(r(y), mixing(y))
    torch.testing.assert_close(r(x), mixing(x))
    st = r.stats()
    assert st["graph_calls"] == 0 and st["eager_calls"] == 3
    assert "mixes rows" in st["eager_fallbacks"][0]["reason"]


def test_the_mixing_output_is_named() -> None:
    r = runner_for(lambda x: (LINEAR(x), x - x.mean(0)))
    x = torch.randn(3, 16)
    a, b = r(x)
    torch.testing.assert_close(b, x - x.mean(0))
    reason = r.memory_report()["buckets"][0]["reason"]
    assert "result[1]" in reason and "result[0]" not in reason


def test_strict_raises_on_a_mixing_fn() -> None:
    r = runner_for(mixing, strict=True)
    with pytest.raises(CaptureError, match="mixes rows across the batch dimension"):
        r(torch.randn(3, 16))


def test_mixing_found_on_the_first_padded_call_after_full_ones() -> None:
    r = runner_for(mixing)  # verify=2: replays 1 and 2 are checked, both full here
    for _ in range(3):
        x = torch.randn(4, 16)
        torch.testing.assert_close(r(x), mixing(x))  # a full bucket has no padding: right
    bucket = r.runtime.bucket(4)
    assert bucket.checks == 2 and bucket.ready  # full batches: the hot path
    rt = r.runtime
    assert rt.route[4] is bucket and rt.route[3] is None  # padded ones wait for the check
    x = torch.randn(3, 16)
    torch.testing.assert_close(r(x), mixing(x))
    assert bucket.status == "disabled" and bucket.mixes_rows


def test_side_effects_are_applied_once() -> None:
    counter = torch.zeros(1)

    def step(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x.softmax(0) + counter

    r = runner_for(step)
    counter.zero_()
    x = torch.randn(3, 16)
    out = r(x)  # live run, padded eager, replay: one increment kept (the live run's)
    assert counter.item() == 1.0
    torch.testing.assert_close(out, x.softmax(0) + 1)
    r(x)
    assert counter.item() == 2.0


def test_row_independent_linear_is_not_disabled() -> None:
    r = runner_for(LINEAR, buckets=[1, 2, 4, 8])
    for n in (3, 5, 7, 6, 3, 5):
        x = torch.randn(n, 16)
        torch.testing.assert_close(r(x), LINEAR(x))
    for size in (4, 8):
        b = r.runtime.bucket(size)
        assert b.status == "captured" and b.rows_checked and b.ready, (size, b.reason)
        assert all(r.runtime.route[n] is b for n in range(size // 2 + 1, size + 1))  # all hot
    assert r.stats()["eager_calls"] == 0


def test_conv_net_without_batch_norm_at_batch_3_in_bucket_4() -> None:
    gen = torch.Generator().manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).requires_grad_(False)
    r = runner_for(net, example=torch.zeros(1, 3, 16, 16))
    x = torch.randn(3, 3, 16, 16, generator=gen)
    torch.testing.assert_close(r(x), net(x))
    b = r.runtime.bucket(4)
    assert b.status == "captured" and b.rows_checked, b.reason


def test_decoder_step_without_state_is_not_disabled() -> None:
    model = Decoder(DecoderConfig(max_batch=4, n_layers=1, max_seq=32))
    ex = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(model.decode_step, ex, buckets=[1, 2, 4], progress=False).capture()
    prompt = torch.randint(0, 512, (3, 3), generator=torch.Generator().manual_seed(0))
    eager = greedy_generate(model, prompt, 6)
    graph = greedy_generate(model, prompt, 6, step=runner)
    assert torch.equal(eager, graph)  # the live run's cache writes were undone
    b = runner.runtime.bucket(4)
    assert b.status == "captured" and b.rows_checked and b.ready, b.reason


def test_decoder_step_with_state_skips_the_check() -> None:
    # One decoder (its own KV cache) per bucket, as a server keeps one cache per bucket: fn
    # cannot be rerun at the live size without another state object, so no live run happens.
    cfg = DecoderConfig(max_batch=4, n_layers=1, max_seq=32)
    calls: list[int] = []

    def step(tokens: torch.Tensor, positions: torch.Tensor, *, state: Decoder) -> torch.Tensor:
        calls.append(tokens.shape[0])
        return state.decode_step(tokens, positions)

    ex = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(step, ex, buckets=[4], state=lambda b: Decoder(cfg),
                         progress=False).capture()
    calls.clear()
    tok = torch.tensor([5, 6, 7])
    out = runner(tok, torch.zeros(3, dtype=torch.int64))
    assert calls == [4]  # the padded eager run only: no run on the 3 live rows
    b = runner.runtime.bucket(4)
    assert b.status == "captured"
    runner(tok, torch.ones(3, dtype=torch.int64))
    assert b.ready and runner.runtime.route[3] is b  # verify=2 done: the hot path
    ref = Decoder(cfg)
    torch.testing.assert_close(out, ref.decode_step(tok, torch.zeros(3, dtype=torch.int64)))


def test_verify_false_serves_the_padded_replay() -> None:
    # The documented risk: without verification nothing is checked, so the mix is served.
    r = runner_for(mixing, verify=False)
    x = torch.randn(3, 16)
    out = r(x)
    assert r.stats()["graph_calls"] == 1
    assert (out - mixing(x)).abs().max() > 1e-3


def test_verify_lowered_to_zero_after_capture_releases_padded_routes() -> None:
    r = runner_for(LINEAR)
    assert r.runtime.route[3] is None  # the live-rows check is pending
    r.verify = 0
    x = torch.randn(3, 16)
    torch.testing.assert_close(r(x), LINEAR(x))
    assert r.runtime.route[3] is r.runtime.bucket(4) and r.stats()["graph_calls"] == 1


def test_rows_independent_skips_the_check() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return LINEAR(x)

    r = runner_for(fn, rows_independent=True)
    calls.clear()
    x = torch.randn(3, 16)
    torch.testing.assert_close(r(x), LINEAR(x))
    assert calls == [4]  # no run on the live rows
    assert r.runtime.route[3] is r.runtime.bucket(4)  # nothing pending for padded sizes


def test_bucket_no_batch_is_padded_into_is_not_held_back() -> None:
    r = runner_for(mixing, buckets=[3, 4])  # bucket 4 serves only batches of 4
    for _ in range(2):
        x = torch.randn(4, 16)
        torch.testing.assert_close(r(x), mixing(x))
    assert r.runtime.bucket(4).ready


def test_fn_failing_at_the_live_size_keeps_the_bucket(caplog) -> None:
    def only_even(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2:
            raise ValueError("batch must be even")
        return LINEAR(x)

    r = runner_for(only_even)
    x = torch.randn(3, 16)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        out = r(x)
    torch.testing.assert_close(out, LINEAR(x))
    b = r.runtime.bucket(4)
    assert b.status == "captured"
    assert "raised on the 3 live rows alone" in caplog.text and "batch must be even" in caplog.text
