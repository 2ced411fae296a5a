"""Tiny modules for the conformance suite: small enough for CPU CI, rich enough in ops.

Every model is built with deterministic weights (:func:`build`) so that two copies hold the same
parameters: one is captured, the other runs eagerly as the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: layernorm, fused qkv, chunk, view/transpose to heads, softmax attention
    by explicit matmuls, back to tokens with transpose + contiguous + view, gelu MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = MLP(d, 4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        y = att.softmax(dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class DecodeStep(nn.Module):
    """One decode step over a static KV cache, updated in place at ``pos``.

    ``k_cache``/``v_cache`` are ``[batch, heads, max_len, head_dim]`` buffers that exist before
    capture; the new key goes in with ``index_copy_`` and the new value with integer-tensor
    indexing (``index_put_``). Attention masks positions after ``pos`` with a comparison against
    ``arange`` (no boolean indexing, so no data-dependent shapes).
    """

    def __init__(self, d: int = 32, heads: int = 4, max_len: int = 8, batch: int = 2) -> None:
        super().__init__()
        self.heads, self.hd, self.max_len = heads, d // heads, max_len
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, self.hd))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, self.hd))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, 1, d]``; ``pos``: int64 ``[1]``, the position being written."""
        b, _, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, 1, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache[:, :, pos] = v
        scores = (q @ self.k_cache.transpose(-2, -1)) / math.sqrt(self.hd)
        visible = torch.arange(self.max_len, device=x.device) <= pos
        scores = scores.masked_fill(~visible, float("-inf"))
        y = scores.softmax(dim=-1) @ self.v_cache
        return self.proj(y.transpose(1, 2).reshape(b, 1, d))


def build(
    cls: type[nn.Module], device: torch.device, *args: object, seed: int = 0, **kwargs: object
) -> nn.Module:
    """``cls(*args, **kwargs)`` with weights drawn from ``seed``, on ``device``, in eval mode.

    Weights are drawn on the CPU so every device gets the same values, and the global RNG is
    left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(*args, **kwargs)
        for p in model.parameters():
            # Non-trivial norm weights and biases, not just 1 and 0.
            p.data.uniform_(-0.5, 0.5)
    return model.to(device).eval().requires_grad_(False)
