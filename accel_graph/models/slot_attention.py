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

The layout is the metadata's choice, so that attention needs few and cheap ops (it runs once
per layer; on a CPU its fixed cost is what graphs cannot remove): :meth:`SlotAttentionMeta.fill`
lays the decode tokens (segments of one token) first, sorted by slot, then the prompt chunks,
sorted by slot; ``sample_rows`` maps the sampled segments, in the caller's order, to their rows.

- this step's keys and values go into the cache with one ``index_put_`` each, at (slot,
  position) of every live token; padded tokens (a graph bucket's rows past the live tokens)
  write nowhere;
- decode tokens: queries ``q[:Sd]`` as they are, keys ``0..Ld-1`` of their slots (``Ld`` the
  longest decode sequence): a view of the cache when the slots are consecutive, else gathered;
  one ``scaled_dot_product_attention`` with a mask hiding keys past each token's position;
- one prompt chunk: its queries as they are, its slot's cache through a view, a causal mask
  offset by its start; several chunks: queries padded to the longest chunk, gathered back after;
- the outputs, in token order, are concatenated (zeros for padded tokens, never read back).

Masks are rows of a ``[max_seq, max_seq]`` table (row ``p``: 0 for keys ``0..p``, -inf after),
picked once per step by the first layer and reused by the others. No Python loop per token or
per segment runs in the island. Eager and graph steps call the same code.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..graphs.islands import eager_island

__all__ = ["SlotAttentionMeta", "check_step", "slot_attention"]


class _Group:
    """One attention group of a step, host side: ``rows`` cache rows of ``length`` queries
    each, keys ``0..kv-1``, the group's tokens at flat rows ``first..first+count-1``. The rows
    are the slots ``lo..lo+rows-1`` (``lo >= 0``: the cache is read through a view) or the
    slots in ``slot`` (``lo == -1``: gathered). ``padded``: queries padded to ``length`` per
    row (several chunks), gathered through ``src`` and back through ``dst``."""

    __slots__ = ("rows", "length", "kv", "lo", "first", "count", "padded", "slot", "qpos",
                 "src", "dst", "mask")

    def __init__(self, slot: Tensor, qpos: Tensor, src: Tensor, dst: Tensor) -> None:
        self.slot, self.qpos, self.src, self.dst = slot, qpos, src, dst
        self.reset()

    def reset(self) -> None:
        self.rows = self.length = self.kv = self.first = self.count = 0
        self.lo = -1
        self.padded = False
        self.mask: Tensor | None = None


def check_step(slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int], *,
               max_tokens: int, max_segments: int, max_seq: int, num_slots: int) -> None:
    """Validate one step: segment ``i`` feeds ``lengths[i]`` tokens into slot ``slots[i]`` at
    positions ``starts[i] ..``. ValueError (naming the segment) for what would otherwise be a
    silent wrong result or a write outside the cache: no segment or more than
    ``max_segments``, a slot used twice or outside ``0..num_slots-1``, more than ``max_tokens``
    tokens, a segment of no token or past ``max_seq``. Every executor path checks a step with
    it before any of the step runs."""
    n_seg = len(slots)
    if not 1 <= n_seg <= max_segments:
        raise ValueError(f"a step needs 1..{max_segments} segments, got {n_seg}")
    if len(set(slots)) != n_seg:
        raise ValueError(f"two segments of one step share a slot ({list(slots)}): each live "
                         f"request has its own slot and feeds one segment per step")
    total = sum(lengths)
    if total > max_tokens:
        raise ValueError(f"the step has {total} tokens, more than max_tokens={max_tokens}")
    for i, (slot, start, n) in enumerate(zip(slots, starts, lengths)):
        if n < 1 or start < 0 or start + n > max_seq:
            raise ValueError(
                f"segment {i}: {n} token(s) at positions {start}.. do not fit a sequence of "
                f"max_seq={max_seq} (need length >= 1, start >= 0, start + length <= max_seq)")
        if not 0 <= slot < num_slots:
            raise ValueError(f"segment {i}: slot {slot} is outside 0..{num_slots - 1}")


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
    (views of the buffer, valid up to the counts): ``tok_id``, ``tok_pos``, ``tok_slot`` (id,
    position and slot of each token, in the step's flat layout), ``sample_rows``
    (``[max_segments]``: the flat row of the last token of each sampled segment), the slots of
    decode rows and chunk rows where they are gathered (``dec_slot``, ``chunk_slot``), and,
    with several prompt chunks, their padded query layout (``chunk_src``: the token each padded
    row reads; ``chunk_qpos``: its position; ``chunk_dst``: the padded row of each chunk token).
    ``mask_table`` is ``[max_seq, max_seq]`` floats (256 KiB at ``max_seq=256``).
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
        chunk_rows = max(1, min(s, t // 2))  # a chunk has two tokens or more
        sizes = {"tok_slot": t, "tok_pos": t, "tok_id": t, "sample_rows": s,
                 "dec_slot": num_slots, "chunk_slot": chunk_rows, "chunk_qpos": chunk_rows * t,
                 "chunk_src": chunk_rows * t, "chunk_dst": t}
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
        self.dec = _Group(self.dec_slot, self.tok_pos, self.tok_pos, self.tok_pos)
        self.chunk = _Group(self.chunk_slot, self.chunk_qpos, self.chunk_src, self.chunk_dst)
        # Row p: the additive mask of a query at position p (0 for keys 0..p, -inf after), so
        # a step's masks are one index_select per group (max_seq**2 floats: 256 KiB at 256).
        self.mask_table = torch.zeros(max_seq, max_seq, device=self.device).masked_fill_(
            torch.ones(max_seq, max_seq, dtype=torch.bool, device=self.device).triu_(1),
            float("-inf"))
        self.version = 0
        self.clear()

    def clear(self) -> None:
        """An empty step: no live token, nothing written or attended (what a graph capture
        runs with, so capturing touches no cache)."""
        self.num_tokens = self.num_samples = 0
        self.dec.reset()
        self.chunk.reset()
        self.version += 1
        self._mask_version = -1

    def fill(self, slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]],
             sample: Sequence[bool] | None = None) -> None:
        """Describe one step: segment ``i`` feeds the token ids ``tokens[i]`` into slot
        ``slots[i]`` at positions ``starts[i] ..``. Fills ``tok_id``, ``tok_pos``, ``tok_slot``
        in the step's flat layout (decode tokens first, by slot, then prompt chunks, by slot:
        the module docstring), and ``sample_rows`` with the flat row of the last token of each
        segment with ``sample[i]`` true, in segment order (padding: 0); sets ``num_tokens`` and
        ``num_samples``.

        Validates what would otherwise be a silent wrong result or a write outside the cache
        (ValueError naming the segment): a slot outside the cache or used twice, no token, a
        segment past ``max_seq``, too many tokens or segments. On error nothing changes.
        """
        n_seg = len(slots)
        if not (n_seg == len(starts) == len(tokens)) or (sample is not None and len(sample) != n_seg):
            raise ValueError("slots, starts, tokens (and sample) need one entry per segment")
        lengths = [len(t) for t in tokens]
        check_step(slots, starts, lengths, max_tokens=self.max_tokens,
                   max_segments=self.max_segments, max_seq=self.max_seq, num_slots=self.num_slots)
        total = sum(lengths)
        decs: list[tuple[int, int]] = []  # (slot, segment)
        chunks: list[tuple[int, int]] = []
        for i, (slot, n) in enumerate(zip(slots, lengths)):
            (decs if n == 1 else chunks).append((slot, i))
        decs.sort()
        chunks.sort()
        # The flat layout: decode tokens, then chunks; last[i] = flat row of segment i's last token.
        tok_id: list[int] = []
        tok_pos: list[int] = []
        tok_slot: list[int] = []
        last = [0] * n_seg
        for slot, i in decs:
            last[i] = len(tok_id)
            tok_id += tokens[i]
            tok_pos.append(starts[i])
            tok_slot.append(slot)
        for slot, i in chunks:
            start, n = starts[i], lengths[i]
            tok_id += tokens[i]
            tok_pos += range(start, start + n)
            tok_slot += [slot] * n
            last[i] = len(tok_id) - 1
        host, at = self._host, self._offsets

        def put(name: str, values: Sequence[int]) -> None:
            a = at[name]
            host[a:a + len(values)] = array("q", values)

        dec, chunk = self.dec, self.chunk
        dec.reset()
        chunk.reset()
        sd = len(decs)
        if sd:
            dec.rows = dec.count = sd
            dec.length = 1
            dec.kv = max(tok_pos[:sd]) + 1
            if decs[-1][0] - decs[0][0] + 1 == sd:
                dec.lo = decs[0][0]  # consecutive slots: a view of the cache
            else:
                put("dec_slot", tok_slot[:sd])
        if chunks:
            sc = len(chunks)
            chunk.first, chunk.count, chunk.rows = sd, total - sd, sc
            chunk.kv = max(starts[i] + lengths[i] for _s, i in chunks)
            chunk.length = max(lengths[i] for _s, i in chunks)
            if chunks[-1][0] - chunks[0][0] + 1 == sc:
                chunk.lo = chunks[0][0]
            else:
                put("chunk_slot", [c[0] for c in chunks])
            if sc > 1:  # queries padded to the longest chunk (padded rows: key 0, token sd)
                chunk.padded = True
                tc = chunk.length
                src, qpos, dst = [sd] * (sc * tc), [0] * (sc * tc), []
                o = sd
                for r, (_slot, i) in enumerate(chunks):
                    n, start = lengths[i], starts[i]
                    src[r * tc:r * tc + n] = range(o, o + n)
                    qpos[r * tc:r * tc + n] = range(start, start + n)
                    dst += range(r * tc, r * tc + n)
                    o += n
                put("chunk_src", src)
                put("chunk_qpos", qpos)
                put("chunk_dst", dst)
        rows = [last[i] for i in range(n_seg) if sample is None or sample[i]]
        put("tok_id", tok_id)
        put("tok_pos", tok_pos)
        put("tok_slot", tok_slot)
        put("sample_rows", rows + [0] * (self.max_segments - len(rows)))
        self.buffer.copy_(self._host_tensor)  # one copy (host to device on GPUs)
        self.num_tokens = total
        self.num_samples = len(rows)
        self.version += 1

    def masks(self) -> tuple[Tensor | None, Tensor | None]:
        """The additive attention masks of this step (0 = attend, -inf = hidden): decode
        ``[rows, 1, 1, kv]`` and chunk ``[rows, 1, length, kv]``, a query at position ``p``
        seeing keys ``0..p``. Built on the first call of a step (the first layer), then reused;
        every row sees key 0 at least, so no row is all ``-inf``."""
        if self._mask_version != self.version:
            dec, chunk = self.dec, self.chunk
            if dec.rows:
                dec.mask = self.mask_table[:, :dec.kv].index_select(0, self.tok_pos[:dec.rows]) \
                    .view(dec.rows, 1, 1, dec.kv)
            if chunk.rows:
                qpos = (chunk.qpos[:chunk.rows * chunk.length] if chunk.padded
                        else self.tok_pos[chunk.first:chunk.first + chunk.count])
                chunk.mask = self.mask_table[:, :chunk.kv].index_select(0, qpos) \
                    .view(chunk.rows, 1, chunk.length, chunk.kv)
            self._mask_version = self.version
        return self.dec.mask, self.chunk.mask


def _cache_rows(cache: Tensor, g: _Group) -> Tensor:
    """The group's rows of ``cache``, keys ``0..kv-1``: a view, or gathered by slot."""
    if g.lo >= 0:
        return cache[g.lo:g.lo + g.rows, :, :g.kv]
    return cache[:, :, :g.kv].index_select(0, g.slot[:g.rows])


@eager_island
def slot_attention(layer: nn.Module, q: Tensor, k: Tensor, v: Tensor,
                   meta: SlotAttentionMeta) -> Tensor:
    """Attention of a flat step for one layer (an eager island): ``q``, ``k``, ``v`` are
    ``[T, H, D]`` in the layout of ``meta`` (``T`` >= ``meta.num_tokens``: rows past the live
    tokens are padding); writes the live tokens' keys and values into ``layer.k_cache``/
    ``layer.v_cache`` at (slot, position), then each live token attends over its slot's cache
    ``0..position``. Returns a fresh ``[T, H, D]`` tensor (padded rows are zeros)."""
    n = meta.num_tokens
    t, h, d = q.shape
    if n == 0:  # an empty step (graph capture): nothing to write or attend
        return torch.zeros_like(q)
    k_cache, v_cache = layer.k_cache, layer.v_cache
    slot, pos = meta.tok_slot[:n], meta.tok_pos[:n]
    # (slot, :, pos) <- k/v of each live token: the head dimension is a slice between the two
    # index tensors, so the indexed result is [n, H, D], the layout of k[:n].
    k_cache[slot, :, pos] = k[:n] if n < t else k
    v_cache[slot, :, pos] = v[:n] if n < t else v
    dec_mask, chunk_mask = meta.masks()
    scale = layer.scale
    parts = []
    dec, chunk = meta.dec, meta.chunk
    if dec.rows:
        out = F.scaled_dot_product_attention(
            q[:dec.rows].unsqueeze(2), _cache_rows(k_cache, dec), _cache_rows(v_cache, dec),
            attn_mask=dec_mask, scale=scale)
        parts.append(out.view(dec.rows, h, d))
    if chunk.rows:
        if chunk.padded:
            qc = q.index_select(0, chunk.src[:chunk.rows * chunk.length]) \
                .view(chunk.rows, chunk.length, h, d).transpose(1, 2)
        else:
            qc = q[chunk.first:chunk.first + chunk.count].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            qc, _cache_rows(k_cache, chunk), _cache_rows(v_cache, chunk), attn_mask=chunk_mask,
            scale=scale).transpose(1, 2)  # [rows, length, H, D]
        if chunk.padded:
            out = out.reshape(chunk.rows * chunk.length, h, d).index_select(0, chunk.dst[:chunk.count])
        else:
            out = out[0]
        parts.append(out)
    if n < t:
        parts.append(q.new_zeros(t - n, h, d))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
