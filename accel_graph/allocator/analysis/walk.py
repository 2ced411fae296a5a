"""The event walk behind ``accel-alloc inspect``: alloc/free pairing, the segments alive at a
moment, block sizes and per-event byte curves (vectorised with numpy; :mod:`.inspect` states
the definitions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..alloc_conf import parse_torch_version, rules_for, settings_from_snapshot
from ..devices import config_dialect_of
from ..sim.profiles import profile_for, resolve_profile, round_requests
from ..traces.actions import (
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    A_MAP,
    A_SEG_ALLOC,
    A_SEG_FREE,
    SEGMENT_ACTIONS,
)

__all__ = [
    "ACTIVE_STATES",
    "NEVER",
    "Layout",
    "Pairs",
    "Prepared",
    "Seg",
    "SegmentWalk",
    "curve",
    "final_segments",
    "prepare",
]

#: "No such event": the index of a pairing that never happens (sorts after every real index).
NEVER = np.iinfo(np.int64).max
#: Block states of a snapshot that hold bytes (everything but ``inactive``).
ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")

# ------------------------------------------------------------------------------------------
# event pairing (vectorised)


@dataclass
class Pairs:
    """Each ``alloc`` (in event order) with its ``free_requested``/``free_completed``
    (``NEVER``: none), and the pre-existing blocks the trace frees without allocating them."""

    alloc_idx: np.ndarray
    fr_idx: np.ndarray
    fc_idx: np.ndarray
    pre_addr: np.ndarray
    pre_size: np.ndarray  # requested size (the free event's size)
    pre_stream: np.ndarray
    pre_fr: np.ndarray
    pre_fc: np.ndarray
    touched: np.ndarray  # every address of an alloc/free event (sorted unique)


def _next_of(mask: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Position of the next True of ``mask`` strictly after each position within the same group
    (``NEVER`` when none)."""
    n = len(mask)
    pos = np.where(mask, np.arange(n, dtype=np.int64), NEVER)
    nxt = np.minimum.accumulate(pos[::-1])[::-1]
    out = np.full(n, NEVER, np.int64)
    if n > 1:
        out[:-1] = nxt[1:]
    ok = out != NEVER
    ok[ok] = group[out[ok]] == group[ok]
    return np.where(ok, out, NEVER)


def _pair(ev: np.ndarray) -> Pairs:
    act = ev["action"]
    idx = np.flatnonzero((act == A_ALLOC) | (act == A_FREE_REQ) | (act == A_FREE))
    addr = ev["addr"][idx]
    order = np.lexsort((idx, addr))  # by address, then time
    i_s, a_s, k_s = idx[order], addr[order], act[idx][order]
    n = len(i_s)
    new_group = np.ones(n, bool)
    if n > 1:
        new_group[1:] = a_s[1:] != a_s[:-1]
    group = np.cumsum(new_group)
    is_alloc, is_fr, is_fc = k_s == A_ALLOC, k_s == A_FREE_REQ, k_s == A_FREE
    next_alloc = _next_of(is_alloc, group)
    next_fr = _next_of(is_fr, group)
    next_fc = _next_of(is_fc, group)
    ap = np.flatnonzero(is_alloc)
    bound = next_alloc[ap]
    fr_p, fc_p = next_fr[ap], next_fc[ap]
    fr_p = np.where(fr_p < bound, fr_p, NEVER)
    fc_p = np.where(fc_p < bound, fc_p, NEVER)
    # a free_completed with no free_requested before it: treat it as both
    fr_p = np.where((fr_p == NEVER) | ((fc_p != NEVER) & (fc_p < fr_p)), fc_p, fr_p)

    def to_idx(p: np.ndarray) -> np.ndarray:
        out = np.full(len(p), NEVER, np.int64)
        ok = p != NEVER
        out[ok] = i_s[p[ok]]
        return out

    # pre-existing: frees in an address group before the group's first alloc
    seen = np.maximum.accumulate(np.where(is_alloc, group, 0)) == group if n else is_alloc
    pre = ~seen & ~is_alloc
    pre_fr_pos = np.flatnonzero(pre & is_fr)
    pre_fc_pos = np.flatnonzero(pre & is_fc)
    _, first_fr = np.unique(group[pre_fr_pos], return_index=True)
    _, first_fc = np.unique(group[pre_fc_pos], return_index=True)
    fr_pos, fc_pos = pre_fr_pos[first_fr], pre_fc_pos[first_fc]
    groups = np.union1d(group[fr_pos], group[fc_pos])
    g_fr = np.full(len(groups), NEVER, np.int64)
    g_fc = np.full(len(groups), NEVER, np.int64)
    g_fr[np.searchsorted(groups, group[fr_pos])] = i_s[fr_pos]
    g_fc[np.searchsorted(groups, group[fc_pos])] = i_s[fc_pos]
    g_fr = np.minimum(g_fr, g_fc)  # a lone free_completed frees it too
    first_ev = np.minimum(g_fr, g_fc)
    by_time = np.argsort(i_s[ap], kind="stable")
    return Pairs(
        alloc_idx=i_s[ap][by_time],
        fr_idx=to_idx(fr_p)[by_time],
        fc_idx=to_idx(fc_p)[by_time],
        pre_addr=ev["addr"][first_ev].astype(np.int64),
        pre_size=ev["size"][first_ev].astype(np.int64),
        pre_stream=ev["stream"][first_ev],
        pre_fr=g_fr,
        pre_fc=g_fc,
        touched=np.unique(addr).astype(np.int64),
    )


