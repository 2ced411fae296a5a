"""The recipes in docs/recipes/ run as written: their code blocks are executed from the
Markdown files, so a recipe that drifts from the API fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "recipes"


def code_of(name: str) -> str:
    text = (RECIPES / name).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{name} has no python block"
    return "\n".join(blocks)


def test_transformers_recipe_decodes_greedy_tokens_equal_to_eager() -> None:
    pytest.importorskip("transformers", reason="transformers is a test dependency (pyproject [test])")
    from transformers import StaticCache

    code = code_of("transformers.md")
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) < 30, f"the recipe promises under 30 lines, it has {len(lines)}"
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(code, "docs/recipes/transformers.md", "exec"), ns)
    model, config, runner = ns["model"], ns["config"], ns["runner"]

    @torch.no_grad()
    def eager(prompts: torch.Tensor, steps: int) -> torch.Tensor:
        n, length = prompts.shape
        cache = StaticCache(config=config, max_cache_len=32)
        tok = model(prompts, cache=cache, cache_position=torch.arange(length)).logits[:, -1].argmax(-1)
        out = [tok]
        for i in range(steps - 1):
            tok = ns["decode_step"](tok[:, None], torch.tensor([length + i]), state=cache).argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)

    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 4):
        prompts = torch.randint(0, 128, (n, 5), generator=gen)
        got = ns["generate"](prompts, 8)
        assert torch.equal(got, eager(prompts, 8)), f"batch {n}"
    st = runner.stats()
    assert st["eager_calls"] == 0 and st["graph_calls"] == 4 * 7
    assert runner.captured_buckets == [1, 2, 4]
