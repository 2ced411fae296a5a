"""docs/recipes/moe.md runs as written: its code block is executed from the Markdown file, for
Mixtral, Qwen2-MoE and Qwen3-MoE, and its greedy tokens must equal eager decoding, with every
decode step served from a graph whose sparse MoE blocks are eager islands."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import _COMMON, MOE_FAMILIES, build_moe, require_transformers_5

RECIPE = Path(__file__).resolve().parent.parent / "docs" / "recipes" / "moe.md"


def _block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/recipes/moe.md has {len(blocks)} python blocks, expected 1"
    return blocks[0]


@pytest.fixture(scope="module")
def recipe() -> dict:
    require_transformers_5()
    ns: dict = {}
    exec(compile(_block(), str(RECIPE), "exec"), ns)
    return ns


@torch.no_grad()
def no_cache_tokens(model: Any, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens with the whole sequence recomputed at each step (no cache)."""
    seq, out = prompts, []
    for _ in range(steps):
        tok = model(seq, use_cache=False).logits[:, -1].argmax(-1)
        out.append(tok)
        seq = torch.cat([seq, tok[:, None]], 1)
    return torch.stack(out, 1)


@torch.no_grad()
def eager_cache_tokens(model: Any, config: Any, prompts: torch.Tensor, steps: int,
                       bucket: int) -> torch.Tensor:
    """Greedy tokens decoded eagerly with a StaticCache at the bucket's padded batch: the
    computation the graphs and islands replay, step for step."""
    from transformers import StaticCache

    n, length = prompts.shape
    cache = StaticCache(config=config, max_cache_len=32)
    tok = model(torch.cat([prompts, prompts.new_zeros(bucket - n, length)]),
                cache=cache).logits[:n, -1].argmax(-1)
    out = [tok]
    for _ in range(steps - 1):
        ids = torch.cat([tok, tok.new_zeros(bucket - n)])[:, None]
        tok = model(ids, cache=cache).logits[:n, -1].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_recipe_decodes_tokens_equal_to_eager_with_the_moe_block_as_island(
        recipe: dict, family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, runner = recipe["serve"](family)
    assert model.config._experts_implementation == "eager"
    fam = MOE_FAMILIES[family]
    assert runner.runtime.options.islands.names() == [fam.sparse_block]
    assert type(model.model.layers[0].mlp).__name__ == fam.sparse_block
    assert runner.captured_buckets == [1, 2, 4]
    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 4):
        prompts = torch.randint(0, 128, (n, 5), generator=gen)
        got = recipe["generate"](model, runner, prompts, 8)
        bucket = runner.bucket_for(n)
        assert torch.equal(got, eager_cache_tokens(model, model.config, prompts, 8, bucket)), n
        assert torch.equal(got, no_cache_tokens(model, prompts, 8)), n
    st = runner.stats()
    assert st["eager_calls"] == 0 and st["graph_calls"] == 4 * 7, st
    assert not st["eager_fallbacks"], st
    # The islands really are in the graphs: each replay runs 2 MoE blocks eagerly.
    for b in (1, 2, 4):
        runner.graph(b).debug_dump(str(tmp_path / f"{b}.dot"))
        islands = json.loads((tmp_path / f"{b}.dot.json").read_text())["islands"]
        assert [i["name"] for i in islands] == [f"{fam.sparse_block}.forward"] * 2, (b, islands)
    # The recipe's generate resets the cache: after serving, it holds prompt + decoded tokens.
    cache = runner.state(4)
    assert {int(layer.cumulative_length) for layer in cache.layers} == {5 + 7}


def test_moe_recipe_builds_the_models_of_the_test_fixtures(recipe: dict) -> None:
    """The recipe's configs are tests/moe_models.py's (the fixtures the islands tests use), so
    the two cannot drift apart."""
    for family, (config_class, model_class, moe, block) in recipe["FAMILIES"].items():
        fam = MOE_FAMILIES[family]
        assert (config_class, model_class) == (fam.config_class, fam.model_class)
        assert block.rsplit(".", 1)[1] == fam.sparse_block
        _, config = build_moe(family)
        for key, value in {**_COMMON, **fam.moe_kwargs, **moe}.items():
            assert getattr(config, key) == value, (family, key)
        assert set(fam.moe_kwargs) - {"num_experts_per_tok"} == set(moe), family


def test_eager_experts_need_the_island_and_grouped_mm_experts_do_not(recipe: dict) -> None:
    """What the recipe says of the two experts implementations: eager experts without an
    island cannot be captured (every bucket falls back); grouped_mm experts capture whole."""
    from transformers import StaticCache

    import accel_graph

    for experts, captured in (("eager", []), ("grouped_mm", [1, 2])):
        model, config = build_moe("mixtral", experts=experts)

        def decode_step(input_ids: torch.Tensor, *, state: Any) -> torch.Tensor:
            return model(input_ids=input_ids, cache=state).logits[:, -1]  # noqa: B023

        runner = accel_graph.GraphRunner(
            decode_step, (torch.zeros(1, 1, dtype=torch.long),), buckets=[1, 2],
            state=lambda bucket: StaticCache(config=config, max_cache_len=32)).capture()  # noqa: B023
        assert runner.captured_buckets == captured, experts
        prompts = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(4))
        got = recipe["generate"](model, runner, prompts, 6)
        assert torch.equal(got, no_cache_tokens(model, prompts, 6)), experts
