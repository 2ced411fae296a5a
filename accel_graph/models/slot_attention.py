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


class _Group:
    """One attention group of a step (decode rows or chunk rows), host side: ``rows`` cache
    rows of ``length`` queries each, keys ``0..kv-1``; rows are the slots ``lo..lo+rows-1``
    (``lo >= 0``: the cache is read through a view, no copy) or the slots in ``slot``
    (``lo == -1``: gathered)."""

    __slots__ = ("rows", "length", "kv", "lo", "slot", "qpos", "src", "mask")

    def __init__(self, slot: Tensor, qpos: Tensor, src: Tensor) -> None:
        self.rows = self.length = self.kv = 0
        self.lo = -1
        self.slot, self.qpos, self.src = slot, qpos, src
        self.mask: Tensor | None = None


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
    of each token), ``tok_src`` (row of each token in the attention output of the decode rows
    and the chunk rows laid end to end; padded tokens 0); per group (``dec``, ``chunk``): its
    rows' slots, first query positions and the flat token each query row reads (``src``,
    padding 0); and, for the executor, ``tok_id`` (the token ids) and ``sample_rows``
    (``[max_segments]``: the flat index of the last token of each sampled segment).

    How rows are laid out: decode rows cover the slots ``lo..hi`` of the decode segments when
    that range is at most twice their number (the attention then reads the cache through a
    view: decode attention is bound by reading the cache, and a gather would copy it first),
    else one row per decode segment, gathered. Chunk rows (queries padded to the longest
    chunk) are one per chunk segment: a view when their slots are consecutive, else gathered
    (a row with no chunk would cost a whole padded attention).
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
        sizes = {"tok_slot": t, "tok_pos": t, "tok_src": t, "tok_id": t, "sample_rows": s,
                 "dec_slot": num_slots, "dec_qpos": num_slots, "dec_src": num_slots,
                 "chunk_slot": chunk_rows, "chunk_qpos": chunk_rows * t,
                 "chunk_src": chunk_rows * t}
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
        self.dec = _Group(self.dec_slot, self.dec_qpos, self.dec_src)
        self.chunk = _Group(self.chunk_slot, self.chunk_qpos, self.chunk_src)
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
        for g in (self.dec, self.chunk):
            g.rows = g.length = g.kv = 0
            g.lo = -1
            g.mask = None
        self.version += 1
        self._mask_version = -1

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
        decs: list[tuple[int, int, int]] = []  # (slot, position, flat index)
        chunks: list[tuple[int, int, int, int]] = []  # (slot, start, length, flat offset)
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
                decs.append((slot, start, off))
            else:
                chunks.append((slot, start, n, off))
            off += n
            if sample is not None and sample[i]:
                rows.append(off - 1)
        tok_src = [0] * self.max_tokens
        host, at = self._host, self._offsets

        def put(name: str, values: Sequence[int]) -> None:
            a = at[name]
            host[a:a + len(values)] = array("q", values)

        # Decode rows: a view over the slot range when it is dense enough, else gathered.
        dec = self.dec
        dec.rows = dec.length = dec.kv = 0
        dec.lo = -1
        if decs:
            lo = min(d[0] for d in decs)
            span = max(d[0] for d in decs) - lo + 1
            if span <= 2 * len(decs):
                dec.lo, dec.rows = lo, span
                d_slot = list(range(lo, lo + span))
                d_start = [0] * span  # rows without a decode token attend to key 0 alone
                d_src = [0] * span
                for slot, pos, t in decs:
                    d_start[slot - lo], d_src[slot - lo] = pos, t
                    tok_src[t] = slot - lo
            else:
                dec.rows = len(decs)
                d_slot = [d[0] for d in decs]
                d_start = [d[1] for d in decs]
                d_src = [d[2] for d in decs]
                for r, (_slot, _pos, t) in enumerate(decs):
                    tok_src[t] = r
            dec.length, dec.kv = 1, max(d[1] for d in decs) + 1
            put("dec_slot", d_slot)
            put("dec_qpos", d_start)
            put("dec_src", d_src)
        # Chunk rows: one per chunk, queries padded to the longest; a view when consecutive.
        chunk = self.chunk
        chunk.rows = chunk.length = chunk.kv = 0
        chunk.lo = -1
        if chunks:
            chunks.sort()  # by slot: consecutive slots then read the cache through a view
            sc, tc = len(chunks), max(c[2] for c in chunks)
            if chunks[-1][0] - chunks[0][0] + 1 == sc:
                chunk.lo = chunks[0][0]
            chunk.rows, chunk.length = sc, tc
            chunk.kv = max(c[1] + c[2] for c in chunks)
            c_src = [0] * (sc * tc)
            c_qpos = [0] * (sc * tc)  # padded query rows attend to key 0 alone
            base = dec.rows
            for r, (_slot, start, n, o) in enumerate(chunks):
                c_src[r * tc:r * tc + n] = range(o, o + n)
                c_qpos[r * tc:r * tc + n] = range(start, start + n)
                tok_src[o:o + n] = range(base + r * tc, base + r * tc + n)
            put("chunk_slot", [c[0] for c in chunks])
            put("chunk_qpos", c_qpos)
            put("chunk_src", c_src)
        put("tok_slot", tok_slot)
        put("tok_pos", tok_pos)
        put("tok_src", tok_src)
        put("tok_id", tokens or ())
        put("sample_rows", rows + [0] * (self.max_segments - len(rows)))
        self.buffer.copy_(self._host_tensor)  # one copy of the packed buffer (a host-to-device copy on GPUs)
        self.num_tokens = total
        self.num_samples = len(rows)
        self.version += 1

    def masks(self) -> tuple[Tensor | None, Tensor | None]:
        """The additive attention masks of this step (0 = attend, -inf = hidden): decode
        ``[rows, 1, 1, kv]`` and chunk ``[rows, 1, length, kv]``, a query at position ``p``
        seeing keys ``0..p``. Built on the first call of a step (the first layer), then reused;
        every row sees key 0 at least, so no row is all ``-inf``."""
        if self._mask_version != self.version:
            for g in (self.dec, self.chunk):
                g.mask = None
                if g.rows:
                    rows = self.mask_table[:, :g.kv].index_select(0, g.qpos[:g.rows * g.length])
                    g.mask = rows.view(g.rows, 1, g.length, g.kv)
            self._mask_version = self.version
        return self.dec.mask, self.chunk.mask


def _group_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, g: _Group,
                     scale: float) -> Tensor:
    """Attention of one group's query rows: ``[rows * length, H, D]``."""
    h, d = q.shape[1], q.shape[2]
    rows, length = g.rows, g.length
    qg = q.index_select(0, g.src[:rows * length]).view(rows, length, h, d).transpose(1, 2)
    if g.lo >= 0:  # consecutive slots: read the cache in place
        kg = k_cache[g.lo:g.lo + rows, :, :g.kv]
        vg = v_cache[g.lo:g.lo + rows, :, :g.kv]
    else:
        slots = g.slot[:rows]
        kg = k_cache[:, :, :g.kv].index_select(0, slots)
        vg = v_cache[:, :, :g.kv].index_select(0, slots)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
    return out.transpose(1, 2).reshape(rows * length, h, d)


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
    meta.masks()
    scale = layer.scale
    outs = [_group_attention(q, k_cache, v_cache, g, scale)
            for g in (meta.dec, meta.chunk) if g.rows]
    rows = outs[0] if len(outs) == 1 else torch.cat(outs)
    return rows.index_select(0, meta.tok_src[:q.shape[0]])
