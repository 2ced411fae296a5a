"""The continuous-batching engine and its scheduler, on a FAKE executor (plumbing only: the
tokens are a hash of each request's sequence as the executor's slot cache holds it, so they
come out right only if every chunk and decode token lands at the right slot and position).
Real-model token equality is in tests/test_serving_engine_models.py."""

from __future__ import annotations

import logging
import random

import pytest
from serving_engine_fakes import FailingFakeExecutor, FakeStepExecutor, fake_reference

from accel_graph.errors import ConfigError
from accel_graph.serving.engine import Engine
from accel_graph.serving.metrics import percentile, summarize
from accel_graph.serving.requests import InvalidRequest, QueueFull, Request, RequestResult


def _stream(n: int, seed: int = 0, vocab: int = 97, max_prompt: int = 30, max_new: int = 12,
            eos: int | None = None) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))],
                    rng.randint(1, max_new), eos, arrival=0.0) for _ in range(n)]


def _check_tokens(reqs: list[Request], results: list[RequestResult], vocab: int = 97) -> None:
    for req, res in zip(reqs, results):
        want = fake_reference(req.prompt, req.max_new_tokens, req.eos_id, vocab)
        assert res.tokens == want, (req, res)
        assert res.finish_reason == ("eos" if want[-1] == req.eos_id else "length")
        assert len(res.token_times) == len(res.tokens)


def test_tokens_equal_alone_with_chunking_slot_reuse_and_eos() -> None:
    ex = FakeStepExecutor(num_slots=3, max_tokens=8, max_segments=4)
    # eos 5 on a 97-token vocabulary: some requests stop early, most on length.
    reqs = _stream(14, eos=5)
    run = Engine(ex).run(reqs)
    _check_tokens(reqs, run.results)
    assert any(len(r.prompt) > 8 for r in reqs)  # chunked prefill happened
    assert run.stats["steps"] == len(ex.batches)
    # More requests than slots: slots were reused, never two live requests on one slot.
    assert {s.slot for b in ex.batches for s in b.segments} == {0, 1, 2}


def test_policy_budget_segments_decode_first() -> None:
    ex = FakeStepExecutor(num_slots=4, max_tokens=16, max_segments=4)
    eng = Engine(ex, token_budget=6, max_segments=3)
    # The first prompt token names the request, so the test can tell decode from prefill.
    reqs = [Request([i, *r.prompt], r.max_new_tokens) for i, r in enumerate(_stream(8, seed=3))]
    for r in reqs:
        eng.submit(r)
    while eng.has_work():
        eng.step()
    prompt_len: dict[int, int] = {}  # slot -> its current request's prompt length
    for b in ex.batches:
        assert b.num_tokens <= 6 and len(b.segments) <= 3
        kinds = []
        for s in b.segments:
            if s.start == 0:
                prompt_len[s.slot] = len(reqs[s.tokens[0]].prompt)
            decode = s.start >= prompt_len[s.slot]
            kinds.append("decode" if decode else "prefill")
            if decode:
                assert len(s.tokens) == 1 and s.sample
            else:  # a chunk is sampled exactly when it ends the prompt
                assert s.sample == (s.start + len(s.tokens) == prompt_len[s.slot])
        assert kinds == sorted(kinds)  # every decode token before any prefill chunk
    _check_tokens(reqs, [])  # (tokens are checked in the other tests)


def test_decode_is_never_starved_by_prefill() -> None:
    ex = FakeStepExecutor(num_slots=2, max_tokens=4, max_segments=2)
    eng = Engine(ex)
    first = eng.submit(Request([1, 2], 10))
    eng.step()  # prefills request 0, samples its first token
    eng.submit(Request(list(range(40)), 2))
    before = len(first.tokens) if first.tokens else 0
    for _ in range(5):  # while the long prompt is chunked in, request 0 decodes every step
        eng.step()
        assert first.finish_reason is None
    assert len(first.token_times) == before + 6
    assert all(b.segments[0].slot == 0 and len(b.segments[0].tokens) == 1 for b in ex.batches[1:6])


def test_bad_input_rejected_others_served() -> None:
    ex = FakeStepExecutor(num_slots=2, max_seq=32, vocab_size=97)
    good = _stream(4, seed=1, max_prompt=10, max_new=5)
    bad = [Request([], 3), Request([1, 2], 0), Request(list(range(33)), 1),
           Request(list(range(30)), 5), Request([1, 200], 2), Request([1, 2], True)]
    reqs = [good[0], *bad[:3], good[1], *bad[3:], good[2], good[3]]
    run = Engine(ex).run(reqs)
    res = {id(r): x for r, x in zip(reqs, run.results)}
    _check_tokens(good, [res[id(r)] for r in good])
    reasons = [res[id(r)] for r in bad]
    assert all(x.finish_reason == "rejected" and not x.tokens for x in reasons)
    assert "empty" in reasons[0].error
    assert "max_new_tokens" in reasons[1].error and ">= 1" in reasons[1].error
    assert "longer than the engine's maximum 32" in reasons[2].error
    assert "at most 3 new tokens" in reasons[3].error
    assert "outside the vocabulary" in reasons[4].error
    assert "max_new_tokens" in reasons[5].error
    with pytest.raises(InvalidRequest, match="empty"):
        Engine(ex).submit(Request([], 3))
    s = summarize(run.results, run.elapsed_s)
    assert s["served"] == 4 and s["rejected"] == 6 and s["failed"] == 0


