"""The bundled decoder's mixture-of-experts MLP (``DecoderConfig(num_experts=E, top_k=k)``).

Written the way Hugging Face transformers 5 writes its eager MoE blocks (Mixtral's
``MixtralSparseMoeBlock`` and ``MixtralExperts``), because that is the code users bring:

- the router (:class:`MoeBlock`): a linear layer to ``E`` logits per token, a softmax in
  float32, the top ``k`` experts per token and their weights renormalised to sum to one. All
  static shapes: this part is captured with the rest of the graph;
- the experts (:class:`Experts`): ``E`` gated MLPs stored as 3-D weights, run by a loop over the
  experts that the router picked, which reads the routing on the host: ``nonzero`` for the
  experts hit and ``.item()`` for each one's index, then ``torch.where`` for its tokens (a
  data-dependent shape). No graph capture can record that, so :class:`Experts` is marked
  :func:`accel_graph.eager_island` when built: inside a capture it runs eagerly between the
  captured pieces at every replay, outside one it is a plain call.

Weights come from the decoder's local generator (no global RNG), so builds are reproducible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..graphs.islands import eager_island

__all__ = ["Experts", "MoeBlock"]


class Experts(nn.Module):
    """``num_experts`` gated MLPs (SiLU gate times up, then down) over 3-D weights:
    ``gate_up [E, 2 * hidden, dim]`` and ``down [E, dim, hidden]``.

    :meth:`forward` takes the tokens ``x [T, dim]``, the experts chosen per token
    ``top_i [T, k]`` (int64) and their weights ``top_w [T, k]``; it returns ``[T, dim]``: per
    token, the weighted sum of its ``k`` experts' outputs. It reads the routing on the host
    (HF's eager experts loop), so it is an eager island in a capture.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, std: float, out_std: float,
                 gen: torch.Generator) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * hidden, dim, generator=gen) * std)
        self.down = nn.Parameter(torch.randn(num_experts, dim, hidden, generator=gen) * out_std)

    def forward(self, x: Tensor, top_i: Tensor, top_w: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        # [E, k, T]: which (slot, token) pairs picked each expert (transformers' layout).
        hits = F.one_hot(top_i, num_classes=self.num_experts).permute(2, 1, 0)
        # Host reads, as in transformers' eager experts: the experts hit (nonzero) and, per
        # expert, its index (.item()) and its tokens (torch.where: a data-dependent shape).
        for hit in torch.greater(hits.sum(dim=(-1, -2)), 0).nonzero():
            e = int(hit[0].item())
            slot, token = torch.where(hits[e])
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * top_w[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoeBlock(nn.Module):
    """The sparse MoE MLP of one decoder layer: the router, then :class:`Experts` (marked as an
    eager island). ``forward(x [T, dim]) -> [T, dim]``."""

    def __init__(self, num_experts: int, top_k: int, dim: int, hidden: int, std: float,
                 n_layers: int, gen: torch.Generator) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Parameter(torch.randn(num_experts, dim, generator=gen) * std)
        out_std = std / math.sqrt(2 * n_layers)
        self.experts = eager_island(Experts(num_experts, dim, hidden, std, out_std, gen))

    def forward(self, x: Tensor) -> Tensor:
        # Router in float32 (as transformers' Mixtral), top-k, weights renormalised.
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        return self.experts(x, top_i, top_w)
