"""What a recording implies beyond its events, for replaying it: the allocator state at its start
(:func:`infer_start_state`), where ``empty_cache`` was called (:func:`infer_empty_cache`,
:func:`empty_cache_positions`), which private pool each allocation went to (:func:`infer_pools`,
:func:`pool_number`), and which alloc each free releases (:func:`alloc_slots`).

Pure reading of the trace (numpy over its event array and final segments); turning the answers
into engine ops is :mod:`.trace_ops`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..traces.actions import (
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    A_MAP,
    A_SEG_ALLOC,
    A_SEG_FREE,
    A_UNMAP,
    SEGMENT_ACTIONS,
)
from ..units import MIB
from .profiles import Profile, resolve_profile, round_requests

__all__ = [
    "alloc_slots",
    "empty_cache_positions",
    "infer_empty_cache",
    "infer_pools",
    "infer_start_state",
    "pool_number",
]


def _empty_cache_stack_ids(trace: Any) -> np.ndarray:
    ids = [i for i, st in enumerate(trace.stacks)
           if any(isinstance(f, dict) and f.get("name") == "empty_cache" for f in st)]
    return np.asarray(ids, dtype=np.int64)


def infer_empty_cache(trace: Any, ev: np.ndarray) -> np.ndarray:
    """Indices of the events where an ``empty_cache`` call began: the first event of each run
    of consecutive ``segment_free``/``segment_unmap`` events. A run whose frames are known and
    do not name ``empty_cache`` is the allocator's own release (OOM path) and is skipped."""
    rel = np.isin(ev["action"], (A_SEG_FREE, A_UNMAP))
    if not rel.any():
        return np.zeros(0, dtype=np.int64)
    starts = np.nonzero(rel & ~np.concatenate(([False], rel[:-1])))[0]
    frames = ev["frames"][starts].astype(np.int64)
    known = frames >= 0
    named = np.isin(frames, _empty_cache_stack_ids(trace))
    return starts[~known | named]


def empty_cache_positions(trace: Any, device: int = 0) -> np.ndarray:
    """The inferred ``empty_cache`` calls as positions in the alloc/free sequence (the number
    of ``alloc``/``free_requested``/``free_completed`` events before each call), so that they
    can be placed in a twin recording of the same sequence."""
    ev = trace.events(device)
    ec = infer_empty_cache(trace, ev)
    mem = np.cumsum(np.isin(ev["action"], (A_ALLOC, A_FREE_REQ, A_FREE)))
    return np.where(ec > 0, mem[np.maximum(ec - 1, 0)], 0).astype(np.int64)


