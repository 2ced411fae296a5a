"""Executors of the serving engine (issue 27): a request's greedy tokens served in mixed flat
steps (prefill chunks of some requests beside decode tokens of others) equal those of the model
run alone on that request, eagerly and from token-bucketed graphs (interpreted and compiled)."""

from __future__ import annotations

import logging

import pytest
import torch

from accel_graph.errors import ConfigError
from accel_graph.models import Decoder, DecoderConfig, greedy_generate
from accel_graph.serving.executors import GRAPH_MODES, EagerExecutor, GraphExecutor, token_ladder
from accel_graph.serving.step import Segment, StepBatch, StepExecutor

CFG = DecoderConfig(dim=32, n_heads=2, mlp_hidden=64, max_seq=48, max_batch=4, vocab_size=97)
NEW = 5
#: slot -> prompt; lengths chosen so chunks of 4 give steps mixing prefill and decode.
PROMPTS = {0: [5, 7, 9, 11, 3, 2, 8], 1: [1, 2], 3: [4, 4, 4, 4, 4, 4, 4, 4, 4, 6, 1]}


def reference() -> dict[int, list[int]]:
    """Each request alone through ``decode_step`` (one token at a time): the ground truth."""
    model = Decoder(CFG)
    return {s: greedy_generate(model, torch.tensor([p]), NEW)[0, len(p):].tolist()
            for s, p in PROMPTS.items()}


def serve(ex: StepExecutor, chunk: int = 4, order: int = 1) -> tuple[dict[int, list[int]], list[int]]:
    """Continuous batching in miniature: every step feeds each unfinished request its next
    prompt chunk (at most ``chunk`` tokens) or its decode token; ``order`` -1 reverses the
    segments. Returns the generated tokens per slot and the step sizes."""
    gen: dict[int, list[int]] = {s: [] for s in PROMPTS}
    seqs = {s: list(p) for s, p in PROMPTS.items()}
    cached = dict.fromkeys(PROMPTS, 0)
    sizes = []
    while True:
        segs = []
        for s in list(PROMPTS)[::order]:
            if len(gen[s]) >= NEW:
                continue
            todo = tuple(seqs[s][cached[s]:cached[s] + chunk])
            segs.append(Segment(s, cached[s], todo, cached[s] + len(todo) == len(seqs[s])))
        if not segs:
            return gen, sizes
        batch = StepBatch(tuple(segs))
        sizes.append(batch.num_tokens)
        out = ex.run(batch)
        assert len(out) == batch.num_samples
        it = iter(out)
        for sg in segs:
            cached[sg.slot] += len(sg.tokens)
            if sg.sample:
                tok = next(it)
                gen[sg.slot].append(tok)
                seqs[sg.slot].append(tok)


@pytest.fixture(scope="module")
def ref() -> dict[int, list[int]]:
    return reference()


@pytest.mark.parametrize("order", [1, -1])
def test_eager_mixed_steps_equal_each_request_alone(ref: dict[int, list[int]], order: int) -> None:
    ex = EagerExecutor(Decoder(CFG), max_tokens=16)
    assert isinstance(ex, StepExecutor)
    gen, sizes = serve(ex, order=order)
    assert gen == ref
    assert max(sizes) > 4 and min(sizes) < 4  # both prefill-heavy and decode-only steps ran


@pytest.mark.parametrize(("compile_mode", "graphs"),
                         [(None, "piecewise"), (None, "full_and_piecewise"), (None, "full"),
                          ("inductor", "piecewise"), ("inductor", "full")])
def test_graph_mixed_steps_equal_each_request_alone(ref: dict[int, list[int]],
                                                    compile_mode: str | None,
                                                    graphs: str) -> None:
    options = {"replay": "compiled"} if compile_mode else None
    ex = GraphExecutor(Decoder(CFG), max_tokens=16, buckets=[4, 16], compile=compile_mode,
                       compile_options=options, graphs=graphs)
    gen, _ = serve(ex)
    assert gen == ref
    facts = ex.describe()
    assert facts["kind"] == "graph" and facts["graphs"] == graphs
    assert facts["buckets"] == (None if graphs == "full" else [4, 16])
    assert facts["eager_steps"] == 0 and facts["eager_fallbacks"] == []
    use = facts["bucket_use"]
    flat = use.get("4", 0) + use.get("16", 0)
    decode = sum(n for b, n in use.items() if b.startswith("decode"))
    chunk = sum(n for b, n in use.items() if b.startswith("chunk"))
    if graphs == "piecewise":
        assert use["4"] > 0 and use["16"] > 0 and decode == chunk == 0
        assert flat == facts["steps"] and facts["whole_step_graphs"] is None
    elif graphs == "full_and_piecewise":  # decode-only steps whole, mixed ones token buckets
        assert decode > 0 and use["16"] > 0 and chunk == 0
        assert flat + decode == facts["steps"]
        assert facts["whole_step_graphs"] == {"decode": {"kv_buckets": [24, 48], "buckets": [4]}}
    else:  # every step in parts: a decode graph for its one-token segments, one per chunk
        assert flat == 0 and decode > 0 and chunk >= facts["steps"] - decode
        assert facts["whole_step_graphs"]["chunk"] == {"kv_buckets": [24, 48], "buckets": [16]}
        assert ex.runners()[0] is not ex.runner and not ex.runner.captured_buckets
        assert "4" not in use and facts["captured_buckets"] is None
    assert facts["pool_bytes"] and facts["compile"] == compile_mode


