"""The bundled decoder's mixture-of-experts option (``DecoderConfig(num_experts=E, top_k=k)``):
what it computes, that its experts are an eager island, and that its decode step captured on
the recorder replays bitwise equal to eager while the routing changes between replays."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import accel_graph
from accel_graph.errors import ConfigError
from accel_graph.graphs.islands import is_eager_island
from accel_graph.models import Decoder, DecoderConfig

MOE = DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, mlp_hidden=48, max_seq=16,
                    num_experts=4, top_k=2)


def _ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_dense_is_the_default_and_builds_as_before() -> None:
    cfg = DecoderConfig()
    assert cfg.num_experts == 0
    dense = Decoder(DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, mlp_hidden=48,
                                  max_seq=16))
    assert all(layer.moe is None for layer in dense.layers)
    assert {k.split(".", 2)[-1] for k in dense.state_dict() if k.startswith("layers.")} == {
        "attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"}


def test_moe_config_is_validated() -> None:
    with pytest.raises(ValueError, match="num_experts must be 0"):
        DecoderConfig(num_experts=-1)
    with pytest.raises(ValueError, match=r"top_k=3 must be in 1..num_experts=2"):
        DecoderConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="top_k=0"):
        DecoderConfig(num_experts=2, top_k=0)


def test_moe_layers_share_attention_weights_with_the_dense_build() -> None:
    """The MoE build draws attention weights first, as the dense one does: only the MLP differs."""
    dense = Decoder(DecoderConfig(**{**MOE.as_dict(), "num_experts": 0}))
    moe = Decoder(MOE)
    assert torch.equal(dense.layers[0].wqkv, moe.layers[0].wqkv)
    assert moe.layers[0].moe.experts.gate_up.shape == (4, 96, 32)
    assert moe.layers[0].moe.experts.down.shape == (4, 32, 48)
    assert not any(p.requires_grad for p in moe.parameters())


def test_experts_are_eager_islands() -> None:
    model = Decoder(MOE)
    for layer in model.layers:
        assert is_eager_island(layer.moe.experts)
        assert not is_eager_island(layer.moe)  # the router is captured


def test_moe_mlp_is_the_weighted_sum_of_the_top_k_experts() -> None:
    """Per token, the experts loop equals a direct per-token computation of the top-k experts
    weighted by the renormalised router probabilities."""
    block = Decoder(MOE).layers[0].moe
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = block(x)
        probs = torch.softmax(x @ block.router.T, dim=-1)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            w, idx = probs[t].topk(MOE.top_k)
            w = w / w.sum()
            for weight, e in zip(w.tolist(), idx.tolist()):
                gate, up = (block.experts.gate_up[e] @ x[t]).chunk(2)
                want[t] += weight * (block.experts.down[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tensor_parallel_decoder_refuses_moe() -> None:
    from accel_graph.models import shard_state

    with pytest.raises(ConfigError, match="num_experts=4"):
        shard_state(Decoder(MOE).state_dict(), MOE, 0, 2)


def _routes(model: Decoder, tokens: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
    """The experts each layer's router picks for this step (read off a forward hook)."""
    seen: list[tuple] = []
    hooks = [layer.moe.experts.register_forward_pre_hook(
        lambda m, args: seen.append(tuple(args[1].flatten().tolist()))) for layer in model.layers]
    try:
        with torch.inference_mode():
            model.decode_step(tokens, positions)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("batch", [1, 3])
def test_moe_decode_step_replays_bitwise_equal_to_eager(batch: int, tmp_path) -> None:
    """Captured once on the recorder, replayed with new tokens and positions: every replay
    equals the eager step of an identical model bitwise, KV caches included, while the experts
    picked change from replay to replay (the island reads the live routing)."""
    model, eager = Decoder(MOE), Decoder(MOE)
    prompt = torch.randint(0, 64, (MOE.max_batch, 4), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.prefill(prompt)
        eager.prefill(prompt)
    tokens = torch.arange(batch, dtype=torch.int64) + 7
    positions = torch.full((batch,), 4, dtype=torch.int64)
    g = accel_graph.Graph(device="cpu")
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = model.decode_step(tokens, positions)
        # capture ran the pieces before each island once (the attention writes its cache row)
        eager.decode_step(tokens.clone(), positions.clone())
    gen = torch.Generator().manual_seed(2)
    routes = set()
    for step in range(6):
        new_tokens = torch.randint(0, 64, (batch,), generator=gen)
        new_positions = torch.full((batch,), 4 + step, dtype=torch.int64)
        routes.add(tuple(_routes(Decoder(MOE), new_tokens, new_positions)))
        tokens.copy_(new_tokens)
        positions.copy_(new_positions)
        g.replay()
        with torch.inference_mode():
            want = eager.decode_step(new_tokens, new_positions)
        assert torch.equal(out, want), step
        for a, b in zip(model.layers, eager.layers):
            assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache), step
    assert len(routes) > 1, "the test inputs never changed the routing"
    g.debug_dump(str(tmp_path / "moe.dot"))
    islands = json.loads((tmp_path / "moe.dot.json").read_text())["islands"]
    assert len(islands) == MOE.n_layers and all("Experts.forward" in i["name"] for i in islands)


def test_moe_decoder_is_clean_for_check_capturable() -> None:
    """With the experts marked, check_capturable finds nothing to refuse (the islands run
    eagerly through the check); the routing reads stay inside them."""
    model = Decoder(MOE)
    rep = accel_graph.check_capturable(model.decode_step, _ints(3), _ints(0))
    assert rep.ok, rep.format()


@pytest.mark.slow
def test_moe_decode_step_compiled_replay_is_close_to_eager() -> None:
    model, eager = Decoder(MOE), Decoder(MOE)
    tokens, positions = _ints(9), _ints(0)
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = model.decode_step(tokens, positions)
        eager.decode_step(tokens.clone(), positions.clone())
        for step, tok in enumerate((9, 31, 2, 50)):
            tokens.fill_(tok)
            positions.fill_(step)
            g.replay()
            want = eager.decode_step(_ints(tok), _ints(step))
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert g.replay_mode().mode == "compiled", g.compile_info()
    # every stretch between the islands is one Inductor program (none replays interpreted)
    info = g.compile_info()
    assert info["interpreted_stretches"] == [] and info["stretches"] == MOE.n_layers + 1, info