# ------------------------------------------------------------------------------------------
# segments


@dataclass
class Seg:
    """One segment alive at a moment of the walk."""

    addr: int
    size: int
    stream: int
    private: bool
    expandable: bool
    kind: str | None  # "small" | "large" | None (unknown)


def _private(pool_id: Any) -> bool:
    if isinstance(pool_id, (list, tuple)):
        return any(isinstance(x, int) and x != 0 for x in pool_id)
    return isinstance(pool_id, int) and pool_id != 0


def final_segments(trace: Any, device: int) -> list[dict[str, Any]]:
    """The trace's final snapshot segments on ``device``."""
    return [s for s in trace.segments if int(s.get("device", device)) == device]


def _add_range(ranges: list[Seg], new: Seg) -> list[Seg]:
    """Add a mapped range, merging with touching ranges of the same stream and pool."""
    out = sorted(ranges + [new], key=lambda s: s.addr)
    merged: list[Seg] = []
    for s in out:
        last = merged[-1] if merged else None
        if (last is not None and s.addr <= last.addr + last.size and last.stream == s.stream
                and last.private == s.private):
            end = max(last.addr + last.size, s.addr + s.size)
            last.size = end - last.addr
            last.kind = last.kind or s.kind
        else:
            merged.append(Seg(s.addr, s.size, s.stream, s.private, True, s.kind))
    return merged


def _sub_range(ranges: list[Seg], lo: int, hi: int) -> list[Seg]:
    out = []
    for s in ranges:
        a, b = s.addr, s.addr + s.size
        if b <= lo or a >= hi:
            out.append(s)
            continue
        if a < lo:
            out.append(Seg(a, lo - a, s.stream, s.private, True, s.kind))
        if b > hi:
            out.append(Seg(hi, b - hi, s.stream, s.private, True, s.kind))
    return out


