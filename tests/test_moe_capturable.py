"""Issue 26 on transformers 5 MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE from tiny configs):
what capture refuses with the eager experts loop, which module ``check_capturable`` names as the
island for it, and that the ``grouped_mm`` experts capture as they are."""

from __future__ import annotations

import re

import pytest
import torch
from moe_models import MOE_FAMILIES, build_moe, moe_decode_step, require_transformers_5

import accel_graph
from accel_graph import check_capturable

FAMILIES = list(MOE_FAMILIES)


def _prefilled(family: str, experts: str, batch: int = 2):
    """A model, a decode step and a ``StaticCache`` holding a 4-token prompt per row (a fresh
    cache takes another code path on its first write, which ``steps=2`` would report)."""
    model, _ = build_moe(family, experts=experts)
    return model, moe_decode_step(model), _prefilled_cache(model, batch)


def _prefilled_cache(model: torch.nn.Module, batch: int = 2):
    transformers = require_transformers_5()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    prompt = torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=prompt, cache=cache)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_experts_refused_ops_name_the_experts_inside_the_sparse_block(family: str) -> None:
    fam = MOE_FAMILIES[family]
    model, step, cache = _prefilled(family, "eager")
    rep = check_capturable(step, torch.tensor([[5], [7]]), cache, steps=1)
    refused = [f for f in rep if f.level == "dispatch"]
    ops = {f.op for f in refused}
    assert {"aten.nonzero.default", "aten._local_scalar_dense.default"} <= ops, ops
    module_file = f"modeling_{family}.py"
    for f in refused:
        assert module_file in f.location, f
        m = re.fullmatch(r"model\.model\.layers\.(\d)\.mlp\.experts", f.island["path"])
        assert m and f.island["class"] == fam.experts, f.island
        layer = int(m.group(1))
        assert f.island["submodule"] == f"model.layers.{layer}.mlp.experts"
        assert type(model.get_submodule(f.island["submodule"])).__name__ == fam.experts
        assert f.island["within"][0] == {"path": f"model.model.layers.{layer}.mlp",
                                         "class": fam.sparse_block}
    assert {f.island["submodule"] for f in refused} == {
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    text = rep.format()
    assert (f"mark model.model.layers.0.mlp.experts, model.model.layers.1.mlp.experts "
            f"({fam.experts}) as eager islands, or every {fam.experts}") in text
    assert f"the enclosing {fam.sparse_block} would do too" in text


@pytest.mark.parametrize("family", ["mixtral"])
def test_baked_routing_values_name_the_same_island(family: str) -> None:
    """Two decode steps route differently: the loop's expert indices are Python ints a graph
    would freeze (``steps=2``); they too are inside the experts."""
    fam = MOE_FAMILIES[family]
    model, step, cache = _prefilled(family, "eager")

    def decode(input_ids):
        return model(input_ids=input_ids, cache=cache).logits[:, -1]

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 1), generator=gen)
    rep = check_capturable(decode, ids, advance=lambda: ids.random_(0, 128, generator=gen))
    baked = [f for f in rep if f.level == "baked"]
    assert baked, rep.format()
    assert all(f.island is not None and f.island["class"] == fam.experts for f in baked)
    assert {f.island["root"] for f in baked} == {"model"}


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_mm_experts_are_capturable_and_replay_bitwise_equal(family: str) -> None:
    _, step, cache = _prefilled(family, "grouped_mm")
    _, eager_step, eager_cache = _prefilled(family, "grouped_mm")
    assert check_capturable(step, torch.tensor([[5], [7]]), cache, steps=1).ok
    # the check ran one real step on `cache`: advance the eager cache the same way
    with torch.no_grad():
        eager_step(torch.tensor([[5], [7]]), eager_cache)
    ids = torch.tensor([[1], [2]])
    g = accel_graph.Graph()
    with torch.no_grad(), accel_graph.graph(g):
        out = step(ids, cache)
    for tokens in ([[1], [2]], [[9], [3]], [[127], [0]]):
        ids.copy_(torch.tensor(tokens))
        g.replay()
        with torch.no_grad():
            want = eager_step(torch.tensor(tokens), eager_cache)
        assert torch.equal(out, want), tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_block_and_experts_outputs_have_fixed_shape_and_dtype(family: str) -> None:
    """What an island of either module returns keeps the hidden states' shape and dtype
    whatever the routing (an island's outputs become static buffers)."""
    fam = MOE_FAMILIES[family]
    model, step, cache = _prefilled(family, "eager")
    seen: dict[str, set] = {fam.sparse_block: set(), fam.experts: set()}

    def hook(module, args, output):
        seen[type(module).__name__].add((tuple(args[0].shape), tuple(output.shape), output.dtype))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if type(m).__name__ in seen]
    try:
        for tokens in ([[5], [7]], [[0], [0]], [[127], [64]]):
            with torch.no_grad():
                step(torch.tensor(tokens), cache)
    finally:
        for h in handles:
            h.remove()
    hidden = model.config.hidden_size
    assert seen[fam.sparse_block] == {((2, 1, hidden), (2, 1, hidden), torch.float32)}
    assert seen[fam.experts] == {((2, hidden), (2, hidden), torch.float32)}


@pytest.mark.parametrize("family", FAMILIES)
def test_marking_the_named_experts_as_islands_makes_the_step_capturable(family: str) -> None:
    """The report's advice followed: every experts module an eager island. check_capturable is
    then clean (baked routing values included), and the recorder captures the step in pieces
    that replay bitwise equal to eager, routing changing with the tokens."""
    fam = MOE_FAMILIES[family]
    model, step, cache = _prefilled(family, "eager")
    _, eager_step, eager_cache = _prefilled(family, "eager")
    before = check_capturable(step, torch.tensor([[5], [7]]), cache, steps=1)
    for sub in {f.island["submodule"] for f in before}:
        accel_graph.eager_island(model.get_submodule(sub))
    assert sum(type(m).__name__ == fam.experts for m in model.modules()) == 2

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 1), generator=gen)
    rep = check_capturable(step, ids, cache,
                           advance=lambda: ids.random_(0, 128, generator=gen))
    assert rep.ok, rep.format()
    cache = _prefilled_cache(model)  # the checks ran 4 real steps on the first one

    ids = torch.tensor([[1], [2]])
    g = accel_graph.Graph()
    with torch.no_grad(), accel_graph.graph(g):
        out = step(ids, cache)
    # Capture ran the pieces before each island once, as a warm-up would: the attention's cache
    # writes and its length counter moved one token, as one eager step does.
    with torch.no_grad():
        eager_step(ids.clone(), eager_cache)
    for tokens in ([[1], [2]], [[9], [3]], [[127], [0]], [[40], [40]]):
        ids.copy_(torch.tensor(tokens))
        g.replay()
        with torch.no_grad():
            want = eager_step(torch.tensor(tokens), eager_cache)
        assert torch.equal(out, want), tokens
