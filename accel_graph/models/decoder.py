"""A small decoder-only transformer with a static KV cache, built to be captured as a graph.

The model is bundled so the benchmark and the demo need no download: weights come from a fixed
seed through a local ``torch.Generator`` (the global RNG is never touched), so two builds with
the same :class:`DecoderConfig` are bitwise identical.

Capture-friendliness is the point of the design. :meth:`Decoder.decode_step` has static shapes
for a given batch size, reads positions only through int64 index tensors (``index_select``,
``index_put_``), builds its causal mask over the whole cache with tensor ops, and never calls
``.item()`` or branches on tensor values, so every aten op it issues is legal under CUDA graph
capture and under the recorder backend. Python floats (RMSNorm epsilon, attention scale, -inf)
are scalars, never tensors created per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .decoder_blocks import (
    block_forward,
    chunk_block_forward,
    flat_block_forward,
    rms_norm,
)
from .moe import MoeBlock
from .slot_attention import SlotAttentionMeta

__all__ = ["Decoder", "DecoderConfig", "greedy_generate"]


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the bundled decoder. With the defaults a batch-1 decode step takes under a
    millisecond eager on one CPU thread (about 0.8 ms on a 2-core AMD EPYC VM, roughly half of
    it dispatch overhead), so graph replay has overhead to remove. Weights use about 2.2 MB and
    the KV caches 2 MB, so the working set stays in cache."""

    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_hidden: int = 384
    max_seq: int = 128
    max_batch: int = 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    seed: int = 0
    #: 0: a dense gated MLP per layer (the default). ``E > 0``: a mixture-of-experts MLP
    #: (:mod:`.moe`): a router picks ``top_k`` of ``E`` experts (each a gated MLP of
    #: ``mlp_hidden``) per token, and the experts run in HF's host-reading loop, marked as an
    #: eager island.
    num_experts: int = 0
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings"
            )
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "mlp_hidden",
            "max_seq",
            "max_batch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be 0 (dense) or positive, got {self.num_experts}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class _Layer(nn.Module):
    """One pre-norm block: RMSNorm, attention over this layer's KV cache, RMSNorm, gated MLP
    (or, with ``num_experts``, a mixture-of-experts MLP: ``moe``)."""

    def __init__(self, cfg: DecoderConfig, gen: torch.Generator) -> None:
        super().__init__()
        d, h, std = cfg.dim, cfg.mlp_hidden, cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        self.eps = float(cfg.norm_eps)
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.wqkv = nn.Parameter(torch.randn(3 * d, d, generator=gen) * std)
        self.wo = nn.Parameter(torch.randn(d, d, generator=gen) * out_std)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.moe: MoeBlock | None = None  # an instance attribute: block_forward reads it
        if cfg.num_experts:
            self.moe = MoeBlock(cfg.num_experts, cfg.top_k, d, h, std, cfg.n_layers, gen)
        else:  # the dense MLP draws exactly what it always did (weights are pinned by seed)
            self.w_gate_up = nn.Parameter(torch.randn(2 * h, d, generator=gen) * std)
            self.w_down = nn.Parameter(torch.randn(d, h, generator=gen) * out_std)
        cache_shape = (cfg.max_batch, cfg.n_heads, cfg.max_seq, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, positions: Tensor, masked: Tensor,
        live: Tensor | None = None,
    ) -> Tensor:
        return block_forward(self, x, cos, sin, rows, positions, masked, live=live)


