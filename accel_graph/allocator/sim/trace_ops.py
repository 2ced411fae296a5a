"""A recorded trace as engine ops: the conversion behind :func:`~.replayer.replay_trace`.

:func:`build_ops` turns one device's events into an :data:`~accel_graph.allocator.core.records.OP_DTYPE`
array (vectorised with numpy) plus a prologue that rebuilds the allocator state at the trace's
start (:func:`~.trace_state.infer_start_state`: what the recording implies is read in
:mod:`.trace_state`); the mapping is in :mod:`.replayer`'s docstring.
:func:`build_ops_reusing` memoises conversions for a search; :func:`recorded_summary` gives the
recorded figures a replay is compared with.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.records import OP, OP_DTYPE
from ..devices import rounding_rule_or_default
from ..traces.actions import (
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    ACTIONS,
    SEGMENT_ACTIONS,
    recording_peak,
    reserved_delta,
)
from ..units import MIB
from .profiles import Profile, resolve_profile
from .trace_state import alloc_slots, infer_empty_cache, infer_pools, infer_start_state

__all__ = ["build_ops", "build_ops_reusing", "recorded_summary"]


def _prologue(state: dict[str, Any], expandable: bool,
              large_align: int = 512) -> tuple[np.ndarray, dict[int, int]]:
    """Ops that recreate the start state; returns (ops, {block address: slot})."""
    ops: list[tuple[int, int, int, int, int]] = []
    slot_of: dict[int, int] = {}
    keep_free: list[int] = []
    slot = 0

    def malloc(size: int) -> int:
        nonlocal slot
        ops.append((OP["malloc"], 0, size, slot, 0))
        slot += 1
        return slot - 1

    blocks = state["blocks"]
    asked: dict[int, int] = state.get("requested", {})
    addrs = np.asarray([a for a, _ in blocks], dtype=np.uint64)
    segments: list[tuple[int, int, bool]] = []
    for seg_addr, seg_size, seg_exp in state["segments"]:
        lo = int(np.searchsorted(addrs, seg_addr))
        hi = int(np.searchsorted(addrs, seg_addr + seg_size))
        if seg_exp and not expandable and all(s <= MIB for _, s in blocks[lo:hi]):
            # a small-pool expandable range replayed natively: 2 MiB small segments
            segments += [(a, 2 * MIB, True) for a in range(seg_addr, seg_addr + seg_size, 2 * MIB)]
        else:
            segments.append((seg_addr, seg_size, seg_exp))
    for seg_addr, seg_size, seg_exp in segments:
        lo = int(np.searchsorted(addrs, seg_addr))
        hi = int(np.searchsorted(addrs, seg_addr + seg_size))
        inside = [(a, s) for a, s in blocks[lo:hi]]
        all_small = all(s <= MIB for _, s in inside)
        # native small segments are 2 MiB; an expandable range holds one pool (its blocks say which)
        small = all_small and (expandable and bool(inside) or seg_size <= 2 * MIB)
        if not expandable and not small:
            keep_free.append(malloc(seg_size))  # a segment of exactly this size...
            ops.append((OP["free"], 0, 0, keep_free.pop(), 0))  # ...free to carve from
        cur = seg_addr
        end = seg_addr + seg_size
        pieces: list[tuple[int, int, int | None]] = []  # (size, kind, addr) kind 0 gap, 1 block
        nxt = [a for a, _ in inside[1:]] + [end]
        for (a, s), limit in zip(inside, nxt):
            if a > cur:
                pieces.append((a - cur, 0, None))
            if s > MIB:
                # pad as the device would; in a recorded expandable range the recorded
                # addresses already show the padding, so never run into the next block there
                s = (s + large_align - 1) // large_align * large_align
                if seg_exp:
                    s = min(s, max(limit - a, 512))
            s = min(s, end - a)
            pieces.append((s, 1, a))
            cur = a + s
        if end > cur:
            pieces.append((end - cur, 0, None))
        large = not small
        merged: list[list[Any]] = []
        carry = 0
        for size, kind, a in pieces:
            # in a large segment a gap of 1 MiB or less cannot be a block of its own (it would
            # go to the small pool): it belongs to the block before it (an unsplit remainder),
            # or to the next one at the segment's start
            if large and kind == 0 and size <= MIB:
                if merged:
                    merged[-1][0] += size
                else:
                    carry += size
                continue
            merged.append([size + carry, kind, a])
            carry = 0
        if carry:
            merged.append([carry, 0, None])
        for size, kind, a in merged:
            if kind == 1:
                slot_of[a] = malloc(size)
                r = min(int(asked.get(a, size)), size)
                if 0 < r < size:  # requested_bytes counts the caller's size, not the block's
                    ops.append((OP["set_requested"], 0, r, slot_of[a], 0))
            else:
                while size > 0:  # chunks that stay in the segment's pool
                    chunk = size if large or size <= MIB else MIB
                    keep_free.append(malloc(chunk))
                    size -= chunk
    for s in keep_free:
        ops.append((OP["free"], 0, 0, s, 0))
    arr = np.array(ops, dtype=[("op", "<i4"), ("stream", "<i4"), ("size", "<i8"),
                               ("id", "<i8"), ("size2", "<i8")]).astype(OP_DTYPE)
    return arr, slot_of


def build_ops(trace: Any, device: int = 0, profile: Profile | str | None = None,
              *, start_state: bool = True, expandable: bool | None = None,
              empty_cache: Any = None, round_extra: int | None = None) -> dict[str, Any]:
    """Convert one device's events to op arrays: ``prologue`` (start state), ``ops`` (the
    trace), ``n_slots``, and where the ``empty_cache`` calls go; ``pools`` lists the trace's
    nonzero pool ids (their ``malloc_pool`` ops name pool ``i + 1`` for ``pools[i]``: create
    the engine pools in that order), from :func:`~.trace_state.infer_pools` (``pools_inferred``: how many
    allocations got theirs by inference).

    The ops carry the requested sizes; the engine rounds them (``round_extra``: the engine's
    setting, default the profile's, so that prologue blocks come out at their recorded sizes).
    ``empty_cache``: None infers the calls from the trace; False drops them; an array of
    positions (see :func:`~.trace_state.empty_cache_positions`) places them before those alloc/free events.
    """
    prof = resolve_profile(profile, trace.device_type)
    if round_extra is None:
        round_extra = rounding_rule_or_default(prof.rounding).extra
    ev = trace.events(device)
    if expandable is None:
        expandable = any(s.get("is_expandable") for s in trace.segments
                         if s.get("device", device) == device)
    slots = alloc_slots(ev)
    alloc_idx, free_idx, free_slot = slots
    state = (infer_start_state(trace, device, prof, slots) if start_state
             else {"blocks": [], "requested": {}, "segments": []})
    prologue, pre_slot = _prologue(state, expandable)
    if round_extra and len(prologue):
        # prologue sizes are block sizes (multiples of 512): ask for them less the extra
        m = prologue["op"] == OP["malloc"]
        prologue["size"][m] = np.maximum(prologue["size"][m] - round_extra, 1)
    base = int(prologue["id"].max()) + 1 if len(prologue) else 0
    if (free_slot < 0).any():
        miss = free_idx[free_slot < 0]
        pre = np.array([pre_slot.get(a, -1) for a in ev["addr"][miss].tolist()], dtype=np.int64)
        # only the first free of a pre-existing address frees it
        first = np.zeros(len(miss), bool)
        _, firsts = np.unique(ev["addr"][miss], return_index=True)
        first[firsts] = True
        free_slot = free_slot.copy()
        free_slot[free_slot < 0] = np.where(first & (pre >= 0), pre - base, -(1 << 40))
    streams, stream_id = np.unique(ev["stream"], return_inverse=True)
    if len(streams) > 64:
        raise ValueError(f"the trace uses {len(streams)} streams; the engine has at most 64")
    if empty_cache is None:
        ec = infer_empty_cache(trace, ev)
    elif empty_cache is False:
        ec = np.zeros(0, dtype=np.int64)
    else:
        mem = np.nonzero(np.isin(ev["action"], (A_ALLOC, A_FREE_REQ, A_FREE)))[0]
        pos = np.asarray(empty_cache, dtype=np.int64)
        ec = np.where(pos < len(mem), mem[np.minimum(pos, max(len(mem) - 1, 0))], len(ev))
    keep_free = free_slot > -(1 << 40)
    n = len(alloc_idx) + int(keep_free.sum()) + len(ec)
    ops = np.zeros(n, dtype=OP_DTYPE)
    # order key: event index * 2 (+0 for empty_cache placed before its segment event, +1 else)
    key = np.concatenate((alloc_idx * 2 + 1, free_idx[keep_free] * 2 + 1, ec * 2))
    op = np.concatenate((np.full(len(alloc_idx), OP["malloc"]),
                         np.full(int(keep_free.sum()), OP["free"]),
                         np.full(len(ec), OP["empty_cache"])))
    sizes = np.maximum(ev["size"][alloc_idx].astype(np.int64), 1)
    pool_col = infer_pools(trace, device)[alloc_idx]
    inferred = 0
    pools: list[int] = []
    if pool_col.any():
        if "pool" in (ev.dtype.names or ()):
            inferred = int(((pool_col != 0) & (ev["pool"][alloc_idx] == 0)).sum())
        else:
            inferred = int((pool_col != 0).sum())
        nz = np.unique(pool_col[pool_col != 0])
        pools = [int(x) for x in nz]
        engine_pool = np.where(pool_col != 0, np.searchsorted(nz, pool_col) + 1, 0)
        op[:len(alloc_idx)] = np.where(engine_pool > 0, OP["malloc_pool"], OP["malloc"])
    size = np.concatenate((sizes,
                           np.zeros(int(keep_free.sum()) + len(ec), np.int64)))
    ids = np.concatenate((np.arange(len(alloc_idx)) + base, free_slot[keep_free] + base,
                          np.zeros(len(ec), np.int64)))
    st = np.concatenate((stream_id[alloc_idx], stream_id[free_idx[keep_free]],
                         np.zeros(len(ec), np.int64)))
    order = np.argsort(key, kind="stable")
    ops["op"], ops["size"], ops["id"] = op[order], size[order], ids[order]
    ops["stream"] = st[order]
    if pools:
        size2 = np.concatenate((engine_pool, np.zeros(int(keep_free.sum()) + len(ec), np.int64)))
        ops["size2"] = size2[order]
    return {"prologue": prologue, "ops": ops, "n_slots": base + len(alloc_idx),
            "n_streams": len(streams), "empty_cache_at": ec, "start_state": state,
            "expandable": expandable, "profile": prof.name, "pools": pools,
            "pools_inferred": inferred}


# ------------------------------------------------------------------------------------------
# reusing the conversion (a search replays one trace under hundreds of configurations whose
# conversions differ only in a few inputs)


def build_ops_reusing(cache: dict[Any, dict[str, Any]], trace: Any, device: int = 0,
                      profile: Profile | str | None = None, *, start_state: bool = True,
                      expandable: bool | None = None, empty_cache: Any = None,
                      round_extra: int | None = None) -> dict[str, Any]:
    """:func:`build_ops` through ``cache``, a dict the caller owns for one trace that does not
    change while the dict is in use (a tuning search): the same conversion is made once.

    The key is every input the conversion reads besides the trace: ``device``, the resolved
    profile, ``start_state``, ``expandable``, ``empty_cache`` (None, False or the positions'
    values) and the resolved ``round_extra``. The returned dict is shared; its arrays are
    read-only.
    """
    prof = resolve_profile(profile, trace.device_type)
    if round_extra is None:
        round_extra = rounding_rule_or_default(prof.rounding).extra
    if empty_cache is None or empty_cache is False:
        ec_key: Any = empty_cache
    else:
        pos = np.asarray(empty_cache, dtype=np.int64)
        ec_key = ("at", pos.shape, pos.tobytes())
    key = (device, prof, bool(start_state), expandable, ec_key, int(round_extra))
    built = cache.get(key)
    if built is None:
        built = build_ops(trace, device, prof, start_state=start_state, expandable=expandable,
                          empty_cache=empty_cache, round_extra=round_extra)
        for k in ("prologue", "ops", "empty_cache_at"):
            built[k].setflags(write=False)
        cache[key] = built
    return built


def recorded_summary(trace: Any, device: int = 0) -> dict[str, Any]:
    """The recorded counterpart of :meth:`ReplayResult.summary`: segment event counts, and the
    peak/final reserved bytes (start reserved = final segments minus the net trace change)."""
    ev = trace.events(device)
    act = ev["action"]
    delta = np.cumsum(reserved_delta(ev))
    final = sum(int(s["total_size"]) for s in trace.segments if s.get("device", device) == device)
    start = final - (int(delta[-1]) if len(delta) else 0)
    counts = {ACTIONS[c]: int((act == c).sum()) for c in SEGMENT_ACTIONS}
    return {
        "peak_reserved": start + max(0, int(delta.max()) if len(delta) else 0),
        "segment_alloc": counts["segment_alloc"],
        "segment_free": counts["segment_free"],
        "segment_map": counts["segment_map"],
        "segment_unmap": counts["segment_unmap"],
        "final_reserved": final,
        "start_reserved": start,
        # the recording's own peak, beside the whole-trace peak (which includes the start)
        "peak_reserved_recording": recording_peak(start, ev)[0],
    }

