"""Whole-step graphs for decode-only steps (issue 27, FULL_AND_PIECEWISE): rows are slots,
rows without a token change nothing, the key extent follows the longest sequence, bad steps
are refused before anything runs, and a failed replay is served eagerly."""

from __future__ import annotations

import logging

import pytest
import torch

from accel_graph.errors import ConfigError, ReplayError
from accel_graph.models import Decoder, DecoderConfig
from accel_graph.serving.executors import EagerExecutor, GraphExecutor
from accel_graph.serving.full_graphs import chunk_ladder, is_decode_only, kv_ladder, slot_ladder
from accel_graph.serving.step import Segment, StepBatch

CFG = DecoderConfig(dim=32, n_heads=2, mlp_hidden=64, max_seq=48, max_batch=4, vocab_size=97)


def filled(seed: int = 0) -> Decoder:
    """A decoder whose cache holds finite history in every slot (as after earlier steps)."""
    model = Decoder(CFG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.k_cache.normal_(generator=g)
            layer.v_cache.normal_(generator=g)
    return model


def caches(model: Decoder) -> list[torch.Tensor]:
    return [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]


def test_ladders() -> None:
    assert kv_ladder(256) == [128, 256] and kv_ladder(48) == [24, 48] and kv_ladder(20) == [20]
    assert slot_ladder(16) == [4, 8, 16] and slot_ladder(4) == [4] and slot_ladder(2) == [2]
    assert slot_ladder(20) == [4, 8, 16, 20]
    assert chunk_ladder(64) == [16, 32, 64] and chunk_ladder(16) == [16] and chunk_ladder(8) == [8]
    assert is_decode_only([Segment(0, 3, (1,), True), Segment(1, 0, (2,), False)])
    assert not is_decode_only([Segment(0, 3, (1, 2), True)])


def test_slot_decode_step_rows_not_live_change_nothing() -> None:
    model = filled()
    before = caches(model)
    tokens = torch.tensor([5, 6, 7, 8])
    positions = torch.tensor([10, 0, 30, 0])
    live = torch.tensor([True, False, True, False])
    with torch.inference_mode():
        short = model.slot_decode_step(tokens, positions, live, 32)
    for new, old in zip(caches(model), before):
        changed = (new != old).any(dim=(1, 3))  # [slot, position]
        expect = torch.zeros_like(changed)
        expect[0, 10] = expect[2, 30] = True
        assert torch.equal(changed, expect)
    # The whole cache as keys gives the same live rows (the extra keys are masked out).
    model2 = filled()
    with torch.inference_mode():
        full = model2.slot_decode_step(tokens, positions, live, CFG.max_seq)
    torch.testing.assert_close(short[live], full[live])
    # All rows live and the whole cache: exactly decode_step (the same code).
    model3, model4 = filled(), filled()
    everyone = torch.ones(4, dtype=torch.bool)
    with torch.inference_mode():
        a = model3.slot_decode_step(tokens, positions, everyone, CFG.max_seq)
        b = model4.decode_step(tokens, positions)
    assert torch.equal(a, b)


def test_slot_decode_step_input_errors() -> None:
    model = Decoder(CFG)
    t = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="live as bool"):
        model.slot_decode_step(t, t, t, 8)
    with pytest.raises(ValueError, match="kv_len"):
        model.slot_decode_step(t, t, torch.ones(2, dtype=torch.bool), 49)


@pytest.mark.parametrize("compile_mode", [None, "inductor"])
def test_decode_steps_with_gaps_equal_eager(compile_mode: str | None) -> None:
    """Slots 0 and 2 decode (slot 1 idle, slot 3 empty): the graph gives eager's tokens, writes
    only the two live (slot, position) pairs, and picks the short key extent while it can."""
    graph_model, eager_model = filled(), filled()
    options = {"replay": "compiled"} if compile_mode else None
    graph = GraphExecutor(graph_model, max_tokens=8, buckets=[8], compile=compile_mode,
                          compile_options=options)
    eager = EagerExecutor(eager_model, max_tokens=8)
    before = caches(graph_model)
    for step, (p0, p2) in enumerate([(5, 20), (6, 21), (23, 40)]):
        batch = StepBatch((Segment(2, p2, (11 + step,), True), Segment(0, p0, (3,), True)))
        assert graph.run(batch) == eager.run(batch)
    use = graph.describe()["bucket_use"]
    assert use["decode 4x24"] == 2 and use["decode 4x48"] == 1 and "8" not in use
    for new, old in zip(caches(graph_model), before):
        changed = (new != old).any(dim=(1, 3))
        expect = torch.zeros_like(changed)
        expect[0, [5, 6, 23]] = True
        expect[2, [20, 21, 40]] = True
        assert torch.equal(changed, expect)
    assert graph.describe()["eager_steps"] == 0