def alloc_slots(ev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alloc_idx, free_idx, free_slot): slot of each free = index (into alloc_idx) of the last
    alloc at the same address before it, -1 when there is none (a pre-existing block)."""
    act = ev["action"]
    idx = np.nonzero((act == A_ALLOC) | (act == A_FREE))[0]  # in event order
    is_alloc_all = act[idx] == A_ALLOC
    alloc_idx, free_idx = idx[is_alloc_all], idx[~is_alloc_all]
    # rank of each event within its kind: slot number for allocs, position for frees
    rank = np.where(is_alloc_all, np.cumsum(is_alloc_all) - 1, np.cumsum(~is_alloc_all) - 1)
    addr = ev["addr"][idx]
    order = np.argsort(addr, kind="stable")  # by address, then event order
    a_s, alloc_s = addr[order], is_alloc_all[order]
    slot_s = np.where(alloc_s, rank[order], -1)
    # forward-fill the slot of the last alloc within each address group
    pos = np.where(alloc_s, np.arange(len(order)), -1)
    pos = np.maximum.accumulate(pos) if len(pos) else pos
    valid = pos >= 0
    same = np.zeros(len(order), bool)
    same[valid] = a_s[pos[valid]] == a_s[valid]
    # a second free after the block was already freed has no live slot: mark it -1 too
    prev_is_alloc = np.concatenate(([False], alloc_s[:-1])) & np.concatenate(
        ([False], a_s[1:] == a_s[:-1]))
    filled = np.where(same & prev_is_alloc, slot_s[np.maximum(pos, 0)], -1)
    free_slot = np.empty(len(free_idx), dtype=np.int64)
    free_pos = np.nonzero(~alloc_s)[0]
    free_slot[rank[order[free_pos]]] = filled[free_pos]
    return alloc_idx, free_idx, free_slot


def _segments_at_start(trace: Any, ev: np.ndarray, device: int) -> list[tuple[int, int, bool]]:
    """Segments (address, size, expandable) live when the recording began: the final segments
    with the trace's segment events undone in reverse. Expandable segments are tracked by 2 MiB
    page and come back as contiguous mapped ranges."""
    final = [s for s in trace.segments if s.get("device", device) == device]
    native = {int(s["address"]): int(s["total_size"]) for s in final if not s.get("is_expandable")}
    pages: set[int] = set()
    for s in final:
        if s.get("is_expandable"):
            a, n = int(s["address"]), int(s["total_size"])
            pages.update(range(a // (2 * MIB), (a + n) // (2 * MIB)))
    seg = ev[np.isin(ev["action"], SEGMENT_ACTIONS)]
    for act, addr, size in zip(seg["action"][::-1].tolist(), seg["addr"][::-1].tolist(),
                               seg["size"][::-1].tolist()):
        if act == A_SEG_ALLOC:
            native.pop(addr, None)
        elif act == A_SEG_FREE:
            native[addr] = size
        else:
            rng = range(addr // (2 * MIB), (addr + size) // (2 * MIB))
            (pages.difference_update if act == A_MAP else pages.update)(rng)
    out = [(a, n, False) for a, n in native.items()]
    run_start = prev = None
    for p in sorted(pages):
        if prev is None or p != prev + 1:
            if run_start is not None:
                out.append((run_start * 2 * MIB, (prev + 1 - run_start) * 2 * MIB, True))
            run_start = p
        prev = p
    if run_start is not None:
        out.append((run_start * 2 * MIB, (prev + 1 - run_start) * 2 * MIB, True))
    return sorted(out)


def infer_start_state(trace: Any, device: int = 0, profile: Profile | str | None = None,
                      _slots: Any = None) -> dict[str, Any]:
    """The pre-existing state: ``blocks`` [(address, size)] live at the trace's start,
    ``requested`` {address: bytes the caller asked for} for those blocks (the size of the first
    free of a block the trace frees; the recorded ``requested_size`` of a final block the trace
    never touches, its size when the file has none), and ``segments`` [(address, size,
    expandable)] reserved at the start. ``profile`` (default: the trace's device) rounds the
    freed sizes of blocks allocated before the trace."""
    ev = trace.events(device)
    _, free_idx, free_slot = _slots if _slots is not None else alloc_slots(ev)
    orphan = free_idx[free_slot < 0]
    blocks: dict[int, int] = {}
    requested: dict[int, int] = {}
    prof = resolve_profile(profile, trace.device_type)
    asked = np.maximum(ev["size"][orphan].astype(np.int64), 1)
    sizes = round_requests(asked, prof)
    for a, s, r in zip(ev["addr"][orphan].tolist(), sizes.tolist(), asked.tolist()):
        if a not in blocks:  # the first free of an address never allocated in the trace
            blocks[a], requested[a] = s, r
    final = [(int(b["address"]), int(b["size"]), b.get("requested_size"))
             for s in trace.segments if s.get("device", device) == device
             for b in s.get("blocks", ()) if b.get("state") == "active_allocated"]
    if final:
        mem_addr = ev["addr"][np.isin(ev["action"], (A_ALLOC, A_FREE_REQ, A_FREE))]
        touched = np.isin(np.array([a for a, _, _ in final], dtype=np.uint64), mem_addr)
        for (a, n, r), t in zip(final, touched.tolist()):
            if not t:
                blocks[a] = n
                # the block's own requested_size: its size would count the rounding slack as
                # requested bytes (135 MB on a 2.7B model's start state)
                requested[a] = int(r) if isinstance(r, int) and 0 < r <= n else n
    return {"blocks": sorted(blocks.items()), "requested": requested,
            "segments": _segments_at_start(trace, ev, device)}


def pool_number(pool_id: Any) -> int:
    """One integer for a snapshot's ``segment_pool_id``: torch's pair ``(0, n)`` (MemPool ids,
    and what the engine's ``segments_from_layout`` writes) -> ``n``; ``(a, b)`` with ``a`` != 0
    (CUDA graph pools, ``(uid, 0)``) -> ``a << 32 | b``; an int as is; None -> 0."""
    if pool_id is None:
        return 0
    if isinstance(pool_id, (tuple, list)):
        if len(pool_id) != 2:
            raise ValueError(f"segment_pool_id must be a pair, got {pool_id!r}")
        a, b = int(pool_id[0]), int(pool_id[1])
        return b if a == 0 else (a << 32) | b
    return int(pool_id)


def infer_pools(trace: Any, device: int = 0) -> np.ndarray:
    """The pool of every event of ``device`` (int64; 0 = default pool): the event's own
    ``pool`` where nonzero. An ``alloc`` whose ``pool`` is 0 (torch's trace entries carry none)
    gets one when it can be determined:

    - the final segment containing its address is in a private pool (``segment_pool_id`` not
      ``(0, 0)``; see :func:`pool_number`) and no ``segment_free``/``segment_unmap`` covering
      that address follows the allocation (so the segment it went into is that final one);
    - otherwise, it lies in a segment made by a ``segment_alloc`` event that carries a nonzero
      ``pool``, before that segment's ``segment_free``.

    Everything else stays in the default pool (0).
    """
    ev = trace.events(device)
    act = ev["action"]
    own = (ev["pool"].astype(np.int64) if "pool" in (ev.dtype.names or ())
           else np.zeros(len(ev), np.int64))
    out = own.copy()
    private = sorted((int(s["address"]), int(s["total_size"]), p)
                     for s in trace.segments if s.get("device", device) == device
                     for p in (pool_number(s.get("segment_pool_id")),) if p)
    pooled = (np.nonzero((act == A_SEG_ALLOC) & (own != 0))[0] if own.any()
              else np.zeros(0, np.int64))
    if not private and not len(pooled):
        return out
    cand = np.nonzero((act == A_ALLOC) & (own == 0))[0]
    if not len(cand):
        return out
    addr = ev["addr"][cand].astype(np.uint64)
    rel_idx = np.nonzero(np.isin(act, (A_SEG_FREE, A_UNMAP)))[0]
    rel_lo = ev["addr"][rel_idx].astype(np.uint64)
    rel_hi = rel_lo + ev["size"][rel_idx].astype(np.uint64)
    for lo, n, p in private:
        sel = np.nonzero((addr >= lo) & (addr < lo + n))[0]
        if not len(sel):
            continue
        ok = np.ones(len(sel), bool)
        for j in np.nonzero((rel_lo < lo + n) & (rel_hi > lo))[0].tolist():
            # released after the allocation: that allocation was in an earlier segment
            ok &= ~((cand[sel] < rel_idx[j]) & (addr[sel] >= rel_lo[j]) & (addr[sel] < rel_hi[j]))
        out[cand[sel[ok]]] = p
    if len(pooled):
        sf_idx = np.nonzero(act == A_SEG_FREE)[0]
        sf_addr = ev["addr"][sf_idx]
        for k in pooled.tolist():
            lo, n = int(ev["addr"][k]), int(ev["size"][k])
            later = sf_idx[(sf_idx > k) & (sf_addr == lo)]
            end = int(later[0]) if len(later) else len(ev)
            m = (cand > k) & (cand < end) & (addr >= lo) & (addr < lo + n) & (out[cand] == 0)
            out[cand[m]] = own[k]
    return out