class SegmentWalk:
    """Segments at the start of the trace (final segments with the segment events undone), and
    at any later event count (start plus the segment events before it)."""

    def __init__(self, trace: Any, ev: np.ndarray, device: int) -> None:
        final = final_segments(trace, device)
        self.final_kind = {int(s["address"]): s.get("segment_type") for s in final}
        self.final_private = {int(s["address"]): _private(s.get("segment_pool_id")) for s in final}
        native: dict[int, Seg] = {}
        mapped: list[Seg] = []
        for s in final:
            seg = Seg(int(s["address"]), int(s["total_size"]), int(s.get("stream", 0)),
                       _private(s.get("segment_pool_id")), bool(s.get("is_expandable")),
                       s.get("segment_type") if s.get("segment_type") in ("small", "large")
                       else None)
            if seg.expandable:
                mapped = _add_range(mapped, seg)
            else:
                native[seg.addr] = seg
        self.idx = np.flatnonzero(np.isin(ev["action"], SEGMENT_ACTIONS))
        seg_ev = ev[self.idx]
        self.rows = list(zip(seg_ev["action"].tolist(), seg_ev["addr"].tolist(),
                             seg_ev["size"].tolist(), seg_ev["stream"].tolist(),
                             seg_ev["pool"].tolist(), strict=True))
        for act, addr, size, stream, pool in reversed(self.rows):
            if act == A_SEG_ALLOC:
                native.pop(addr, None)
            elif act == A_SEG_FREE:
                native[addr] = self._new(addr, size, stream, pool, False)
            elif act == A_MAP:
                mapped = _sub_range(mapped, addr, addr + size)
            else:
                mapped = _add_range(mapped, self._new(addr, size, stream, pool, True))
        self.start_native = native
        self.start_mapped = mapped

    def _new(self, addr: int, size: int, stream: int, pool: int, expandable: bool) -> Seg:
        private = pool != 0 or self.final_private.get(addr, False)
        return Seg(addr, size, stream, private, expandable, self.final_kind.get(addr))

    def at(self, k: int) -> list[Seg]:
        """Segments after the first ``k`` events, sorted by address."""
        native = {a: Seg(**vars(s)) for a, s in self.start_native.items()}
        mapped = [Seg(**vars(s)) for s in self.start_mapped]
        n = int(np.searchsorted(self.idx, k))
        for act, addr, size, stream, pool in self.rows[:n]:
            if act == A_SEG_ALLOC:
                native[addr] = self._new(addr, size, stream, pool, False)
            elif act == A_SEG_FREE:
                native.pop(addr, None)
            elif act == A_MAP:
                mapped = _add_range(mapped, self._new(addr, size, stream, pool, True))
            else:
                mapped = _sub_range(mapped, addr, addr + size)
        return sorted(list(native.values()) + mapped, key=lambda s: s.addr)


# ------------------------------------------------------------------------------------------
# the analysis


def rounding_choice(trace: Any, profile: str | None = None,
                    torch: str | None = None) -> tuple[Any, Any, str]:
    """The rounding profile, config-parser rules and why, as ``accel-alloc``'s other commands
    choose them: ``torch`` (a version) picks both, ``profile`` overrides the profile; neither:
    the newest profile of the trace's device and its rules. Raises ValueError (a
    :class:`~accel_graph.errors.ConfigError` for an unreadable ``torch``, KeyError's message
    for an unknown profile) naming what to pass."""
    if torch is not None:
        v = parse_torch_version(torch)
        rules = rules_for(v)
        prof = (resolve_profile(profile, trace.device_type) if profile is not None
                else profile_for(v, trace.device_type or "cuda"))
        return prof, rules, f"torch {v[0]}.{v[1]} given"
    prof = resolve_profile(profile, trace.device_type)
    rules = rules_for(prof.torch_versions[1])
    (a, b), (c, d) = prof.torch_versions
    span = f"{a}.{b} or later" if d >= 99 else (f"{a}.{b}" if (a, b) == (c, d) else f"{a}.{b}-{c}.{d}")
    return prof, rules, f"profile {prof.name} (torch {span})"


def _block_sizes(trace: Any, sizes: np.ndarray, prof: Any = None,
                 rules: Any = None) -> tuple[np.ndarray, str]:
    """Block sizes of requests under ``prof``'s rounding rule (default: the trace's device's
    newest) and the recorded roundup_power2_divisions (read with ``rules``), plus the profile
    name used."""
    prof = prof if prof is not None else resolve_profile(None, trace.device_type)
    sizes = np.maximum(np.asarray(sizes, np.int64), 1)
    divisions = None
    if trace.allocator_settings:
        try:
            dev = config_dialect_of(trace.device_type)
            s = settings_from_snapshot(trace.allocator_settings, dev, rules)
            if any(d > 1 for d in s.roundup_power2_divisions):
                divisions = s
        except Exception:  # settings we cannot read: plain rounding
            divisions = None
    if divisions is None or not len(sizes):
        return round_requests(sizes, prof), prof.name
    out = np.empty(len(sizes), np.int64)
    interval = np.clip(np.floor(np.log2(np.maximum(sizes, 1))).astype(np.int64) - 20, 0, 15)
    for i in np.unique(interval).tolist():
        m = interval == i
        out[m] = round_requests(sizes[m], prof, divisions.roundup_power2_divisions[i])
    return out, prof.name


