"""Whole-trace replay: a recorded allocator trace through the C engine in one call.

``replay_trace(trace)`` turns a :class:`~accel_graph.allocator.snapshot.Trace`'s events into one
:data:`~accel_graph.allocator.engine.OP_DTYPE` array (vectorised with numpy) and runs it with a
single :meth:`Engine.replay`. Before that, a short prologue (a second, small ``replay`` call)
rebuilds the allocator state at the trace's start when the recording began mid-run.

Mapping (see docs/allocator-fidelity.md):

- ``alloc`` -> ``malloc`` of the requested size (pre-rounded in Python for the ``npu`` profile,
  see :func:`profile_round`), into a fresh slot per allocation;
- ``free_completed`` -> ``free`` of the slot allocated last at that address (``free_requested``
  is ignored: the engine completes cross-stream frees itself, and the real trace's completion
  time is the ``free_completed`` event);
- streams -> engine stream ids 0..63 in order of first appearance;
- a run of consecutive ``segment_free``/``segment_unmap`` events (whose frames, when there are
  any, name ``empty_cache``) -> one ``empty_cache`` op at the start of the run;
- frees of addresses never allocated in the trace, and active blocks of the final segments
  never touched by the trace, are the pre-existing state: allocated in the prologue in address
  order inside segments recreated with their recorded sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import settings_from_snapshot
from .engine import OP, OP_DTYPE, Engine, EngineSettings
from .trace import ACTION_CODE, ACTIONS

__all__ = [
    "PROFILES",
    "ReplayResult",
    "build_ops",
    "empty_cache_positions",
    "infer_empty_cache",
    "infer_start_state",
    "profile_round",
    "recorded_summary",
    "replay_trace",
]

MIB = 1 << 20
A_ALLOC = ACTION_CODE["alloc"]
A_FREE_REQ = ACTION_CODE["free_requested"]
A_FREE = ACTION_CODE["free_completed"]
A_SEG_ALLOC = ACTION_CODE["segment_alloc"]
A_SEG_FREE = ACTION_CODE["segment_free"]
A_MAP = ACTION_CODE["segment_map"]
A_UNMAP = ACTION_CODE["segment_unmap"]
SEGMENT_ACTIONS = (A_SEG_ALLOC, A_SEG_FREE, A_MAP, A_UNMAP)

#: Device profiles: how the device's allocator rounds a request before torch's own rules.
#: ``npu``: torch_npu adds 32 bytes and rounds up to 512 (measured on the Ascend traces: every
#: block is ``ceil((requested + 32) / 512) * 512``, so a request that is a multiple of 512 comes
#: out 512 bytes bigger). The engine has no such rule; sizes are pre-rounded in Python.
PROFILES: dict[str, int] = {"cuda": 0, "rocm": 0, "xpu": 0, "npu": 32}
#: Ascend NPU, expandable segments: large blocks start on 16 KiB boundaries (measured).
NPU_EXPANDABLE_LARGE_ALIGN = 16 * 1024


def profile_round(sizes: Any, profile: str | None) -> np.ndarray:
    """Requested sizes as the device's allocator sees them (int64 array)."""
    s = np.asarray(sizes, dtype=np.int64)
    extra = PROFILES.get(profile or "cuda")
    if extra is None:
        raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}")
    if not extra:
        return s
    return ((s + extra + 511) // 512) * 512


@dataclass
class ReplayResult:
    """What a replay did (engine side) — compare with :func:`recorded_summary`."""

    peak_reserved: int
    device_mallocs: int
    device_frees: int
    maps: int
    unmaps: int
    retries: int
    ooms: int
    segment_events: np.ndarray  # engine EVENT_DTYPE records of segment_* actions, oldest first
    fragmentation_at_peak: float  # 1 - allocated/reserved at the peak of reserved
    final_stats: dict[str, int]
    start_reserved: int
    n_ops: int
    replay_seconds: float = 0.0
    inferred_empty_cache: int = 0
    layout: list[dict[str, Any]] = field(default_factory=list)

    @property
    def segment_allocs(self) -> int:
        return self.device_mallocs

    def summary(self) -> dict[str, Any]:
        return {
            "peak_reserved": self.peak_reserved,
            "segment_alloc": self.device_mallocs,
            "segment_free": self.device_frees,
            "segment_map": self.maps,
            "segment_unmap": self.unmaps,
            "final_reserved": self.final_stats.get("reserved_bytes.all.current", 0),
            "retries": self.retries,
            "ooms": self.ooms,
        }


# ------------------------------------------------------------------------------------------
# the trace side


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


def _alloc_slots(ev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def infer_start_state(trace: Any, device: int = 0, profile: str | None = None,
                      _slots: Any = None) -> dict[str, Any]:
    """The pre-existing state: ``blocks`` [(address, size)] live at the trace's start, and
    ``segments`` [(address, size, expandable)] reserved at the start."""
    ev = trace.events(device)
    _, free_idx, free_slot = _slots if _slots is not None else _alloc_slots(ev)
    orphan = free_idx[free_slot < 0]
    blocks: dict[int, int] = {}
    sizes = (profile_round(ev["size"][orphan], profile) + 511) // 512 * 512  # torch's 512 floor
    for a, s in zip(ev["addr"][orphan].tolist(), np.maximum(sizes, 512).tolist()):
        blocks.setdefault(a, s)  # the first free of an address never allocated in the trace
    final = [(int(b["address"]), int(b["size"])) for s in trace.segments
             if s.get("device", device) == device for b in s.get("blocks", ())
             if b.get("state") == "active_allocated"]
    if final:
        mem_addr = ev["addr"][np.isin(ev["action"], (A_ALLOC, A_FREE_REQ, A_FREE))]
        touched = np.isin(np.array([a for a, _ in final], dtype=np.uint64), mem_addr)
        for (a, n), t in zip(final, touched.tolist()):
            if not t:
                blocks[a] = n
    return {"blocks": sorted(blocks.items()), "segments": _segments_at_start(trace, ev, device)}


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


def build_ops(trace: Any, device: int = 0, profile: str | None = None,
              *, start_state: bool = True, expandable: bool | None = None,
              empty_cache: Any = None) -> dict[str, Any]:
    """Convert one device's events to op arrays: ``prologue`` (start state), ``ops`` (the
    trace), ``n_slots``, and where the ``empty_cache`` calls go.

    ``empty_cache``: None infers the calls from the trace; False drops them; an array of
    positions (see :func:`empty_cache_positions`) places them before those alloc/free events.
    """
    if profile is None:
        profile = trace.device_type or "cuda"
    ev = trace.events(device)
    if expandable is None:
        expandable = any(s.get("is_expandable") for s in trace.segments
                         if s.get("device", device) == device)
    slots = _alloc_slots(ev)
    alloc_idx, free_idx, free_slot = slots
    state = (infer_start_state(trace, device, profile, slots) if start_state
             else {"blocks": [], "segments": []})
    align = NPU_EXPANDABLE_LARGE_ALIGN if profile == "npu" and expandable else 512
    prologue, pre_slot = _prologue(state, expandable, align)
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
    sizes = profile_round(ev["size"][alloc_idx], profile)
    if profile == "npu" and expandable:
        # torch_npu leaves large blocks of expandable segments 16 KiB-aligned (the final
        # segments show free fragments of 16 KiB - (size mod 16 KiB)): pad large requests
        sizes = np.where(sizes > MIB, (sizes + NPU_EXPANDABLE_LARGE_ALIGN - 1)
                         // NPU_EXPANDABLE_LARGE_ALIGN * NPU_EXPANDABLE_LARGE_ALIGN, sizes)
    size = np.concatenate((sizes,
                           np.zeros(int(keep_free.sum()) + len(ec), np.int64)))
    ids = np.concatenate((np.arange(len(alloc_idx)) + base, free_slot[keep_free] + base,
                          np.zeros(len(ec), np.int64)))
    st = np.concatenate((stream_id[alloc_idx], stream_id[free_idx[keep_free]],
                         np.zeros(len(ec), np.int64)))
    order = np.argsort(key, kind="stable")
    ops["op"], ops["size"], ops["id"] = op[order], size[order], ids[order]
    ops["stream"] = st[order]
    return {"prologue": prologue, "ops": ops, "n_slots": base + len(alloc_idx),
            "n_streams": len(streams), "empty_cache_at": ec, "start_state": state,
            "expandable": expandable, "profile": profile}


def recorded_summary(trace: Any, device: int = 0) -> dict[str, Any]:
    """The recorded counterpart of :meth:`ReplayResult.summary`: segment event counts, and the
    peak/final reserved bytes (start reserved = final segments minus the net trace change)."""
    ev = trace.events(device)
    act = ev["action"]
    sign = np.select([np.isin(act, (A_SEG_ALLOC, A_MAP)), np.isin(act, (A_SEG_FREE, A_UNMAP))],
                     [1, -1], 0)
    delta = np.cumsum(sign * ev["size"].astype(np.int64))
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
    }


# ------------------------------------------------------------------------------------------
# replay


def _frag_at_peak(events: np.ndarray, start_reserved: int, start_allocated: int) -> float:
    act = events["action"].astype(np.int64)
    size = events["size"].astype(np.int64)
    res = start_reserved + np.cumsum(np.select(
        [np.isin(act, (A_SEG_ALLOC, A_MAP)), np.isin(act, (A_SEG_FREE, A_UNMAP))], [size, -size], 0))
    alloc = start_allocated + np.cumsum(np.select(
        [act == A_ALLOC, act == A_FREE_REQ], [size, -size], 0))
    if not len(res):
        return 0.0 if not start_reserved else 1.0 - start_allocated / start_reserved
    i = int(np.argmax(res))
    return float(1.0 - alloc[i] / res[i]) if res[i] else 0.0


def replay_trace(trace: Any, settings: Any = None, *, policy: str = "native", device: int = 0,
                 profile: str | None = None, expandable: bool | None = None,
                 empty_cache: Any = None, keep_layout: bool = False) -> ReplayResult:
    """Replay one device's trace in the engine (one C call for the whole trace).

    ``settings``: an :class:`EngineSettings`, a parsed ``AllocatorSettings``, or None for the
    trace's own (``settings_from_snapshot``, with ``expandable_segments`` inferred from the
    final segments' ``is_expandable``). ``expandable`` overrides ``expandable_segments``.
    ``profile``: device profile for rounding (default: the trace's device type).
    ``empty_cache``: as in :func:`build_ops` (None: inferred from the trace).
    """
    import time

    if settings is None:
        parsed = settings_from_snapshot(trace.allocator_settings or {},
                                        "cuda" if trace.device_type in (None, "npu") else
                                        trace.device_type)
        es = EngineSettings.from_allocator_settings(parsed)
        inferred = any(s.get("is_expandable") for s in trace.segments
                         if s.get("device", device) == device)
        if inferred and not es.expandable_segments:
            es = EngineSettings(**{**es.__dict__, "expandable_segments": True})
    elif isinstance(settings, EngineSettings):
        es = settings
    else:
        es = EngineSettings.from_allocator_settings(settings)
    if expandable is not None and es.expandable_segments != expandable:
        es = EngineSettings(**{**es.__dict__, "expandable_segments": expandable})
    built = build_ops(trace, device, profile, expandable=es.expandable_segments,
                      empty_cache=empty_cache)
    def make() -> Engine:
        e = Engine(policy, "counting", es, streams=max(1, built["n_streams"]))
        for _ in range(built["n_streams"] - 1):
            e.create_stream()
        return e

    slots = built["n_slots"]
    # Slots live in one replay call, so the prologue and the trace run as one array. A first,
    # throw-away engine runs the prologue alone to learn its events and statistics (the engine
    # is deterministic, so they are the first events of the full run).
    pro = make()
    pro.enable_events()
    if len(built["prologue"]):
        pro.replay(built["prologue"], n_slots=slots)
    n_pro_events = len(pro.drain_events())
    start = pro.memory_stats()
    pro.close()
    eng = make()
    eng.enable_events()
    ops = np.concatenate((built["prologue"], built["ops"]))
    t0 = time.perf_counter()
    eng.replay(ops, n_slots=slots)
    dt = time.perf_counter() - t0
    events = eng.drain_events()[n_pro_events:]
    stats = eng.memory_stats()
    seg = events[np.isin(events["action"], SEGMENT_ACTIONS)]
    start_res = int(start["reserved_bytes.all.current"])
    act = seg["action"]
    size = seg["size"].astype(np.int64)
    res_curve = start_res + np.cumsum(np.where(np.isin(act, (A_SEG_ALLOC, A_MAP)), size, -size))
    result = ReplayResult(
        peak_reserved=max(start_res, int(res_curve.max()) if len(res_curve) else 0),
        device_mallocs=int((act == A_SEG_ALLOC).sum()),
        device_frees=int((act == A_SEG_FREE).sum()),
        maps=int((act == A_MAP).sum()),
        unmaps=int((act == A_UNMAP).sum()),
        retries=int(stats["num_alloc_retries"]) - int(start["num_alloc_retries"]),
        ooms=int(stats["num_ooms"]) - int(start["num_ooms"]),
        segment_events=seg,
        fragmentation_at_peak=_frag_at_peak(events, start_res,
                                            int(start["requested_bytes.all.current"])),
        final_stats=stats,
        start_reserved=start_res,
        n_ops=len(built["ops"]),
        replay_seconds=dt,
        inferred_empty_cache=len(built["empty_cache_at"]),
        layout=eng.layout() if keep_layout else [],
    )
    eng.close()
    return result
