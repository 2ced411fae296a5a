"""A tensor-parallel version of the bundled decoder, built by sharding a :class:`Decoder`.

Megatron-style layout, one shard per rank of a ``torch.distributed`` process group:

- attention: the fused ``wqkv`` is column-parallel (each rank keeps the q, k and v rows of its
  ``n_heads / world`` heads, and a KV cache of those heads only); ``wo`` is row-parallel (the
  columns that read those heads), so each rank's output projection is a partial sum, summed
  across ranks by one all-reduce;
- MLP: ``w_gate_up`` column-parallel (each rank keeps its slice of the gate rows and the same
  slice of the up rows), ``w_down`` row-parallel, then one all-reduce;
- the embedding, the norms, the rotary tables and the LM head are replicated.

So a decode step issues exactly two all-reduces per layer, in the same order on every rank, and
every rank ends the step with the same (replicated) hidden state and logits: greedy tokens equal
the single-process model's wherever its top-two logits are not within float32 rounding of each
other (the sums run in another order, so logits agree to tolerance, not bitwise).

The all-reduce is ``dist.all_reduce`` in place (``collective="c10d"``, the default) or the
functional ``torch.distributed._functional_collectives.all_reduce`` (``"functional"``); both are
legal inside an accel-graph capture on the recorder and inside CUDA graphs with NCCL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import ConfigError
from .decoder import Decoder, DecoderConfig
from .decoder_blocks import block_forward

__all__ = ["COLLECTIVES", "TPDecoder", "shard_state"]

#: The all-reduce flavours a TPDecoder can issue.
COLLECTIVES = ("c10d", "functional")


def _check_divisible(cfg: DecoderConfig, world: int) -> None:
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    if cfg.num_experts:
        raise ConfigError(
            f"tensor parallelism shards the dense decoder only; this config has "
            f"num_experts={cfg.num_experts} (a mixture of experts, which is not sharded): use "
            f"num_experts=0, or run the MoE decoder on one process")
    if cfg.n_heads % world or cfg.mlp_hidden % world:
        raise ConfigError(
            f"tensor parallelism over {world} ranks needs n_heads={cfg.n_heads} and "
            f"mlp_hidden={cfg.mlp_hidden} divisible by {world}; pick a world size that divides both"
        )


def shard_state(state: Mapping[str, Tensor], config: DecoderConfig, rank: int,
                world: int) -> dict[str, Tensor]:
    """Rank ``rank``'s shard of a :class:`Decoder` state dict (``Decoder.state_dict()``).

    Per layer ``i``: ``layers.i.wqkv`` keeps, of each of q, k, v, the rows of heads
    ``rank*h .. rank*h+h-1`` (``h = n_heads / world``); ``layers.i.wo`` the matching columns;
    ``layers.i.w_gate_up`` the rows ``rank*m .. rank*m+m-1`` of the gate half and the same rows of
    the up half (``m = mlp_hidden / world``); ``layers.i.w_down`` the matching columns. Every
    other entry is returned as is (replicated). Tensors are fresh copies (contiguous), never
    views of ``state``. Raises ConfigError for a world size that does not divide ``n_heads``
    and ``mlp_hidden`` or a rank outside ``0..world-1``.
    """
    _check_divisible(config, world)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside 0..{world - 1}")
    d, hd = config.dim, config.head_dim
    heads = config.n_heads // world
    cols = slice(rank * heads * hd, (rank + 1) * heads * hd)
    m = config.mlp_hidden // world
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        leaf = name.rsplit(".", 1)[-1]
        if not name.startswith("layers.") or leaf not in ("wqkv", "wo", "w_gate_up", "w_down"):
            out[name] = value.detach().clone()
            continue
        if leaf == "wqkv":  # rows laid out [3, n_heads, head_dim]
            qkv = value.view(3, config.n_heads, hd, d)[:, rank * heads:(rank + 1) * heads]
            shard = qkv.reshape(3 * heads * hd, d)
        elif leaf == "wo":  # input columns laid out [n_heads, head_dim]
            shard = value[:, cols]
        elif leaf == "w_gate_up":  # rows: gate [mlp_hidden], then up [mlp_hidden]
            shard = value.view(2, config.mlp_hidden, d)[:, rank * m:(rank + 1) * m].reshape(2 * m, d)
        else:  # w_down: input columns [mlp_hidden]
            shard = value[:, rank * m:(rank + 1) * m]
        out[name] = shard.contiguous().clone()
    return out


def _reducer(collective: str, group: Any) -> Callable[[Tensor], Tensor]:
    """The sum all-reduce over ``group`` a TP layer applies to its partial outputs."""
    if collective == "c10d":

        def reduce(x: Tensor) -> Tensor:
            dist.all_reduce(x, group=group)  # in place on the fresh partial sum
            return x

        return reduce
    if collective == "functional":
        import torch.distributed._functional_collectives as funcol

        group = dist.group.WORLD if group is None else group  # funcol takes no None

        def reduce_functional(x: Tensor) -> Tensor:
            # wait_tensor turns the AsyncCollectiveTensor into a plain tensor here, so the wait
            # sits right after the collective (in eager and in a capture alike).
            return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

        return reduce_functional
    raise ConfigError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


class _TPLayer(nn.Module):
    """One decoder block holding this rank's shard: the single-process block's ops
    (:func:`~accel_graph.models.decoder_blocks.block_forward`) with an all-reduce after attention and
    after the MLP."""

    def __init__(self, cfg: DecoderConfig, world: int, reduce: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        heads, m = cfg.n_heads // world, cfg.mlp_hidden // world
        self.eps = float(cfg.norm_eps)
        self.n_heads = heads  # local heads
        self.head_dim = hd
        self.scale = 1.0 / math.sqrt(hd)  # as the single-process block, to the bit
        self.reduce = reduce
        self.attn_norm = nn.Parameter(torch.empty(d))
        self.wqkv = nn.Parameter(torch.empty(3 * heads * hd, d))
        self.wo = nn.Parameter(torch.empty(d, heads * hd))
        self.mlp_norm = nn.Parameter(torch.empty(d))
        self.w_gate_up = nn.Parameter(torch.empty(2 * m, d))
        self.w_down = nn.Parameter(torch.empty(d, m))
        self.moe = None  # dense (block_forward reads it; MoE configs are refused)
        cache_shape = (cfg.max_batch, heads, cfg.max_seq, hd)
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, positions: Tensor, masked: Tensor,
        live: Tensor | None = None,
    ) -> Tensor:
        return block_forward(self, x, cos, sin, rows, positions, masked, self.reduce, live)


class TPDecoder(Decoder):
    """This rank's shard of a :class:`Decoder`, tensor-parallel over ``group``.

    Args:
        base: the single-process model whose weights are sharded (its state is copied, never
            shared; ``base`` stays usable).
        group: the process group (None: the default group). Must be initialised.
        collective: ``"c10d"`` (``dist.all_reduce`` in place) or ``"functional"``.
        rank, world_size: override the group's (for building shards without a group, e.g. to
            inspect them); both or neither. A step then still all-reduces over ``group``.

    ``decode_step``, ``prefill``, ``reset_cache`` and :func:`greedy_generate` work as on a
    ``Decoder`` (they are inherited). Every rank must call them with the same inputs in the
    same order (the all-reduces pair up by order); each rank's KV cache holds its own heads.
    Raises ConfigError when the world size does not divide ``n_heads`` and ``mlp_hidden``, or
    for an unknown ``collective``.
    """

    def __init__(self, base: Decoder, group: Any = None, *, collective: str = "c10d",
                 rank: int | None = None, world_size: int | None = None) -> None:
        # Not Decoder.__init__: that would draw a second full set of random weights only to
        # overwrite them. Everything Decoder's methods read is set here.
        nn.Module.__init__(self)
        if (rank is None) != (world_size is None):
            raise ConfigError("give rank and world_size together (or neither, to use the group's)")
        if rank is None or world_size is None:
            if not dist.is_available() or not dist.is_initialized():
                raise ConfigError(
                    "TPDecoder needs an initialised torch.distributed process group "
                    "(dist.init_process_group(...)), or explicit rank= and world_size="
                )
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        cfg = base.config
        self.config = cfg
        self.rank, self.world_size, self.group, self.collective = rank, world_size, group, collective
        reduce = _reducer(collective, group)
        _check_divisible(cfg, world_size)
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(_TPLayer(cfg, world_size, reduce) for _ in range(cfg.n_layers))
        self.final_norm = nn.Parameter(torch.empty(cfg.dim))
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self.eps = float(cfg.norm_eps)
        for name in ("rope_cos", "rope_sin", "key_positions", "row_index"):
            self.register_buffer(name, getattr(base, name).detach().clone(), persistent=False)
        self.load_state_dict(shard_state(base.state_dict(), cfg, rank, world_size))
        self.requires_grad_(False)
        self.eval()

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world_size={self.world_size}, collective={self.collective!r}"

