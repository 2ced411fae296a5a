"""Attention of a flat mixed prefill/decode step over a slot KV cache: the step's metadata and
the eager island that reads it.

A flat step lays the tokens of all its segments end to end (``[num_tokens]``): a chunk of one
request's prompt, the one decode token of another, ... Each segment belongs to a KV-cache
*slot* (a row of every layer's ``k_cache``/``v_cache`` ``[slots, heads, max_seq, head_dim]``)
and starts at a position (the tokens already cached). The token-wise parts of the model are
graph material; attention over sequences of different lengths is not (its shapes follow the
live lengths), so :func:`slot_attention` is an eager island (:func:`accel_graph.eager_island`):
in a captured graph it runs eagerly between the captured pieces, with the live lengths, reading
the metadata of :class:`SlotAttentionMeta` from static tensors the executor fills each step.

How it is vectorised (no per-token or per-segment Python loop): the segments split in two
groups, decode segments (one token) and chunk segments (more than one: prefill chunks).

- this step's keys and values go into the cache with one ``index_put_`` each, at (slot,
  position) of every live token; padded tokens (a graph bucket's rows past the live tokens)
  write nowhere;
- decode group: queries ``[Sd, H, 1, D]``, each slot's keys ``0..Ld-1`` gathered
  (``[Sd, H, Ld, D]``, ``Ld`` the longest decode sequence), a mask hiding keys past each
  token's position, one ``scaled_dot_product_attention``;
- chunk group: queries padded to ``[Sc, H, Tc, D]`` (``Tc`` the longest chunk), keys
  ``0..Lc-1`` of each slot, a causal mask offset by each chunk's start, one attention call;
- the outputs of both groups are gathered back into flat token order with one ``index_select``
  (padded tokens read row 0: finite values nobody reads back).

The masks depend only on the step, so they are built once per step (first layer) and reused by
every layer. Eager and graph steps call the same code.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..graphs.islands import eager_island

__all__ = ["SlotAttentionMeta", "slot_attention"]


class SlotAttentionMeta:
    """The per-step attention metadata of a flat step, in static int64 tensors, plus the
    step's host-side counts (the live lengths the island slices with).

    Args:
        max_tokens: the most tokens one step may carry (the largest graph bucket).
        max_segments: the most segments one step may carry.
        max_seq: the cache length (a segment's ``start + len`` may not exceed it).
        num_slots: the cache's slots (rows); a segment's slot must be below it.
        device: where the tensors live (the model's device).

    :meth:`fill` writes one step (one host-to-device copy of one packed buffer); its tensors
    keep their storage for the object's life, so graphs capture them by reference. Fields
    (views of the buffer, valid up to the counts): ``tok_slot``/``tok_pos`` (slot and position
    of each token), ``tok_src`` (row of each token in the attention output of the two groups
    laid end to end; padded tokens 0), ``dec_tok``/``dec_slot``/``dec_pos`` (per decode segment:
    its token's flat index, slot, position), ``chunk_slot``/``chunk_start`` (per chunk segment),
    ``chunk_src`` (``[Sc * Tc]``: the flat token each padded chunk row reads; padding 0);
    and, for the executor, ``tok_id`` (the token ids) and ``sample_rows`` (``[max_segments]``).
    """

    def __init__(self, max_tokens: int, max_segments: int, max_seq: int, num_slots: int,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_tokens", max_tokens), ("max_segments", max_segments),
                            ("max_seq", max_seq), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_tokens, self.max_segments, self.max_seq = max_tokens, max_segments, max_seq
        self.num_slots = num_slots
        self.device = torch.device(device)
        t, s = max_tokens, max_segments
        # chunk_src holds at most (segments with >1 token) * (longest chunk) rows; both are
        # bounded by max_tokens // 2 * max_tokens, kept small by capping with max_segments.
        chunk_rows = min(s, t // 2 or 1) * t
        sizes = {"tok_slot": t, "tok_pos": t, "tok_src": t, "tok_id": t, "dec_tok": s,
                 "dec_slot": s, "dec_pos": s, "chunk_slot": s, "chunk_start": s,
                 "sample_rows": s, "chunk_src": chunk_rows}
        self._sizes = sizes
        total = sum(sizes.values())
        self.buffer = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._host = array("q", bytes(8 * total))
        self._host_tensor = torch.frombuffer(self._host, dtype=torch.int64)
        self._offsets: dict[str, int] = {}
        at = 0
        for name, n in sizes.items():
            setattr(self, name, self.buffer[at:at + n])
            self._offsets[name] = at
            at += n
        self.key_positions = torch.arange(max_seq, device=self.device)
        self.clear()

    # host counts -------------------------------------------------------------------------
    def clear(self) -> None:
        """An empty step: no live token, nothing written or attended (what a graph capture
        runs with, so capturing touches no cache)."""
        self.num_tokens = self.num_samples = 0
        self.dec_count = self.dec_len = 0
        self.chunk_count = self.chunk_len = self.chunk_kv = 0
        self.version = getattr(self, "version", 0) + 1
        self._masks: tuple[int, Tensor | None, Tensor | None] = (-1, None, None)

    def fill(self, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
             tokens: Sequence[int] | None = None, sample: Sequence[bool] | None = None) -> None:
        """Describe one step: segment ``i`` feeds ``lengths[i]`` tokens into slot ``slots[i]`` at
        positions ``starts[i] ..``, its tokens laid out after those of segments ``0..i-1``.
        ``tokens`` (the flat token ids, optional) fills ``tok_id``; ``sample`` (per segment,
        optional) fills ``sample_rows`` with the flat index of the last token of each sampled
        segment, in segment order (padding: 0), and sets ``num_samples``.

        Validates what would otherwise be a silent wrong result or a write outside the cache
        (ValueError naming the segment): a slot outside the cache or used twice, a length < 1,
        a segment past ``max_seq``, too many tokens or segments. On error nothing changes.
        """
        n_seg = len(slots)
        if not (n_seg == len(starts) == len(lengths)) or (sample is not None and len(sample) != n_seg):
            raise ValueError("slots, starts, lengths (and sample) need one entry per segment")
        if not 1 <= n_seg <= self.max_segments:
            raise ValueError(f"a step needs 1..{self.max_segments} segments, got {n_seg}")
        if len(set(slots)) != n_seg:
            raise ValueError(f"two segments of one step share a slot ({list(slots)}): each live "
                             f"request has its own slot and feeds one segment per step")
        total = sum(lengths)
        if total > self.max_tokens:
            raise ValueError(f"the step has {total} tokens, more than max_tokens={self.max_tokens}")
        if tokens is not None and len(tokens) != total:
            raise ValueError(f"{len(tokens)} token ids for {total} tokens")
        tok_slot: list[int] = []
        tok_pos: list[int] = []
        dec_tok: list[int] = []
        dec_slot: list[int] = []
        dec_pos: list[int] = []
        chunks: list[tuple[int, int, int, int]] = []  # (flat offset, slot, start, length)
        rows: list[int] = []
        off = 0
        for i, (slot, start, n) in enumerate(zip(slots, starts, lengths)):
            if n < 1 or start < 0 or start + n > self.max_seq:
                raise ValueError(
                    f"segment {i}: {n} token(s) at positions {start}.. do not fit a sequence of "
                    f"max_seq={self.max_seq} (need length >= 1, start >= 0, start + length <= "
                    f"max_seq)")
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"segment {i}: slot {slot} is outside 0..{self.num_slots - 1}")
            tok_slot += [slot] * n
            tok_pos += range(start, start + n)
            if n == 1:
                dec_tok.append(off)
                dec_slot.append(slot)
                dec_pos.append(start)
            else:
                chunks.append((off, slot, start, n))
            off += n
            if sample is not None and sample[i]:
                rows.append(off - 1)
        sd, sc = len(dec_tok), len(chunks)
        tc = max((c[3] for c in chunks), default=0)
        if sc * tc > self._sizes["chunk_src"]:
            raise ValueError(
                f"{sc} prompt chunks padded to {tc} tokens need {sc * tc} rows, more than this "
                f"metadata holds ({self._sizes['chunk_src']}); lower the step's token budget")
        # Output row of each token: decode segments first (row d), then the chunk rows
        # (sd + c * tc + i); rows past the live tokens read row 0. And the token each padded
        # chunk row reads (padding: token 0).
        tok_src = [0] * self.max_tokens
        for d, t in enumerate(dec_tok):
            tok_src[t] = d
        chunk_src = [0] * (sc * tc)
        for c, (o, _slot, _start, n) in enumerate(chunks):
            tok_src[o:o + n] = range(sd + c * tc, sd + c * tc + n)
            chunk_src[c * tc:c * tc + n] = range(o, o + n)
        host, at = self._host, self._offsets
        # Staged in one host array (slice stores are C loops), then one copy to the buffer.
        for name, values in (("tok_slot", tok_slot), ("tok_pos", tok_pos), ("tok_src", tok_src),
                             ("dec_tok", dec_tok), ("dec_slot", dec_slot), ("dec_pos", dec_pos),
                             ("chunk_slot", [c[1] for c in chunks]),
                             ("chunk_start", [c[2] for c in chunks]), ("chunk_src", chunk_src),
                             ("tok_id", tokens or ()),
                             ("sample_rows", rows + [0] * (self.max_segments - len(rows)))):
            a = at[name]
            host[a:a + len(values)] = array("q", values)
        self.buffer.copy_(self._host_tensor)
        self.num_tokens = total
        self.num_samples = len(rows)
        self.dec_count, self.dec_len = sd, (max(dec_pos) + 1 if dec_pos else 0)
        self.chunk_count, self.chunk_len = sc, tc
        self.chunk_kv = max((c[2] + c[3] for c in chunks), default=0)
        self.version += 1

    # masks, once per step ----------------------------------------------------------------
    def masks(self) -> tuple[Tensor | None, Tensor | None]:
        """The boolean attention masks of this step (True = attend): decode ``[Sd, 1, 1, Ld]``
        and chunk ``[Sc, 1, Tc, Lc]``; built on the first call of a step, then reused."""
        version, dec, chunk = self._masks
        if version == self.version:
            return dec, chunk
        dec = chunk = None
        if self.dec_count:
            keys = self.key_positions[:self.dec_len]
            dec = (keys <= self.dec_pos[:self.dec_count, None]).view(
                self.dec_count, 1, 1, self.dec_len)
        if self.chunk_count:
            keys = self.key_positions[:self.chunk_kv]
            rows = self.key_positions[:self.chunk_len]
            last = self.chunk_start[:self.chunk_count, None] + rows  # [Sc, Tc] query positions
            chunk = (keys <= last[:, :, None]).unsqueeze(1)
        self._masks = (self.version, dec, chunk)
        return dec, chunk


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@eager_island
def slot_attention(layer: nn.Module, q: Tensor, k: Tensor, v: Tensor,
                   meta: SlotAttentionMeta) -> Tensor:
    """Attention of a flat step for one layer (an eager island): ``q``, ``k``, ``v`` are
    ``[T, H, D]`` (``T`` >= ``meta.num_tokens``: rows past the live tokens are padding); writes
    the live tokens' keys and values into ``layer.k_cache``/``layer.v_cache`` at (slot,
    position), then each live token attends over its slot's cache ``0..position``. Returns a
    fresh ``[T, H, D]`` tensor (padded rows hold finite values nobody reads)."""
    n = meta.num_tokens
    if n == 0:  # an empty step (graph capture): nothing to write or attend
        return torch.zeros_like(q)
    k_cache, v_cache = layer.k_cache, layer.v_cache
    slot, pos = meta.tok_slot[:n], meta.tok_pos[:n]
    # (slot, :, pos) <- k/v of each live token: the head dimension is a slice between the two
    # index tensors, so the indexed result is [n, H, D], the layout of k[:n].
    k_cache[slot, :, pos] = k[:n]
    v_cache[slot, :, pos] = v[:n]
    dec_mask, chunk_mask = meta.masks()
    scale = layer.scale
    outs = []
    if dec_mask is not None:
        sd, ld = meta.dec_count, meta.dec_len
        qd = q.index_select(0, meta.dec_tok[:sd]).unsqueeze(2)  # [Sd, H, 1, D]
        slots = meta.dec_slot[:sd]
        kd = k_cache[:, :, :ld].index_select(0, slots)
        vd = v_cache[:, :, :ld].index_select(0, slots)
        outs.append(_attend(qd, kd, vd, dec_mask, scale).squeeze(2))  # [Sd, H, D]
    if chunk_mask is not None:
        sc, tc, lc = meta.chunk_count, meta.chunk_len, meta.chunk_kv
        h, d = q.shape[1], q.shape[2]
        qc = q.index_select(0, meta.chunk_src[:sc * tc]).view(sc, tc, h, d).transpose(1, 2)
        slots = meta.chunk_slot[:sc]
        kc = k_cache[:, :, :lc].index_select(0, slots)
        vc = v_cache[:, :, :lc].index_select(0, slots)
        oc = _attend(qc, kc, vc, chunk_mask, scale)  # [Sc, H, Tc, D]
        outs.append(oc.transpose(1, 2).reshape(sc * tc, h, d))
    rows = outs[0] if len(outs) == 1 else torch.cat(outs)
    return rows.index_select(0, meta.tok_src[:q.shape[0]])
