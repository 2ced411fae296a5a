"""The memory layout at one moment of a recorded trace, and where its reserved-but-unrequested
bytes go.

:func:`layout_state` rebuilds the segments and blocks after the first ``k`` events (vectorised
over blocks: start state, then the events); :func:`layout_at` is its snapshot-shaped view for
viewers. :func:`split_waste` splits ``reserved - requested`` at that moment into
:data:`WASTE_COMPONENTS`, which add up exactly; :data:`ADVICE` says, per component, what removes
it. :func:`~.inspect.inspect_trace` applies both at the peak of reserved (the definitions are in
its module docstring).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..units import MIB
from .sites import site_ids, stack_chains, stack_sites
from .walk import Layout, Pairs, SegmentWalk, prepare

__all__ = ["ADVICE", "SMALL_SIZE", "WASTE_COMPONENTS", "layout_at", "layout_state", "split_waste"]

#: torch's kSmallSize: blocks of at most this many bytes come from the small pool.
SMALL_SIZE = MIB


#: The parts of (reserved - requested) at the peak of reserved, in report order. They sum
#: exactly to that difference; ``unattributed`` is what the reconstructed layout cannot place
#: (0 for a consistent trace).
WASTE_COMPONENTS: tuple[str, ...] = (
    "internal_rounding",
    "free_in_live_segments",
    "wholly_free_segments",
    "other_streams",
    "pool_boundary",
    "private_pools",
    "unattributed",
)

#: One line per waste component: the knob or code change that removes it. ``{env}`` is the
#: device's config variable (PYTORCH_ALLOC_CONF, PYTORCH_NPU_ALLOC_CONF, ...).
ADVICE: dict[str, str] = {
    "internal_rounding": (
        "rounding of requests to block sizes: pad tensor sizes to multiples of 512 bytes (or of "
        "the roundup_power2_divisions step); roundup_power2_divisions trades this for reuse, so "
        "lower it if it is set"
    ),
    "free_in_live_segments": (
        "free gaps inside segments that hold live blocks (fragmentation): {env}="
        "expandable_segments:True; in code, free in LIFO order and allocate long-lived tensors first"
    ),
    "wholly_free_segments": (
        "cached segments with nothing live at the peak: the peak request did not fit in any of "
        "them, so the allocator reserved a new segment beside them (fragmentation across "
        "segments); {env}=expandable_segments:True lets segments grow and serve any size, and "
        "`accel-alloc tune` measures what it saves on this trace. empty_cache() does not lower "
        "this peak (it only hands the cache back to other processes)"
    ),
    "other_streams": (
        "memory cached for (or held by) streams other than the main one: allocate and free "
        "tensors on the stream that uses them, or call tensor.record_stream(s) instead of "
        "keeping copies; fewer side streams means fewer separate caches"
    ),
    "pool_boundary": (
        "free bytes in the pool the peak request could not use (requests <= 1 MiB come from 2 MiB "
        "small-pool segments, larger ones from the large pool; they never share): keep tensors "
        "consistently above or below 1 MiB"
    ),
    "private_pools": (
        "free bytes in private pools (CUDA graph / MemPool segments): capture graphs largest "
        "first into one shared pool (graph_pool_handle), and drop graphs no longer replayed"
    ),
    "unattributed": (
        "bytes the reconstructed layout could not place (live blocks outside every known "
        "segment, or segment events that disagree with the final segments): check the trace "
        "with `accel-alloc validate`"
    ),
}


def layout_at(trace: Any, device: int = 0, state: int | None = None) -> list[dict[str, Any]]:
    """The segments and their live blocks after the first ``state`` events of ``device``
    (default: all of them), rebuilt from the start state and the events, in the snapshot's
    segment form: ``address``, ``total_size``, ``stream``, ``is_expandable``, ``segment_type``
    (None when unknown), ``private`` (nonzero pool) and ``blocks`` (``address``, ``size``,
    ``requested_size``, ``state``: ``active_allocated`` or ``active_pending_free``; free space
    is not listed). Block sizes follow the device's rounding rule, clipped to the next block and
    the segment end, plus unsplit remainders where they can be told apart (a gap of at most
    1 MiB after a large block in a non-expandable segment). Blocks outside every segment are
    left out."""
    ev = trace.events(device)
    k = len(ev) if state is None else int(state)
    if not 0 <= k <= len(ev):
        raise ValueError(f"state must be 0..{len(ev)}")
    prep = prepare(trace, device)
    lay = layout_state(trace, ev, device, k, prep.pairs, prep.req, prep.blk, prep.pre_blk,
                     prep.untouched)
    out = []
    for i, sg in enumerate(lay.segs):
        m = lay.seg == i
        blocks = [{"address": a, "size": z, "requested_size": r,
                   "state": "active_allocated" if lv else "active_pending_free"}
                  for a, z, r, lv in zip(lay.addr[m].tolist(), lay.size[m].tolist(),
                                         lay.req[m].tolist(), lay.live[m].tolist(), strict=True)]
        out.append({"address": sg.addr, "total_size": sg.size, "stream": sg.stream,
                    "is_expandable": sg.expandable, "segment_type": sg.kind,
                    "private": sg.private, "blocks": blocks})
    return out



def layout_state(trace: Any, ev: np.ndarray, device: int, k: int, pairs: Pairs, req: np.ndarray,
               blk: np.ndarray, pre_blk: np.ndarray, untouched: list[Any]) -> Layout:
    """Segments and blocks after the first ``k`` events (vectorised over blocks)."""
    segs = SegmentWalk(trace, ev, device).at(k)
    ai = pairs.alloc_idx
    on = (ai < k) & (pairs.fc_idx >= k)
    live_a = on & (pairs.fr_idx >= k)
    pre_on = pairs.pre_fc >= k
    pre_live = pairs.pre_fr >= k
    a_site = site_ids(stack_sites(trace)[0], ev["frames"][ai[on]])
    a_chain = site_ids(stack_chains(trace)[0], ev["frames"][ai[on]])
    addr = np.concatenate((ev["addr"][ai[on]].astype(np.int64), pairs.pre_addr[pre_on],
                           np.array([u[0] for u in untouched], np.int64)))
    size = np.concatenate((blk[on], pre_blk[pre_on], np.array([u[1] for u in untouched], np.int64)))
    rq = np.concatenate((req[on], pairs.pre_size[pre_on],
                         np.array([u[2] for u in untouched], np.int64)))
    live = np.concatenate((live_a[on], pre_live[pre_on],
                           np.array([u[3] for u in untouched], bool)))
    pre_ones = np.ones(int(pre_on.sum()) + len(untouched), np.int64)
    site = np.concatenate((a_site, pre_ones))
    chain = np.concatenate((a_chain, pre_ones))
    o = np.argsort(addr, kind="stable")
    addr, size, rq, live, site, chain = addr[o], size[o], rq[o], live[o], site[o], chain[o]
    rq = np.where(live, rq, 0)
    rule = size.copy()
    starts = np.array([s.addr for s in segs], np.int64)
    ends = np.array([s.addr + s.size for s in segs], np.int64)
    si = np.searchsorted(starts, addr, side="right") - 1
    inside = (si >= 0) & (addr < ends[np.maximum(si, 0)] if len(segs) else False)
    si = np.where(inside, si, -1)
    if len(addr):
        seg_end = (np.where(si >= 0, ends[np.maximum(si, 0)], addr + size) if len(segs)
                   else addr + size)  # no segments (RMM logs): blocks stand alone
        nxt = np.concatenate((addr[1:], [np.iinfo(np.int64).max]))
        limit = np.minimum(seg_end, np.where(nxt > addr, nxt, seg_end))
        size = np.minimum(size, np.maximum(limit - addr, 0))
        # large non-expandable segments never hold a free block of <= 1 MiB: such a gap after a
        # live block is that block's unsplit remainder
        if len(segs):
            large_native = np.array([(not s.expandable) and s.kind != "small" for s in segs], bool)
            gap = limit - (addr + size)
            absorb = (si >= 0) & large_native[np.maximum(si, 0)] & (rule > SMALL_SIZE) & (
                gap > 0) & (gap <= SMALL_SIZE)
            size = np.where(absorb, size + gap, size)
    return Layout(segs, addr, size, rq, live, si, site, rule, chain)


def split_waste(lay: Layout, main_stream: int | None, trigger: dict[str, Any] | None,
           reserved: int, requested: int) -> tuple[dict[str, int], dict[str, Any]]:
    """Split reserved - requested at one moment into :data:`WASTE_COMPONENTS`."""
    segs = lay.segs
    ns = len(segs)
    inside = lay.seg >= 0
    si = lay.seg[inside]
    used = np.bincount(si, weights=lay.size[inside], minlength=ns).astype(np.int64)
    nblocks = np.bincount(si, minlength=ns)
    large_block = np.bincount(si, weights=(lay.rule_size[inside] > SMALL_SIZE), minlength=ns) > 0
    waste = dict.fromkeys(WASTE_COMPONENTS, 0)
    live = lay.live
    waste["internal_rounding"] = int((lay.size[live & inside] - lay.req[live & inside]).sum())
    waste["other_streams"] = int(lay.size[~live & inside].sum())  # freed, awaiting completion
    trig_pool = trigger["pool"] if trigger else None
    n_live_segs = 0
    for i, s in enumerate(segs):
        free = s.size - int(used[i])
        if nblocks[i]:
            n_live_segs += 1
            kind = "large" if large_block[i] else "small"
        else:
            kind = s.kind or ("small" if s.size <= 2 * MIB else "large")
        if s.private:
            waste["private_pools"] += free
        elif not nblocks[i]:
            waste["wholly_free_segments"] += free
        elif main_stream is not None and s.stream != main_stream:
            waste["other_streams"] += free
        elif trig_pool is not None and kind != trig_pool:
            waste["pool_boundary"] += free
        else:
            waste["free_in_live_segments"] += free
    total = reserved - requested
    waste["unattributed"] = total - sum(v for c, v in waste.items() if c != "unattributed")
    info = {"segments": ns, "segments_with_blocks": n_live_segs,
            "blocks_outside_segments": int((~inside).sum()), "main_stream": main_stream}
    return {c: int(v) for c, v in waste.items()}, info
