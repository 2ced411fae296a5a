"""The tensor-parallel decoder: sharding (one process) and, over two real gloo processes on
loopback, equality with the single-process model eagerly and replayed from a GraphRunner with
``process_group=`` (one spawned job for all of it: spawning costs seconds)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from accel_graph.errors import ConfigError
from accel_graph.models import Decoder, DecoderConfig, TPDecoder, shard_state
from accel_graph.testing.distributed import run_ranks

SMALL = DecoderConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, mlp_hidden=48, max_seq=24,
                      max_batch=4)


def test_shards_put_back_together_are_the_model() -> None:
    base = Decoder(SMALL)
    state = base.state_dict()
    shards = [shard_state(state, SMALL, r, 2) for r in range(2)]
    d, hd, h = SMALL.dim, SMALL.head_dim, SMALL.n_heads // 2
    m = SMALL.mlp_hidden // 2
    for i in range(SMALL.n_layers):
        key = f"layers.{i}."
        # wqkv: per rank [3, h, hd, d]; stacking the ranks' heads gives the full [3, H, hd, d].
        qkv = torch.cat([s[key + "wqkv"].view(3, h, hd, d) for s in shards], dim=1)
        assert torch.equal(qkv.reshape(3 * d, d), state[key + "wqkv"])
        assert torch.equal(torch.cat([s[key + "wo"] for s in shards], dim=1), state[key + "wo"])
        gate_up = torch.cat([s[key + "w_gate_up"].view(2, m, d) for s in shards], dim=1)
        assert torch.equal(gate_up.reshape(2 * SMALL.mlp_hidden, d), state[key + "w_gate_up"])
        assert torch.equal(torch.cat([s[key + "w_down"] for s in shards], dim=1), state[key + "w_down"])
    for name in ("tok_emb", "lm_head", "final_norm", "layers.0.attn_norm"):
        assert torch.equal(shards[1][name], state[name])
        assert shards[1][name].data_ptr() != state[name].data_ptr()  # copies, not views


def test_bad_tp_settings_are_refused() -> None:
    base = Decoder(SMALL)
    with pytest.raises(ConfigError, match="divisible by 3"):
        shard_state(base.state_dict(), SMALL, 0, 3)
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        shard_state(base.state_dict(), SMALL, 2, 2)
    with pytest.raises(ConfigError, match="rank and world_size together"):
        TPDecoder(base, rank=0)
    with pytest.raises(ConfigError, match="collective must be one of"):
        TPDecoder(base, rank=0, world_size=2, collective="nccl")
    if not torch.distributed.is_initialized():
        with pytest.raises(ConfigError, match="init_process_group"):
            TPDecoder(base)
    tp = TPDecoder(base, rank=1, world_size=2)  # shards without a group, for inspection
    assert tp.layers[0].k_cache.shape == (SMALL.max_batch, 2, SMALL.max_seq, SMALL.head_dim)


def _tp_checks(rank: int, world: int, collective: str) -> dict[str, Any]:
    """On one rank: greedy tokens and logits of eager TP and of replayed TP vs the
    single-process model."""
    import logging

    import torch.distributed as dist

    from accel_graph import GraphRunner
    from accel_graph.foundation.tolerances import assert_close_for_dtype
    from accel_graph.models import greedy_generate

    logging.getLogger("accel_graph").setLevel(logging.ERROR)
    torch.manual_seed(0)
    base = Decoder(SMALL)
    tp = TPDecoder(base, collective=collective)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, SMALL.vocab_size, (3, 5), generator=gen)
    ref = greedy_generate(base, prompt, 10)
    out["eager_tokens_equal"] = torch.equal(greedy_generate(tp, prompt, 10), ref)
    tok, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0])
    with torch.inference_mode():
        base.reset_cache()
        tp.reset_cache()
        want = base.decode_step(tok, pos)
        got = tp.decode_step(tok, pos)
    assert_close_for_dtype(got, want, msg=f"rank {rank} eager TP logits")

    example = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(tp.decode_step, example, buckets=[1, 4], process_group=dist.group.WORLD,
                         progress=False)
    with torch.inference_mode():
        runner.capture()
    out["captured"] = runner.captured_buckets
    out["reasons"] = [b.reason for b in runner.runtime.buckets]
    out["replay_tokens_equal"] = torch.equal(greedy_generate(tp, prompt, 10, step=runner), ref)
    with torch.inference_mode():
        tp.reset_cache()
        replayed = runner(tok, pos).clone()
    assert_close_for_dtype(replayed, want, msg=f"rank {rank} replayed TP logits")
    out["eager_calls"] = runner.stats()["eager_calls"]
    out["logits"] = replayed.sum().item()

    # The functional all-reduce (the one that once replayed unreduced), batch 1 only.
    fn_tp = TPDecoder(base, collective="functional")
    fn_runner = GraphRunner(fn_tp.decode_step, example, buckets=[1],
                            process_group=dist.group.WORLD, progress=False)
    with torch.inference_mode():
        fn_runner.capture()
    one = prompt[:1]
    out["functional_captured"] = fn_runner.captured_buckets
    out["functional_tokens_equal"] = torch.equal(
        greedy_generate(fn_tp, one, 6, step=fn_runner), greedy_generate(base, one, 6))
    out["functional_eager_calls"] = fn_runner.stats()["eager_calls"]
    return out


def test_tp_decoder_equals_single_process_eager_and_replayed() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    r0, r1 = run_ranks(_tp_checks, 2, args=("c10d",), timeout=150, pg_timeout=20)
    for r in (r0, r1):
        assert r["eager_tokens_equal"], r
        assert r["captured"] == [1, 4], r["reasons"]
        assert r["replay_tokens_equal"], r
        assert r["eager_calls"] == 0, r  # every call was served by a graph
        assert r["functional_captured"] == [1] and r["functional_eager_calls"] == 0, r
        assert r["functional_tokens_equal"], r
    assert r0["logits"] == r1["logits"]  # replicated: the ranks hold the same logits
