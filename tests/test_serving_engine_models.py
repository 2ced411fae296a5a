"""The engine on the bundled decoder: every request's tokens equal the model run alone on that
request (greedy_generate over decode_step, a separate model with the same seed), through the
eager and the graph executor, with chunked prefill, slot reuse and a graph path that fails on
some steps (served eagerly on the same model and cache)."""

from __future__ import annotations

import logging

import pytest
import torch
from serving_engine_fakes import FailingFakeExecutor

from accel_graph.models.decoder import Decoder, greedy_generate
from accel_graph.serving.engine import Engine
from accel_graph.serving.executors import EagerExecutor, GraphExecutor, serving_config
from accel_graph.serving.workload import poisson_requests

CFG = serving_config(max_batch=3, max_seq=64)


@pytest.fixture(scope="module")
def alone() -> dict[tuple[tuple[int, ...], int], list[int]]:
    """Tokens of the model run alone, per (prompt, max_new_tokens)."""
    model = Decoder(CFG)
    cache = {}
    for r in _stream():
        out = greedy_generate(model, torch.tensor([r.prompt]), r.max_new_tokens)
        cache[(r.prompt, r.max_new_tokens)] = out[0, len(r.prompt):].tolist()
    return cache


def _stream():  # noqa: ANN202
    # Prompts up to 30 tokens with a 16-token step: chunked prefill; 8 requests on 3 slots.
    return poisson_requests(8, float("inf"), (1, 30), (1, 10), vocab_size=CFG.vocab_size, seed=11)


def _check(run, alone) -> None:  # noqa: ANN001
    for req, res in zip(_stream(), run.results):
        assert res.finish_reason == "length"
        assert res.tokens == alone[(req.prompt, req.max_new_tokens)], req.id


def test_eager_engine_tokens_equal_model_alone(alone) -> None:  # noqa: ANN001
    ex = EagerExecutor.from_config(CFG, max_tokens=16)
    _check(Engine(ex, vocab_size=CFG.vocab_size).run(_stream()), alone)


def test_graph_engine_tokens_equal_model_alone_with_failing_steps(
        alone, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    graph = GraphExecutor.from_config(CFG, max_tokens=16, buckets=[4, 16], compile=None)
    _check(Engine(graph, token_budget=16).run(_stream()), alone)
    # A FAKE failure wrapper over the real graph executor: steps 2, 5, 6 fail before running;
    # the engine serves them on an eager executor over the same model and cache.
    failing = FailingFakeExecutor(graph, fail_steps={2, 5, 6})
    fallback = EagerExecutor(graph.model, max_tokens=16, max_segments=graph.max_segments)
    engine = Engine(failing, fallback=fallback)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        run = engine.run(_stream())
    _check(run, alone)
    assert engine.fallback_steps == 3
    assert sum("graph path" in r.getMessage() for r in caplog.records) == 1
