"""The recipes in docs/recipes/ run as written: their code blocks are executed from the
Markdown files, so a recipe that drifts from the API (or from transformers) fails here.

docs/recipes/transformers.md has a block per transformers major version, tagged by its first
line (``# transformers 5.x``, ``# transformers 4.x``). The block for the installed major runs;
the 4.x block is also checked as structure on every run, since CI installs 5.x. To run the 4.x
block for real, put a 4.x install first on the path (``PYTHONPATH=<site with transformers
4.57> pytest tests/test_recipes.py``); the 5.x tests then skip, saying why.
"""

from __future__ import annotations

import ast
import re
from inspect import signature
from pathlib import Path
from typing import Any

import pytest
import torch

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "recipes"
TAG = re.compile(r"# transformers (\d+)\.x\n")


def code_of(name: str, variant: str | None = None) -> str:
    """The python blocks of a recipe; with ``variant`` ("5", "4"), only that tagged block."""
    text = (RECIPES / name).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{name} has no python block"
    if variant is not None:
        blocks = [b for b in blocks if (m := TAG.match(b)) and m.group(1) == variant]
        assert len(blocks) == 1, f"{name} has {len(blocks)} blocks tagged transformers {variant}.x"
    return "\n".join(blocks)


def _transformers_major() -> int:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is a test dependency (pyproject [test])")
    return int(transformers.__version__.split(".")[0])


@torch.no_grad()
def reference_tokens(model: Any, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens without any cache: the whole sequence recomputed at each step (no
    position bookkeeping that a recipe could get wrong in the same way as its reference)."""
    seq, out = prompts, []
    for _ in range(steps):
        tok = model(seq, use_cache=False).logits[:, -1].argmax(-1)
        out.append(tok)
        seq = torch.cat([seq, tok[:, None]], 1)
    return torch.stack(out, 1)


def _run_block(code: str, where: str) -> dict:
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) < 32, f"the recipe promises about 30 lines, it has {len(lines)}"
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(code, where, "exec"), ns)
    return ns


def _check_tokens(ns: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 4):
        prompts = torch.randint(0, 128, (n, 5), generator=gen)
        got = ns["generate"](prompts, 8)
        assert torch.equal(got, reference_tokens(ns["model"], prompts, 8)), f"batch {n}"
    st = ns["runner"].stats()
    assert st["eager_calls"] == 0 and st["graph_calls"] == 4 * 7
    assert ns["runner"].captured_buckets == [1, 2, 4]


def test_transformers_5x_recipe_decodes_greedy_tokens_equal_to_no_cache() -> None:
    if _transformers_major() < 5:
        pytest.skip("transformers < 5 installed: the 4.x block runs instead")
    ns = _run_block(code_of("transformers.md", "5"), "docs/recipes/transformers.md (5.x)")
    _check_tokens(ns)
    runner = ns["runner"]
    # timing calls advance the bucket's cache (5.x: the cache counts its own length);
    # generate's reset must make them harmless
    for _ in range(5):
        runner(torch.zeros(4, 1, dtype=torch.long))
    prompts = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(ns["generate"](prompts, 6), reference_tokens(ns["model"], prompts, 6))
    # and the cache holds exactly prompt + decoded tokens: 5 + 5
    cache = runner.state(runner.bucket_for(3))
    assert {int(layer.cumulative_length) for layer in cache.layers} == {10}


def test_transformers_5x_recipe_has_no_input_that_does_nothing() -> None:
    """Every input of the captured step changes its result: 4.x's ``cache_position`` is
    accepted and ignored by 5.x, so a recipe passing it feeds the graph a dead input (and
    tells the reader that positions are theirs to control, which they are not)."""
    if _transformers_major() < 5:
        pytest.skip("transformers < 5 installed: the 4.x block runs instead")
    ns = _run_block(code_of("transformers.md", "5"), "docs/recipes/transformers.md (5.x)")
    from transformers import StaticCache

    step, config, model = ns["decode_step"], ns["config"], ns["model"]
    prompts = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    n_inputs = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in signature(step).parameters.values())
    tok = torch.tensor([[7], [9]])

    @torch.no_grad()
    def after_prefill(*inputs: torch.Tensor) -> torch.Tensor:
        cache = StaticCache(config=config, max_cache_len=32)
        model(prompts, cache=cache)
        return step(*inputs, state=cache)

    base_inputs = [tok, *(torch.tensor([5]) for _ in range(n_inputs - 1))]
    base = after_prefill(*base_inputs)
    for i in range(n_inputs):
        changed = list(base_inputs)
        changed[i] = changed[i] + 1
        assert not torch.equal(after_prefill(*changed), base), (
            f"input {i} of decode_step does not change its output: a dead graph input")


def test_transformers_4x_recipe_structure() -> None:
    """The 4.x form, checked as structure (CI installs 5.x): the write position is an input of
    the step and of every runner call, the cache argument is ``past_key_values=``."""
    code = code_of("transformers.md", "4")
    tree = ast.parse(code)
    step = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "decode_step")
    assert [a.arg for a in step.args.args] == ["input_ids", "cache_position"]
    assert [a.arg for a in step.args.kwonlyargs] == ["state"]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    model_kw = [{k.arg for k in c.keywords} for c in calls
                if isinstance(c.func, ast.Name) and c.func.id == "model"]
    assert model_kw and all({"past_key_values", "cache_position"} <= kw for kw in model_kw)
    assert all("cache" not in kw for kw in model_kw), "cache= is 5.x's name"
    runner_calls = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "runner"]
    assert runner_calls and all(len(c.args) == 2 for c in runner_calls)
    assert "batch_dim=(0, None)" in code and "cache.reset()" in code


def test_transformers_4x_recipe_runs_on_4x() -> None:
    if _transformers_major() != 4:
        pytest.skip("needs transformers 4.x first on the path (CI installs 5.x); the structure "
                    "test covers the block there")
    preamble = code_of("transformers.md", "5").split("def decode_step")[0]
    ns = _run_block(preamble + code_of("transformers.md", "4"), "docs/recipes/transformers.md (4.x)")
    _check_tokens(ns)
    # 4.x: the position is the caller's, so timing calls move nothing
    for _ in range(5):
        ns["runner"](torch.zeros(4, 1, dtype=torch.long), torch.tensor([20]))
    prompts = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(ns["generate"](prompts, 6), reference_tokens(ns["model"], prompts, 6))
