"""The bundled decoder's blocks as functions of a layer's weights and KV cache, one per step
shape: :func:`block_forward` (rows are cache rows: decode steps), :func:`chunk_block_forward`
(one prompt chunk of one cache row) and :func:`flat_block_forward` (a flat mixed step, with
attention as an eager island). :class:`~accel_graph.models.decoder.Decoder` and
:class:`~accel_graph.models.tp_decoder.TPDecoder` share them (``reduce`` all-reduces a rank's
shard); every op is legal under capture (static shapes, int64 index tensors, no host reads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .slot_attention import slot_attention

if TYPE_CHECKING:
    from .slot_attention import SlotAttentionMeta

__all__ = ["block_forward", "chunk_block_forward", "flat_block_forward", "rms_norm", "rotate"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension; ``eps`` is a Python float (a scalar, not a tensor)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, half-split convention: x is [B, H, D], cos/sin are [B, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def block_forward(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, rows: Tensor,
                  positions: Tensor, masked: Tensor,
                  reduce: Callable[[Tensor], Tensor] | None = None,
                  live: Tensor | None = None) -> Tensor:
    """One decoder block on ``layer``'s weights and KV cache (attention, then the gated MLP).

    Row ``i`` of ``x`` is cache row ``i``; it writes its key and value at ``positions[i]`` and
    attends over keys ``0..K-1`` of its row, ``K = masked.shape[-1]`` (the whole cache, or a
    shorter extent that covers every live position), hiding those ``masked`` marks.
    ``reduce`` (tensor parallelism, :mod:`.tp_decoder`) all-reduces the attention output and
    the MLP output of a rank's shard; None for the single-process block. ``layer.moe`` (None:
    dense) replaces the gated MLP with the mixture of experts of :mod:`.moe`. ``live`` (bool
    ``[B]``, None: every row) marks the rows whose key and value are written: a row that is not
    live writes back what its row already holds at its position, so it changes nothing (its
    output is computed and must not be read).
    """
    b = x.shape[0]
    q, k, v = _qkv(layer, x, cos, sin)
    k_cache, v_cache = layer.k_cache[:b], layer.v_cache[:b]
    _write_kv(k_cache, v_cache, k, v, rows, positions, live)
    attn = F.linear(_attend(layer, q.unsqueeze(2), k_cache, v_cache, masked).reshape(b, -1),
                    layer.wo)
    x = x + (attn if reduce is None else reduce(attn))
    return _mlp_forward(layer, x, reduce)


def chunk_block_forward(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, slot: Tensor,
                        positions: Tensor, masked: Tensor, live: Tensor,
                        reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """One decoder block over ``x [C, dim]``, the tokens of one prompt chunk of the request in
    cache row ``slot`` (int64 ``[1]``), at ``positions``: each live token writes its key and
    value, then attends over the row's keys ``0..K-1`` (``K = masked.shape[-1]``, ``masked``
    ``[1, 1, C, K]``); rows that are not live write back (``block_forward``). Static shapes
    throughout, so a chunk is captured whole (:meth:`Decoder.slot_chunk_step`)."""
    c = x.shape[0]
    q, k, v = _qkv(layer, x, cos, sin)
    _write_kv(layer.k_cache, layer.v_cache, k, v, slot.expand(c), positions, live)
    kv = masked.shape[-1]
    # Keys 0..K-1 of the one row: a small copy ([1, H, K, D]), the chunk's queries on it.
    k_row = layer.k_cache[:, :, :kv].index_select(0, slot)
    v_row = layer.v_cache[:, :, :kv].index_select(0, slot)
    out = _attend(layer, q.transpose(0, 1).unsqueeze(0), k_row, v_row, masked)  # [1, H, C, D]
    attn = F.linear(out[0].transpose(0, 1).reshape(c, -1), layer.wo)
    x = x + (attn if reduce is None else reduce(attn))
    return _mlp_forward(layer, x, reduce)


def _qkv(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys (both rotated) and values ``[T, heads, head_dim]`` of ``x [T, dim]``."""
    t = x.shape[0]
    q, k, v = (
        F.linear(rms_norm(x, layer.attn_norm, layer.eps), layer.wqkv)
        .view(t, 3, layer.n_heads, layer.head_dim)
        .unbind(1)
    )
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, rows: Tensor,
              positions: Tensor, live: Tensor | None) -> None:
    """``k``/``v [T, H, D]`` into the caches at ``(rows[t], :, positions[t])``; with ``live``,
    rows that are not live write back what the cache holds there."""
    if live is not None:
        # Not a live row: write back the old value (a gather, then the same scatter), so the
        # write keeps one static shape and touches nothing (as padded rows must).
        keep = live.view(-1, 1, 1)
        k = torch.where(keep, k, k_cache[rows, :, positions])
        v = torch.where(keep, v, v_cache[rows, :, positions])
    # In-place write of this step's key/value at (row, :, position[row]); the indices are
    # int64 tensors, so the write is a static-shape index_put_ (legal under capture).
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v


def _attend(layer: nn.Module, q: Tensor, k_cache: Tensor, v_cache: Tensor, masked: Tensor) -> Tensor:
    """``softmax(q k^T * scale, masked hidden) v`` for ``q [N, H, L, D]`` over keys
    ``0..K-1`` of ``k_cache``/``v_cache [N, H, >=K, D]`` (``K = masked.shape[-1]``)."""
    kv = masked.shape[-1]
    if kv != k_cache.shape[2]:  # keys 0..kv-1 only: a view, read in place
        k_cache, v_cache = k_cache[:, :, :kv], v_cache[:, :, :kv]
    scores = torch.matmul(q, k_cache.transpose(-1, -2)) * layer.scale
    # In place on the fresh scores: the functional masked_fill would clone them first.
    probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1)
    return torch.matmul(probs, v_cache)


def _mlp_forward(layer: nn.Module, x: Tensor, reduce: Callable[[Tensor], Tensor] | None) -> Tensor:
    """The second half of a block: ``x`` plus the (dense or MoE) MLP of its norm."""
    moe = layer.moe
    if moe is not None:
        return x + moe(rms_norm(x, layer.mlp_norm, layer.eps))
    gate, up = F.linear(rms_norm(x, layer.mlp_norm, layer.eps), layer.w_gate_up).chunk(2, dim=-1)
    mlp = F.linear(F.silu(gate) * up, layer.w_down)
    return x + (mlp if reduce is None else reduce(mlp))


def flat_block_forward(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor,
                       meta: SlotAttentionMeta,
                       reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """One decoder block over a flat step ``x [T, dim]``: the token-wise parts of
    :func:`block_forward` (norms, projections, rotary, MLP) around attention over the slot
    cache, which is the eager island :func:`~.slot_attention.slot_attention`."""
    t = x.shape[0]
    q, k, v = (
        F.linear(rms_norm(x, layer.attn_norm, layer.eps), layer.wqkv)
        .view(t, 3, layer.n_heads, layer.head_dim)
        .unbind(1)
    )
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    attn = F.linear(slot_attention(layer, q, k, v, meta).reshape(t, -1), layer.wo)
    x = x + (attn if reduce is None else reduce(attn))
    return _mlp_forward(layer, x, reduce)