class Decoder(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm and LM head, with a static KV cache.

    The KV cache of each layer is a buffer of shape ``[max_batch, n_heads, max_seq, head_dim]``
    (float32, zero-initialised). A decode step at batch ``B`` uses rows ``0..B-1`` of it. All
    parameters have ``requires_grad=False``: this is an inference model.
    """

    def __init__(self, config: DecoderConfig | None = None) -> None:
        super().__init__()
        cfg = config or DecoderConfig()
        self.config = cfg
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.tok_emb = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.dim, generator=gen) * cfg.init_std
        )
        self.layers = nn.ModuleList(_Layer(cfg, gen) for _ in range(cfg.n_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.dim))
        self.lm_head = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.dim, generator=gen) * cfg.init_std
        )
        self.eps = float(cfg.norm_eps)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float64), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self.register_buffer("key_positions", torch.arange(cfg.max_seq), persistent=False)
        self.register_buffer("row_index", torch.arange(cfg.max_batch), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def decode_step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """One decode step for ``B`` sequences: returns logits ``[B, vocab_size]`` (float32).

        ``tokens`` and ``positions`` are int64 tensors of shape ``[B]`` with ``B <= max_batch``;
        row ``i`` is sequence ``i``, at position ``positions[i]`` (which must be ``< max_seq``;
        the value is not checked, as that would need a host sync). The step writes this token's
        key and value into every layer's cache at ``[i, :, positions[i], :]`` in place and
        attends over cache entries ``0..positions[i]``; nothing else in the cache changes. Only
        shapes and dtypes are validated, so the step is capturable.
        """
        self._check_decode_inputs("decode_step", tokens, positions)
        return self._decode(tokens, positions, None, self.config.max_seq)

    def slot_decode_step(self, tokens: Tensor, positions: Tensor, live: Tensor,
                         kv_len: int) -> Tensor:
        """A decode step over KV-cache *slots* ``0..B-1`` (row ``i`` is slot ``i``), in which
        only the ``live`` rows take part: returns logits ``[B, vocab_size]``, of which only the
        live rows are meaningful.

        The whole step, attention included, has static shapes, so a decode-only serving step
        is captured as one graph (vLLM's FULL graphs of FULL_AND_PIECEWISE; mixed steps use
        :meth:`flat_forward`, whose attention is an eager island). ``tokens``, ``positions``
        int64 ``[B]`` and ``live`` bool ``[B]``: a live row writes its key and value at
        ``(slot i, positions[i])`` and attends over its slot's keys ``0..positions[i]``; a row
        that is not live (a slot not in this step, or a graph bucket's padding) writes back the
        value its slot holds at ``positions[i]`` (give 0), so its slot is unchanged.
        ``kv_len`` (a Python int, part of the graph's shape): keys ``0..kv_len-1`` are read, so
        every live position must be below it; reading fewer keys is what makes short sequences
        cheap. Values are not checked (a host sync); shapes and dtypes are.
        """
        self._check_decode_inputs("slot_decode_step", tokens, positions)
        if live.shape != tokens.shape or live.dtype != torch.bool:
            raise ValueError(f"slot_decode_step wants live as bool [B], got {live.dtype} "
                             f"{tuple(live.shape)}")
        if isinstance(kv_len, bool) or not isinstance(kv_len, int) or not 1 <= kv_len <= self.config.max_seq:
            raise ValueError(f"kv_len must be an int in 1..max_seq={self.config.max_seq}, got {kv_len!r}")
        return self._decode(tokens, positions, live, kv_len)

    def slot_chunk_step(self, tokens: Tensor, positions: Tensor, slot: Tensor, live: Tensor,
                        sample_rows: Tensor, kv_len: int) -> Tensor:
        """One prompt chunk of the request in KV-cache row ``slot`` (int64 ``[1]``), as one
        static-shape step: returns the logits of the rows ``sample_rows`` (``[S, vocab]``).

        ``tokens``, ``positions`` int64 ``[C]`` and ``live`` bool ``[C]``: a live token writes
        its key and value at ``(slot, positions[i])``, then attends over the slot's keys
        ``0..positions[i]`` (the chunk's own included); a row that is not live (a bucket's
        padding) writes back what the slot holds at its position, so give it a position no
        live token of the chunk has. ``kv_len`` (a Python int): keys ``0..kv_len-1`` are read,
        so every position must be below it. The whole-graph counterpart of a prompt chunk in
        :meth:`flat_forward` (docs/serving.md); shapes and dtypes are checked, values are not.
        """
        c = tokens.shape[0]
        if tokens.dim() != 1 or positions.shape != tokens.shape or live.shape != tokens.shape \
                or live.dtype != torch.bool or slot.shape != (1,) or sample_rows.dim() != 1:
            raise ValueError(
                f"slot_chunk_step wants tokens, positions [C], live bool [C], slot [1] and "
                f"sample_rows [S], got {tuple(tokens.shape)}, {tuple(positions.shape)}, "
                f"{live.dtype} {tuple(live.shape)}, {tuple(slot.shape)}, {tuple(sample_rows.shape)}")
        if isinstance(kv_len, bool) or not isinstance(kv_len, int) or not 1 <= kv_len <= self.config.max_seq:
            raise ValueError(f"kv_len must be an int in 1..max_seq={self.config.max_seq}, got {kv_len!r}")
        x = self.tok_emb.index_select(0, tokens)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        keys = self.key_positions if kv_len == self.config.max_seq else self.key_positions[:kv_len]
        masked = (keys.unsqueeze(0) > positions.unsqueeze(1)).view(1, 1, c, kv_len)
        for layer in self.layers:
            x = chunk_block_forward(layer, x, cos, sin, slot, positions, masked, live,
                                    getattr(layer, "reduce", None))
        h = x.index_select(0, sample_rows)
        return F.linear(rms_norm(h, self.final_norm, self.eps), self.lm_head)

    def _check_decode_inputs(self, name: str, tokens: Tensor, positions: Tensor) -> None:
        if tokens.dim() != 1 or positions.shape != tokens.shape:
            raise ValueError(
                f"{name} wants tokens and positions of shape [B], got {tuple(tokens.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if tokens.dtype != torch.int64 or positions.dtype != torch.int64:
            raise ValueError(
                f"{name} wants int64 tokens and positions, got {tokens.dtype} and {positions.dtype}"
            )
        if not 1 <= tokens.shape[0] <= self.config.max_batch:
            raise ValueError(f"batch {tokens.shape[0]} is outside 1..max_batch={self.config.max_batch}")

    def _decode(self, tokens: Tensor, positions: Tensor, live: Tensor | None, kv: int) -> Tensor:
        b = tokens.shape[0]
        x = self.tok_emb.index_select(0, tokens)  # the embedding lookup, with an .out form
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        # Causal mask over keys 0..kv-1: key j is hidden from row i when j > pos[i].
        keys = self.key_positions if kv == self.config.max_seq else self.key_positions[:kv]
        masked = (keys.unsqueeze(0) > positions.unsqueeze(1)).view(b, 1, 1, kv)
        rows = self.row_index[:b]
        for layer in self.layers:
            x = layer(x, cos, sin, rows, positions, masked) if live is None else \
                layer(x, cos, sin, rows, positions, masked, live)
        return F.linear(rms_norm(x, self.final_norm, self.eps), self.lm_head)

    def decode_steps(self, tokens: Tensor, positions: Tensor, *, steps: int,
                     eos_id: int | None = None) -> tuple[Tensor, Tensor]:
        """Up to ``steps`` greedy decode steps in one ``torch.while_loop``; capturable.

        Starts from ``tokens``/``positions`` (int64 ``[B]``, as :meth:`decode_step`), feeds each
        greedy token back at the next position, and returns ``(new_tokens [B, steps], count)``:
        ``new_tokens[:, k]`` is the token chosen at step ``k`` (rows stopped at ``eos_id`` repeat
        it; columns at ``count`` and after are untouched, -1), ``count`` (int64 0-dim) how many
        steps ran. The loop stops after ``steps`` steps or as soon as every row has produced
        ``eos_id``: the condition is read on the device at replay, so a captured multi-step
        graph stops early without a host round trip per token. ``steps`` is the termination
        bound and must be a positive int.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"decode_steps needs steps= a positive int (the loop's bound), got {steps!r}")
        # The operator itself, not the ``torch.while_loop`` wrapper: in eager the wrapper first
        # runs Dynamo over the loop, and torch 2.11's Dynamo refuses a body that writes a
        # closed-over buffer (the KV cache, written in place by every step: "Encountered input
        # mutation during higher order op tracing"); 2.13+ accept it. The operator is what the
        # wrapper calls after tracing, so eager, the recorder and native captures see the same.
        while_loop = torch.ops.higher_order.while_loop

        b, dev = tokens.shape[0], tokens.device
        eos = torch.full((), -1 if eos_id is None else int(eos_id), dtype=torch.int64, device=dev)

        # Few ops per iteration (each is a kernel call at every step of a replayed loop): rows
        # still running are carried as ``live`` (not ``done``, which the predicate would negate
        # every time), and the new column is written with one index_copy.
        def cond(i: Tensor, tok: Tensor, pos: Tensor, out: Tensor, live: Tensor) -> Tensor:
            return (i < steps) & live.any()

        def body(i: Tensor, tok: Tensor, pos: Tensor, out: Tensor, live: Tensor) -> tuple[Tensor, ...]:
            nxt = self.decode_step(tok, pos).argmax(dim=-1)
            nxt = torch.where(live, nxt, tok)  # finished rows keep their EOS
            out = out.index_copy(1, i.reshape(1), nxt.unsqueeze(1))
            return i + 1, nxt, pos + 1, out, live & (nxt != eos)

        init = (torch.zeros((), dtype=torch.int64, device=dev), tokens.clone(), positions.clone(),
                torch.full((b, steps), -1, dtype=torch.int64, device=dev),
                torch.ones(b, dtype=torch.bool, device=dev))
        i, _, _, out, _ = while_loop(cond, body, init, ())
        return out, i

    def flat_metadata(self, max_tokens: int, max_segments: int | None = None) -> SlotAttentionMeta:
        """Static attention metadata for :meth:`flat_forward` steps of up to ``max_tokens``
        tokens and ``max_segments`` segments (default: one per slot, ``max_batch``), on the
        model's device."""
        cfg = self.config
        return SlotAttentionMeta(max_tokens, max_segments or cfg.max_batch, cfg.max_seq,
                                 cfg.max_batch, device=self.tok_emb.device)

    def flat_forward(self, tokens: Tensor, positions: Tensor, sample_rows: Tensor,
                     meta: SlotAttentionMeta) -> Tensor:
        """One flat mixed prefill/decode step over the slot KV cache: returns the logits of
        the rows ``sample_rows`` (``[S, vocab_size]``).

        ``tokens`` and ``positions`` are int64 ``[T]``: the step's tokens laid end to end
        (``T >= meta.num_tokens``; rows past the live tokens are padding: they write nowhere
        and are never read back); ``sample_rows`` int64 ``[S]`` are the flat indices of the
        tokens whose logits are wanted (the last token of each sampled segment; padding may
        repeat any row). ``meta`` (:meth:`flat_metadata`, filled for this step) says which slot
        and position each live token has; each layer writes every live token's key and value
        into its slot at its position and attends over that slot's cache ``0..position``
        (:func:`~.slot_attention.slot_attention`, an eager island in a capture). Rows of the
        cache are slots: ``decode_step`` rows and slots are the same cache. Capturable.
        """
        if tokens.dim() != 1 or positions.shape != tokens.shape or sample_rows.dim() != 1:
            raise ValueError(
                f"flat_forward wants tokens and positions of shape [T] and sample_rows [S], got "
                f"{tuple(tokens.shape)}, {tuple(positions.shape)} and {tuple(sample_rows.shape)}")
        x = self.tok_emb.index_select(0, tokens)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        for layer in self.layers:
            x = flat_block_forward(layer, x, cos, sin, meta, getattr(layer, "reduce", None))
        h = x.index_select(0, sample_rows)
        return F.linear(rms_norm(h, self.final_norm, self.eps), self.lm_head)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(tokens, positions)

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every layer's KV cache in place (the cache tensors keep their storage)."""
        for layer in self.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def prefill(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens [B, T]`` at positions ``0..T-1`` one step at a time; returns the logits
        of the last step ``[B, vocab_size]``. Uses :meth:`decode_step`, so it fills the same
        cache a captured decode step reads."""
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(
                f"prefill wants tokens of shape [B, T] with T >= 1, got {tuple(tokens.shape)}"
            )
        logits = None
        for t in range(tokens.shape[1]):
            pos = torch.full((tokens.shape[0],), t, dtype=torch.int64, device=tokens.device)
            logits = self.decode_step(tokens[:, t].contiguous(), pos)
        assert logits is not None
        return logits

    def num_parameters(self) -> int:
        """Number of parameter elements (buffers such as the KV cache are not counted)."""
        return sum(p.numel() for p in self.parameters())


StepFn = Callable[[Tensor, Tensor], Tensor]


def greedy_generate(
    model: Decoder, prompt: Tensor, max_new_tokens: int, step: StepFn | None = None
) -> Tensor:
    """Greedy decoding: returns ``[B, T + max_new_tokens]`` (the prompt, then new tokens).

    ``prompt`` is int64 ``[B, T]``. Every token, prompt included, goes through ``step(tokens,
    positions) -> logits`` (default: ``model.decode_step``), so a caller can pass a function that
    copies into static inputs and replays a captured graph. The cache is reset first. The next
    token is chosen on the device with ``argmax``; nothing is read back to the host.
    """
    cfg = model.config
    if prompt.dim() != 2 or prompt.shape[1] < 1 or prompt.dtype != torch.int64:
        raise ValueError(
            f"prompt must be int64 [B, T] with T >= 1, got {prompt.dtype} {tuple(prompt.shape)}"
        )
    b, t = prompt.shape
    if t + max_new_tokens > cfg.max_seq:
        raise ValueError(
            f"prompt length {t} + {max_new_tokens} new tokens exceeds max_seq={cfg.max_seq}"
        )
    step = step or model.decode_step
    model.reset_cache()
    out = [prompt[:, i] for i in range(t)]
    with torch.inference_mode():
        logits = None
        for i in range(t + max_new_tokens - 1):
            pos = torch.full((b,), i, dtype=torch.int64, device=prompt.device)
            logits = step(out[i].contiguous(), pos)
            if i >= t - 1:
                out.append(logits.argmax(dim=-1))
    return torch.stack(out, dim=1)