def test_bad_decode_steps_are_refused_before_running() -> None:
    model = filled()
    graph = GraphExecutor(model, max_tokens=8, buckets=[8], compile=None)
    before = caches(model)
    bad = [
        (StepBatch((Segment(4, 0, (1,), True),)), "slot 4 is outside"),
        (StepBatch((Segment(0, 48, (1,), True),)), "max_seq=48"),
        (StepBatch((Segment(1, 0, (1,), True), Segment(1, 2, (2,), True))), "share a slot"),
    ]
    for batch, words in bad:
        with pytest.raises(ValueError, match=words):
            graph.run(batch)
    # Step-size limits hold for decode-only steps too (they skip the flat metadata's checks).
    small = GraphExecutor(model, max_tokens=2, buckets=[2], max_segments=2, compile=None,
                          capture=False)
    four = StepBatch(tuple(Segment(s, 1, (1,), True) for s in range(4)))
    with pytest.raises(ValueError, match="1..2 segments, got 4"):
        small.run(four)
    assert graph.steps == 0 and small.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(caches(model), before))


def test_settings_errors() -> None:
    with pytest.raises(ConfigError, match=r"kv_buckets=\[16, 32\] must be ints in 1..48 that end at 48"):
        GraphExecutor(Decoder(CFG), max_tokens=8, buckets=[8], kv_buckets=[16, 32], capture=False)
    with pytest.raises(ConfigError, match=r"chunk_buckets=\[4\] must be ints in 1..8 that end at 8"):
        GraphExecutor(Decoder(CFG), max_tokens=8, buckets=[8], chunk_buckets=[4], capture=False)
    with pytest.raises(ConfigError, match=r"kv_buckets=\[24, '48'\] must be ints"):
        GraphExecutor(Decoder(CFG), max_tokens=8, kv_buckets=[24, "48"], capture=False)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="kv_buckets= sets graphs that graphs='piecewise' does not build"):
        GraphExecutor(Decoder(CFG), max_tokens=8, graphs="piecewise", kv_buckets=[48], capture=False)
    with pytest.raises(ConfigError, match="chunk_buckets= sets graphs"):
        GraphExecutor(Decoder(CFG), max_tokens=8, graphs="full_and_piecewise", chunk_buckets=[8],
                      capture=False)
    with pytest.raises(ConfigError, match="graphs='fast' must be one of"):
        GraphExecutor(Decoder(CFG), max_tokens=8, graphs="fast", capture=False)


def test_failed_decode_replay_serves_the_step_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    """A decode replay that raises (a fake failure injected into the runner call: plumbing
    only) is served eagerly through the flat path, logged once; the tokens are eager's."""
    graph_model, eager_model = filled(), filled()
    graph = GraphExecutor(graph_model, max_tokens=8, buckets=[8], compile=None)
    eager = EagerExecutor(eager_model, max_tokens=8)
    assert graph.decode is not None
    real = graph.decode.runners[24]

    class FakeFailingRunner:
        def __call__(self, *args: torch.Tensor) -> torch.Tensor:
            raise ReplayError("injected decode failure")

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    graph.decode.runners[24] = FakeFailingRunner()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        for pos in (3, 4, 5):
            batch = StepBatch((Segment(1, pos, (7,), True),))
            assert graph.run(batch) == eager.run(batch)
    assert sum("injected decode failure" in r.getMessage() for r in caplog.records) == 1
    assert graph.describe()["eager_steps"] == 3
    assert all(torch.equal(a, b) for a, b in zip(caches(graph_model), caches(eager_model)))


@pytest.mark.parametrize(("graphs", "ladders"), [("full", [1, 1, 1, 1]),
                                                   ("full_and_piecewise", [2, 1, 1])])
def test_plan_of_every_graph_in_one_pool_equals_capture(graphs: str, ladders: list[int]) -> None:
    """The executor plans every graph its mode captures into its one pool before capture
    (full: chunk graphs, then decode graphs, widest key extent first; full_and_piecewise: the
    token buckets, then decode graphs); the capture then measures the same pool (recorder)."""
    from accel_graph.runner import GraphRunner
    from accel_graph.runner.memory_plan import plan_shared_pool

    ex = GraphExecutor(Decoder(CFG), max_tokens=8, buckets=[4, 8], compile=None, capture=False,
                       graphs=graphs)
    plan = ex.plan_memory()
    assert [len(r["buckets"]) for r in plan["runners"]] == ladders
    assert plan["buckets"] == plan["runners"][0]["buckets"]
    assert ex.memory_report()["buckets"][0]["status"] != "captured"
    ex.capture()
    rep = ex.memory_report()
    assert (plan["pool_reserved_bytes"], plan["pool_peak_reserved_bytes"]) == \
        (rep["pool_reserved_bytes"], rep["pool_peak_reserved_bytes"])
    lone = GraphRunner(lambda x: x * 2, (torch.ones(2),), buckets=[2], capture="eager")
    with pytest.raises(ConfigError, match="one pool= handle"):
        plan_shared_pool([ex.runners()[0], lone])


