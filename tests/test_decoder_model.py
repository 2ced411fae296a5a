"""The bundled decoder: deterministic build, static KV cache semantics, row independence,
shapes, and capture-friendliness (no host syncs, no data-dependent shapes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel_graph.models import Decoder, DecoderConfig, greedy_generate

SMALL = DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, mlp_hidden=48, max_seq=16)


def _ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _caches(model: Decoder) -> list[torch.Tensor]:
    return [t.clone() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]


def _filled(config: DecoderConfig = SMALL) -> Decoder:
    """A model whose cache holds 6 prefilled positions per row, different in every row."""
    model = Decoder(config)
    gen = torch.Generator().manual_seed(123)
    prompt = torch.randint(0, config.vocab_size, (config.max_batch, 6), generator=gen)
    with torch.inference_mode():
        model.prefill(prompt)
    return model


def test_default_config_is_small() -> None:
    cfg = DecoderConfig()
    assert cfg.vocab_size == 512 and 2 <= cfg.n_layers <= 4 and 4 <= cfg.n_heads <= 8
    assert cfg.max_seq == 128 and cfg.max_batch >= 8
    assert isinstance(cfg.norm_eps, float)


def test_two_builds_are_identical_and_leave_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = Decoder(SMALL), Decoder(SMALL)
    assert torch.equal(state, torch.random.get_rng_state())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for (name, pa), (_, pb) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(pa, pb), name
    tokens, positions = _ints(1, 2, 3), _ints(0, 0, 0)
    assert torch.equal(a.decode_step(tokens, positions), b.decode_step(tokens, positions))


def test_seed_changes_weights() -> None:
    other = DecoderConfig(**{**SMALL.as_dict(), "seed": 1})
    assert not torch.equal(Decoder(SMALL).tok_emb, Decoder(other).tok_emb)


def test_inference_only_parameters() -> None:
    model = Decoder(SMALL)
    assert not any(p.requires_grad for p in model.parameters())
    assert model.num_parameters() > 0


@pytest.mark.parametrize("batch", [1, 3, SMALL.max_batch])
def test_shapes(batch: int) -> None:
    model = Decoder(SMALL)
    logits = model.decode_step(
        torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)
    )
    assert logits.shape == (batch, SMALL.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    layer = model.layers[0]
    assert layer.k_cache.shape == (SMALL.max_batch, SMALL.n_heads, SMALL.max_seq, SMALL.head_dim)
    assert layer.v_cache.shape == layer.k_cache.shape


def test_decode_step_writes_cache_only_at_given_positions() -> None:
    model = _filled()
    before = _caches(model)
    ptrs = [t.data_ptr() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
    positions = _ints(9, 6, 13)
    with torch.inference_mode():
        model.decode_step(_ints(5, 7, 11), positions)
    after = _caches(model)
    assert ptrs == [t.data_ptr() for layer in model.layers for t in (layer.k_cache, layer.v_cache)]
    for old, new in zip(before, after, strict=True):
        expected = torch.zeros(old.shape[0], old.shape[2], dtype=torch.bool)
        for row, pos in enumerate(positions.tolist()):
            expected[row, pos] = True
        changed = (old != new).any(dim=3).any(dim=1)  # [batch, seq]: any head or channel changed
        assert torch.equal(changed, expected)


def test_rows_are_independent() -> None:
    model = _filled()
    tokens, positions = _ints(5, 7, 11, 13), _ints(6, 6, 8, 7)
    with torch.inference_mode():
        base = model.decode_step(tokens, positions).clone()
        # Other rows' tokens, positions and cache contents must not change row 0's logits.
        for layer in model.layers:
            layer.k_cache[1:].normal_(generator=torch.Generator().manual_seed(5))
            layer.v_cache[1:].normal_(generator=torch.Generator().manual_seed(6))
        other = model.decode_step(_ints(5, 1, 2, 3), _ints(6, 9, 2, 11))
    torch.testing.assert_close(other[0], base[0], rtol=0, atol=0)


def test_row_matches_batch_of_one() -> None:
    model = _filled()
    with torch.inference_mode():
        batched = model.decode_step(_ints(5, 7, 11), _ints(6, 6, 8)).clone()
        single = model.decode_step(_ints(5), _ints(6))
    torch.testing.assert_close(single[0], batched[0])


def test_causal_mask_hides_later_cache_entries() -> None:
    model = _filled()
    tokens, positions = _ints(3, 4), _ints(6, 2)
    with torch.inference_mode():
        base = model.decode_step(tokens, positions).clone()
        for layer in model.layers:
            for cache in (layer.k_cache, layer.v_cache):
                cache[0, :, 7:] = 1e3
                cache[1, :, 3:] = -1e3
        again = model.decode_step(tokens, positions)
    torch.testing.assert_close(again, base, rtol=0, atol=0)


def test_bad_inputs_are_refused() -> None:
    model = Decoder(SMALL)
    with pytest.raises(ValueError, match="int64"):
        model.decode_step(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        model.decode_step(_ints(1, 2), _ints(0))
    with pytest.raises(ValueError, match="max_batch"):
        n = SMALL.max_batch + 1
        model.decode_step(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    with pytest.raises(ValueError, match="divisible"):
        DecoderConfig(dim=30, n_heads=4)


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_decode_step_has_no_host_syncs_or_data_dependent_ops() -> None:
    model = _filled()
    with torch.inference_mode(), _OpLog() as log:
        model.decode_step(_ints(1, 2), _ints(6, 7))
    forbidden = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal"}
    assert not (log.ops & forbidden)
    assert "index_put_" in log.ops  # the in-place cache write


def test_decode_step_runs_on_meta_tensors() -> None:
    """Meta tensors hold no data: anything reading values on the host would fail here."""
    model = Decoder(SMALL).to("meta")
    logits = model.decode_step(
        torch.zeros(3, dtype=torch.int64, device="meta"),
        torch.zeros(3, dtype=torch.int64, device="meta"),
    )
    assert logits.shape == (3, SMALL.vocab_size)


def test_greedy_generate_is_deterministic_and_uses_step() -> None:
    model = Decoder(SMALL)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    calls = []

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        calls.append(positions.clone())
        return model.decode_step(tokens, positions)

    a = greedy_generate(model, prompt, 4)
    b = greedy_generate(model, prompt, 4, step=step)
    assert a.shape == (2, 7) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    assert [int(p[0]) for p in calls] == list(range(6))
    with pytest.raises(ValueError, match="max_seq"):
        greedy_generate(model, prompt, SMALL.max_seq)


def test_recorder_replay_matches_eager() -> None:
    """The model is built to be captured: replay on the CPU recorder is bitwise equal to eager
    and writes the cache at replay, not at capture."""
    import accel_graph

    model = _filled()
    tokens, positions = _ints(3, 4), _ints(6, 9)
    with torch.inference_mode():
        ref = model.decode_step(tokens, positions).clone()
        expected_cache = _caches(model)
        model.layers[0].k_cache[:, :, 6:].zero_()  # undo the eager write
        g = accel_graph.Graph(device="cpu")
        with accel_graph.graph(g):
            out = model.decode_step(tokens, positions)
        assert not torch.equal(model.layers[0].k_cache, expected_cache[0])
        g.replay()
    assert torch.equal(out, ref)
    assert torch.equal(model.layers[0].k_cache, expected_cache[0])