def test_engine_maximum_prompt() -> None:
    eng = Engine(FakeStepExecutor(max_seq=64), max_prompt=10)
    with pytest.raises(InvalidRequest, match="engine's maximum 10"):
        eng.submit(Request(list(range(11)), 1))
    with pytest.raises(ConfigError, match="exceeds the executor's limit"):
        Engine(FakeStepExecutor(max_tokens=16), token_budget=17)
    with pytest.raises(ConfigError, match="max_queue"):
        Engine(FakeStepExecutor(), max_queue=0)


def test_queue_full_is_back_pressure_and_nothing_is_lost() -> None:
    ex = FakeStepExecutor(num_slots=1)
    eng = Engine(ex, max_queue=2)
    reqs = _stream(5, seed=2)
    handles = [eng.submit(reqs[0]), eng.submit(reqs[1])]
    with pytest.raises(QueueFull, match="retry after a step"):
        eng.submit(reqs[2])
    assert eng.queued == 2
    eng.step()  # admits request 0: the queue has room again
    handles.append(eng.submit(reqs[2]))
    while eng.has_work():
        eng.step()
    _check_tokens(reqs[:3], handles)
    # The simulated client retries on QueueFull: every request is served.
    ex2 = FakeStepExecutor(num_slots=1)
    run = Engine(ex2, max_queue=1).run(reqs)
    _check_tokens(reqs, run.results)


def test_failing_graph_step_served_eagerly_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    inner = FakeStepExecutor(num_slots=3, max_tokens=8)
    failing = FailingFakeExecutor(inner, fail_steps={0, 3, 4, 9})
    eng = Engine(failing, fallback=inner)  # the fallback shares the cache, as eager does
    reqs = _stream(8, seed=4)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        run = eng.run(reqs)
    _check_tokens(reqs, run.results)
    assert run.stats["fallback_steps"] == 4 == eng.fallback_steps
    warnings = [r for r in caplog.records if "graph path" in r.getMessage()]
    assert len(warnings) == 1 and "fake graph failure at step 0" in warnings[0].getMessage()


def test_failing_step_without_fallback_ends_its_requests_only() -> None:
    inner = FakeStepExecutor(num_slots=4, max_tokens=64, max_segments=4)
    eng = Engine(FailingFakeExecutor(inner, fail_steps={1}))
    reqs = _stream(6, seed=5, max_new=8)
    a = [eng.submit(r) for r in reqs[:2]]
    eng.step()  # step 0: requests 0 and 1 prefill
    b = [eng.submit(r) for r in reqs[2:]]
    eng.step()  # step 1 fails: requests 0, 1 (decode) and 2, 3 (admitted) end with "error"
    while eng.has_work():
        eng.step()
    failed = [r for r in a + b if r.finish_reason == "error"]
    assert len(failed) == 4 and all("fake graph failure at step 1" in r.error for r in failed)
    _check_tokens(reqs[4:], b[2:])
    # The failed requests' slots were freed and reused by the later ones.
    assert eng.failed_steps == 1 and not eng.has_work()


def test_fallback_failing_too_ends_the_step_requests() -> None:
    inner = FakeStepExecutor()
    eng = Engine(FailingFakeExecutor(inner), fallback=FailingFakeExecutor(inner))
    run = eng.run(_stream(3, seed=6))
    assert all(r.finish_reason == "error" and "fallback failed too" in r.error for r in run.results)


def test_wrong_token_count_is_an_executor_failure() -> None:
    class Short(FakeStepExecutor):
        def run(self, batch):  # noqa: ANN001, ANN202
            return super().run(batch)[:-1]

    inner = FakeStepExecutor()
    run = Engine(Short(), fallback=inner).run(_stream(2, seed=7))
    assert all(r.finish_reason == "length" for r in run.results)


def test_arrivals_follow_the_wall_clock() -> None:
    ex = FakeStepExecutor()
    reqs = [Request([1, 2, 3], 2, arrival=0.0), Request([4, 5], 2, arrival=0.05)]
    run = Engine(ex).run(reqs)
    late = run.results[1]
    assert late.arrival == pytest.approx(0.05)
    assert late.token_times[0] >= 0.05  # not served before it arrived
    assert run.results[0].ttft is not None and run.results[0].ttft >= 0


def test_metrics() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    r = RequestResult(0, tokens=[1, 2, 3], finish_reason="length", arrival=1.0,
                      token_times=[1.5, 1.7, 2.1])
    assert r.ttft == pytest.approx(0.5) and r.tpot == pytest.approx(0.3)
    s = summarize([r], 2.0)
    assert s["tokens_per_s"] == 1.5 and s["ttft_ms_p50"] == pytest.approx(500)
