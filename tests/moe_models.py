"""Tiny transformers 5 MoE decoders built from configs (no downloads), for the islands tests.

::

    from moe_models import MOE_FAMILIES, build_moe, moe_decode_step

    model, config = build_moe("mixtral", experts="eager")
    step = moe_decode_step(model)          # step(input_ids, cache) -> last-position logits

Each family is a transformers 5 ``*ForCausalLM`` with 2 layers, hidden size 32, 4 experts
(2 per token) and a 128-token vocabulary, seeded, in ``eval()`` mode. ``experts`` picks
transformers' experts implementation (the config's ``experts_implementation``, stored as
``config._experts_implementation``): ``"eager"`` is the per-expert loop that reads the router's
choice on the host (``nonzero``, ``if expert_idx == ...``, ``torch.where``), which capture
refuses; ``"grouped_mm"`` is ``torch._grouped_mm`` over sorted tokens, which has no host read.
Built from a config with no ``experts_implementation``, transformers 5.24 picks ``"grouped_mm"``
wherever ``torch._grouped_mm`` is available (torch 2.13 CPU included), so the eager loop must be
asked for: ``build_moe`` always names it.

Tests that use these skip when transformers (a test dependency) is missing or older than 5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

__all__ = ["MOE_FAMILIES", "MoeFamily", "build_moe", "moe_decode_step", "require_transformers_5"]


@dataclass(frozen=True)
class MoeFamily:
    """One MoE family: its transformers class names, its config's MoE arguments, and the class
    names of its sparse MoE block (``model.layers.<i>.mlp``) and of the experts inside it
    (``model.layers.<i>.mlp.experts``)."""

    config_class: str
    model_class: str
    moe_kwargs: dict[str, Any]
    sparse_block: str
    experts: str


_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64)

MOE_FAMILIES: dict[str, MoeFamily] = {
    "mixtral": MoeFamily("MixtralConfig", "MixtralForCausalLM",
                         dict(num_local_experts=4, num_experts_per_tok=2),
                         "MixtralSparseMoeBlock", "MixtralExperts"),
    # Qwen2-MoE adds a shared expert (an MLP with a sigmoid gate) beside the routed ones.
    "qwen2_moe": MoeFamily("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                           dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64),
                           "Qwen2MoeSparseMoeBlock", "Qwen2MoeExperts"),
    "qwen3_moe": MoeFamily("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                           "Qwen3MoeSparseMoeBlock", "Qwen3MoeExperts"),
}


def require_transformers_5() -> Any:
    """The transformers module, or skip the test (a test dependency; MoE experts need 5.x)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is a test dependency (pyproject [test])")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__}: the MoE fixtures need 5.x "
                    f"(experts as 3-D weights with a switchable implementation)")
    return transformers


def build_moe(family: str, *, experts: str = "eager", seed: int = 0,
              dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """A tiny seeded ``family`` decoder (a key of :data:`MOE_FAMILIES`) in ``eval()`` mode, and
    its config. ``experts``: transformers' experts implementation, ``"eager"`` (the host-reading
    per-expert loop) or ``"grouped_mm"``; the model's config reports the one in effect."""
    transformers = require_transformers_5()
    fam = MOE_FAMILIES[family]
    config = getattr(transformers, fam.config_class)(**_COMMON, **fam.moe_kwargs,
                                                     experts_implementation=experts)
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(config).to(dtype).eval()
    if model.config._experts_implementation != experts:
        raise AssertionError(f"{family}: asked for experts_implementation={experts!r}, "
                             f"transformers chose {model.config._experts_implementation!r}")
    return model, config


def moe_decode_step(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``step(input_ids, cache)``: one forward at the cache's own length (transformers 5
    caches count their length), returning the last position's logits."""

    def step(input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=input_ids, cache=cache).logits[:, -1]

    return step