def test_graph_and_eager_share_a_model_and_cache() -> None:
    """Same model, both executors in turn on one request stream: identical cache writes (the
    graph path runs the same code), and padded tokens write nowhere."""
    model = Decoder(CFG)
    eager = EagerExecutor(model, max_tokens=16)
    graph = GraphExecutor(model, max_tokens=16, buckets=[16], compile=None, graphs="piecewise")
    before = [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
    batch = StepBatch((Segment(2, 0, (3, 4, 5), True), Segment(0, 0, (9,), True)))
    a = graph.run(batch)  # 4 live tokens padded to 16
    after_graph = [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
    b = eager.run(batch)
    after_eager = [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
    assert a == b
    for g, e, old in zip(after_graph, after_eager, before):
        assert torch.equal(g, e)  # interpreted replay at the live lengths: bitwise
        changed = (g != old).any(dim=(1, 3))  # [slot, position]
        expect = torch.zeros_like(changed)
        expect[2, 0:3] = True
        expect[0, 0] = True
        assert torch.equal(changed, expect)  # only the live tokens' (slot, position)


@pytest.mark.parametrize("graphs", GRAPH_MODES)
def test_capture_touches_no_cache(graphs: str) -> None:
    model = Decoder(CFG)
    GraphExecutor(model, max_tokens=8, buckets=[8], compile=None, graphs=graphs)
    for layer in model.layers:
        assert torch.count_nonzero(layer.k_cache) == 0 and torch.count_nonzero(layer.v_cache) == 0


def test_bad_steps_are_refused_and_lose_nothing(ref: dict[int, list[int]]) -> None:
    ex = EagerExecutor(Decoder(CFG), max_tokens=8, max_segments=3)
    bad = [
        (StepBatch((Segment(4, 0, (1,), True),)), "slot 4 is outside"),
        (StepBatch((Segment(0, 47, (1, 2), True),)), "max_seq=48"),
        (StepBatch((Segment(0, 0, tuple(range(9)), True),)), "max_tokens=8"),
        (StepBatch((Segment(0, 0, (1,), True), Segment(0, 1, (2,), True))), "share a slot"),
        (StepBatch(tuple(Segment(s, 0, (1,), True) for s in range(4))), "1..3 segments"),
        (StepBatch((Segment(0, 0, (), True),)), "length >= 1"),
        (StepBatch(()), "at least one segment"),
    ]
    for batch, words in bad:
        with pytest.raises(ValueError, match=words):
            ex.run(batch)
    assert ex.steps == 0
    # The executor still serves correctly afterwards.
    ex2 = EagerExecutor(Decoder(CFG), max_tokens=16)
    for batch, _ in bad[:2]:
        with pytest.raises(ValueError):
            ex2.run(batch)
    assert serve(ex2)[0] == ref


def test_settings_errors() -> None:
    model = Decoder(CFG)
    with pytest.raises(ConfigError, match="must end at max_tokens"):
        GraphExecutor(model, max_tokens=16, buckets=[4, 8], capture=False)
    with pytest.raises(ConfigError, match="max_segments"):
        EagerExecutor(model, max_segments=5)
    with pytest.raises(ConfigError, match="Decoder"):
        EagerExecutor(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    assert token_ladder(64) == [4, 8, 16, 32, 64] and token_ladder(20) == [4, 8, 16, 20]
    assert token_ladder(4) == [4] and token_ladder(3) == [3]


def test_from_config_sizes_slots() -> None:
    ex = EagerExecutor.from_config(CFG, num_slots=2, max_tokens=8)
    assert ex.num_slots == 2 and ex.max_seq == CFG.max_seq and ex.max_segments == 2
    # Same weights whatever the slot count.
    assert torch.equal(ex.model.lm_head, Decoder(CFG).lm_head)
    g = GraphExecutor.from_config(CFG, num_slots=2, max_tokens=8, buckets=[8], compile=None)
    assert g.memory_report()["pool_reserved_bytes"] > 0


def test_failed_replay_serves_the_step_eagerly(ref: dict[int, list[int]],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A replay that raises (here: a fake failure injected into the runner call, plumbing only)
    is served eagerly, logged once, and loses no request."""
    from accel_graph.errors import ReplayError

    ex = GraphExecutor(Decoder(CFG), max_tokens=16, buckets=[16], compile=None, graphs="piecewise")
    real = ex.runner
    calls = {"n": 0}

    class FakeFailingRunner:
        def __call__(self, *args: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] in (2, 3):
                raise ReplayError("injected failure")
            return real(*args)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    ex.runner = FakeFailingRunner()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        gen, _ = serve(ex)
    assert gen == ref
    assert sum("injected failure" in r.getMessage() for r in caplog.records) == 1
    assert ex.describe()["eager_steps"] == 2


def test_moe_decoder_flat_steps_equal_each_request_alone() -> None:
    """The mixture-of-experts decoder (its experts loop is an island too) through both
    executors: islands of two kinds in one graph."""
    import dataclasses

    moe = dataclasses.replace(CFG, num_experts=4, top_k=2)
    model = Decoder(moe)
    ref = {s: greedy_generate(model, torch.tensor([p]), NEW)[0, len(p):].tolist()
           for s, p in PROMPTS.items()}
    assert serve(EagerExecutor(Decoder(moe), max_tokens=16))[0] == ref
    for graphs in ("piecewise", "full"):
        graph = GraphExecutor(Decoder(moe), max_tokens=16, buckets=[16], compile=None,
                              graphs=graphs)
        assert serve(graph)[0] == ref
        assert graph.describe()["eager_steps"] == 0