def test_chunk_padding_writes_nothing_and_steps_split_by_segment() -> None:
    """graphs="full": a step of two prompt chunks and two decode tokens is one decode replay
    plus one replay per chunk; tokens equal eager; only the live (slot, position) pairs change,
    whatever the padding (a chunk of 5 in bucket 16 pads at the position after it; a chunk that
    ends at max_seq pads at the position before it)."""
    graph_model, eager_model = filled(), filled()
    graph = GraphExecutor(graph_model, max_tokens=16, buckets=[16], compile=None)
    eager = EagerExecutor(eager_model, max_tokens=16)
    before = caches(graph_model)
    batch = StepBatch((Segment(3, 3, (1, 2, 3, 4, 5), True), Segment(1, 9, (6,), True),
                       Segment(0, 40, tuple(range(10, 18)), False), Segment(2, 30, (7,), True)))
    assert graph.run(batch) == eager.run(batch)
    use = {k: n for k, n in graph.describe()["bucket_use"].items() if n}
    assert use == {"decode 4x48": 1, "chunk 16x24": 1, "chunk 16x48": 1}
    for new, old in zip(caches(graph_model), before):
        changed = (new != old).any(dim=(1, 3))
        expect = torch.zeros_like(changed)
        expect[3, 3:8] = expect[1, 9] = expect[2, 30] = True
        expect[0, 40:48] = True
        assert torch.equal(changed, expect)
    assert graph.describe()["eager_steps"] == 0


def test_padded_chunk_ending_at_an_extent_reads_that_extent() -> None:
    """An 8-token chunk at positions 16..23 (bucket 16, so padded) needs keys 0..23: the 24-key
    graph serves it (its padding, at position 24, writes back and is not read)."""
    graph_model, eager_model = filled(), filled()
    graph = GraphExecutor(graph_model, max_tokens=16, buckets=[16], compile=None)
    eager = EagerExecutor(eager_model, max_tokens=16)
    batch = StepBatch((Segment(2, 16, tuple(range(30, 38)), True),))
    assert graph.run(batch) == eager.run(batch)
    use = {k: n for k, n in graph.describe()["bucket_use"].items() if n}
    assert use == {"chunk 16x24": 1}
    for new, old in zip(caches(graph_model), caches(eager_model)):
        torch.testing.assert_close(new, old)


def test_chunk_that_fills_its_row_is_served_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    """A 48-token prompt from position 0 with max_seq 48 in chunk bucket 64: no position is
    free for the padding, so the step is served eagerly (logged once), with eager's tokens."""
    graph_model, eager_model = filled(), filled()
    graph = GraphExecutor(graph_model, max_tokens=64, buckets=[64], compile=None)
    eager = EagerExecutor(eager_model, max_tokens=64)
    batch = StepBatch((Segment(1, 0, tuple(range(1, 49)), True),))
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        assert graph.run(batch) == eager.run(batch)
        assert graph.run(batch) == eager.run(batch)
    assert sum("no chunk graph can pad it" in r.getMessage() for r in caplog.records) == 1
    assert graph.describe()["eager_steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(caches(graph_model), caches(eager_model)))


def test_slot_chunk_step_matches_flat_forward() -> None:
    """Decoder.slot_chunk_step (the chunk graph's code) against flat_forward (the eager path)
    on the same chunk: the same logits (to fp32 rounding) and the same cache rows written."""
    a, b = filled(), filled()
    toks, start = list(range(20, 27)), 11
    meta = b.flat_metadata(16)
    meta.fill([2], [start], [toks], [True])
    with torch.inference_mode():
        ref = b.flat_forward(meta.tok_id[:7], meta.tok_pos[:7], meta.sample_rows[:1], meta)
        pad = 16 - len(toks)
        out = a.slot_chunk_step(
            torch.tensor(toks + [0] * pad), torch.tensor(list(range(start, start + 7)) + [18] * pad),
            torch.tensor([2]), torch.tensor([True] * 7 + [False] * pad), torch.tensor([6]), 24)
    torch.testing.assert_close(out, ref)
    for x, y in zip(caches(a), caches(b)):
        torch.testing.assert_close(x, y)