def curve(n: int, start: int, plus_idx: np.ndarray, plus: np.ndarray,
          minus_idx: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Values at states 0..n (state k: after the first k events)."""
    delta = np.zeros(n + 1, np.int64)
    ok = plus_idx != NEVER
    np.add.at(delta, plus_idx[ok] + 1, plus[ok])
    ok = minus_idx != NEVER
    np.add.at(delta, minus_idx[ok] + 1, -minus[ok])
    return start + np.cumsum(delta)


@dataclass
class Prepared:
    """What :func:`prepare` computes once per trace and device, for every moment of interest."""

    pairs: Pairs
    req: np.ndarray  # requested size per alloc (event order)
    blk: np.ndarray  # block size per alloc
    pre_blk: np.ndarray  # block size per pre-existing freed block
    untouched: list[tuple[int, int, int, bool, int]]  # final blocks the trace never touches:
    #                                                   (addr, size, requested, allocated, stream)
    profile: str


def prepare(trace: Any, device: int, prof: Any = None, rules: Any = None) -> Prepared:
    """Pair the events, size the blocks (``prof``/``rules``: as :func:`_block_sizes`) and find
    the pre-existing state (all vectorised but the loop over the final segments' blocks)."""
    ev = trace.events(device)
    pairs = _pair(ev)

    # -- start state ---------------------------------------------------------------------------
    final = final_segments(trace, device)
    untouched: list[tuple[int, int, int, bool, int]] = []
    final_live: dict[int, int] = {}
    for s in final:
        for b in s.get("blocks", ()):
            if b.get("state") in ACTIVE_STATES:
                a = int(b["address"])
                final_live[a] = int(b["size"])
                # a file without requested_size (legacy snapshots): the block's size
                untouched.append((a, int(b["size"]), int(b.get("requested_size") or b["size"]),
                                  b.get("state") == "active_allocated",
                                  int(s.get("stream", 0))))
    if untouched:
        ua = np.array([u[0] for u in untouched], np.int64)
        keep = ~np.isin(ua, pairs.touched)
        untouched = [u for u, k in zip(untouched, keep.tolist(), strict=True) if k]

    # -- block sizes ---------------------------------------------------------------------------
    req = ev["size"][pairs.alloc_idx].astype(np.int64)
    blk, profile = _block_sizes(trace, req, prof, rules)
    if final_live and len(pairs.alloc_idx):
        # blocks live at the end: their recorded size (covers unsplit remainders)
        end_live = pairs.fr_idx == NEVER
        a = ev["addr"][pairs.alloc_idx].astype(np.int64)
        fa = np.array(sorted(final_live), np.int64)
        fs = np.array([final_live[x] for x in fa.tolist()], np.int64)
        pos = np.clip(np.searchsorted(fa, a), 0, len(fa) - 1)
        hit = end_live & (fa[pos] == a) & (fs[pos] >= req)
        blk = np.where(hit, fs[pos], blk)
    pre_blk = _block_sizes(trace, pairs.pre_size, prof, rules)[0] if len(pairs.pre_size) else np.zeros(0, np.int64)
    return Prepared(pairs, req, blk, pre_blk, untouched, profile)


@dataclass
class Layout:
    """Segments and live/pending blocks at one moment (built by ``inspect``'s layout step)."""

    segs: list[Seg]
    addr: np.ndarray  # live and pending blocks, sorted by address
    size: np.ndarray  # block bytes (refined: clipped to the next block / segment end, plus
    #                   unsplit remainders in large non-expandable segments)
    req: np.ndarray  # requested bytes (0 for pending blocks)
    live: np.ndarray  # bool: allocated (else freed, awaiting free_completed)
    seg: np.ndarray  # index into segs, -1 outside every segment
    site: np.ndarray  # site id per block (see stack_sites)
    rule_size: np.ndarray  # block size by the rounding rule (pool class)
    chain: np.ndarray  # user call stack id per block (see stack_chains)

