"""What a recorded allocator trace did: peaks, utilisation, the waste at the peak and its causes.

:func:`inspect_trace` is the library behind ``accel-alloc inspect``. It reads one device's events
of a :class:`~accel_graph.allocator.traces.model.Trace` (no replay, no C engine) and answers:

- what was recorded: device type, allocator settings (or that none were), events by action,
  streams, timestamps, whether the recording began mid-run;
- the peaks of reserved, allocated, requested and active bytes, and utilisation;
- the bytes reserved but not requested at the peak of reserved, split into causes that add up
  exactly (:data:`WASTE_COMPONENTS`), each with the knob or code change that removes it;
- the allocation sites (top user stack frame) holding the most bytes at that moment.

Everything per event is vectorised with numpy (traces can have millions of events); Python loops
only over segment events, stacks and the segments alive at one moment.

Definitions (see docs/accel-alloc-inspect.md for the field-by-field contract):

- *requested*: sum of the requested sizes of live allocations (up at ``alloc``, down at
  ``free_requested``, like torch's ``requested_bytes``);
- *allocated*: the same in block bytes (requests rounded by the device's rule, see
  :func:`~accel_graph.allocator.sim.profiles.round_requests`; blocks still live at the end take their
  recorded size from the final segments);
- *active*: allocated plus blocks freed but not yet reusable (up at ``alloc``, down at
  ``free_completed``);
- *reserved*: sum of segment bytes (``segment_alloc``/``segment_map`` up,
  ``segment_free``/``segment_unmap`` down).

All four include the state that existed before the recording began: start reserved = the final
segments' bytes minus the trace's net segment change; start live blocks = active blocks of the
final segments at addresses the trace never touches, plus the first free of every address the
trace frees without having allocated it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..traces.actions import (
    A_ALLOC,
    A_FREE,
    A_FREE_REQ,
    A_MAP,
    A_SEG_ALLOC,
    A_SEG_FREE,
    SEGMENT_ACTIONS,
    reserved_delta,
)

__all__ = [
    "ADVICE",
    "SCHEMA",
    "WASTE_COMPONENTS",
    "inspect_trace",
    "layout_at",
    "top_user_frame",
]

SCHEMA = "accel-alloc/inspect/1"
MIB = 1 << 20
#: torch's kSmallSize: blocks of at most this many bytes come from the small pool.
SMALL_SIZE = MIB

_NEVER = np.iinfo(np.int64).max

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
        "cached segments with nothing live: nothing to fix in the allocator (it releases them "
        "before an out-of-memory error); call empty_cache() only if another process needs the memory"
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

_ENV = {"cuda": "PYTORCH_ALLOC_CONF", "rocm": "PYTORCH_ALLOC_CONF",
        "xpu": "PYTORCH_ALLOC_CONF", "npu": "PYTORCH_NPU_ALLOC_CONF"}  # fmt: skip
_ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
_PRE_EXISTING_SITE = "(allocated before the recording began)"
_NO_FRAMES_SITE = "(no stack frames)"


# ------------------------------------------------------------------------------------------
# stack frames


def _is_internal(filename: str) -> bool:
    """True for frames of torch itself, torch_npu, or a ``<...>`` pseudo-file."""
    if not filename or filename.startswith("<"):
        return True
    parts = filename.replace("\\", "/").split("/")
    return "torch" in parts[:-1] or "torch_npu" in parts[:-1]


def top_user_frame(stack: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The frame an allocation is attributed to: the first (innermost) frame that is not in a
    ``torch/`` or ``torch_npu/`` directory (which covers ``site-packages/torch``) and not a
    ``<...>`` pseudo-file such as ``<frozen runpy>``; the first frame when every frame is such a
    frame; None for an empty stack. Directories are matched as whole path components, so
    ``torchvision/`` or ``mytorch/`` frames count as user frames."""
    frames = [f for f in stack if isinstance(f, dict)]
    if not frames:
        return None
    for f in frames:
        if not _is_internal(str(f.get("filename", ""))):
            return f
    return frames[0]


def _site_label(frame: dict[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} ({frame.get('name', '?')})"


# ------------------------------------------------------------------------------------------
# event pairing (vectorised)


@dataclass
class _Pairs:
    """Each ``alloc`` (in event order) with its ``free_requested``/``free_completed``
    (``_NEVER``: none), and the pre-existing blocks the trace frees without allocating them."""

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
    (``_NEVER`` when none)."""
    n = len(mask)
    pos = np.where(mask, np.arange(n, dtype=np.int64), _NEVER)
    nxt = np.minimum.accumulate(pos[::-1])[::-1]
    out = np.full(n, _NEVER, np.int64)
    if n > 1:
        out[:-1] = nxt[1:]
    ok = out != _NEVER
    ok[ok] = group[out[ok]] == group[ok]
    return np.where(ok, out, _NEVER)


def _pair(ev: np.ndarray) -> _Pairs:
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
    fr_p = np.where(fr_p < bound, fr_p, _NEVER)
    fc_p = np.where(fc_p < bound, fc_p, _NEVER)
    # a free_completed with no free_requested before it: treat it as both
    fr_p = np.where((fr_p == _NEVER) | ((fc_p != _NEVER) & (fc_p < fr_p)), fc_p, fr_p)

    def to_idx(p: np.ndarray) -> np.ndarray:
        out = np.full(len(p), _NEVER, np.int64)
        ok = p != _NEVER
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
    g_fr = np.full(len(groups), _NEVER, np.int64)
    g_fc = np.full(len(groups), _NEVER, np.int64)
    g_fr[np.searchsorted(groups, group[fr_pos])] = i_s[fr_pos]
    g_fc[np.searchsorted(groups, group[fc_pos])] = i_s[fc_pos]
    g_fr = np.minimum(g_fr, g_fc)  # a lone free_completed frees it too
    first_ev = np.minimum(g_fr, g_fc)
    by_time = np.argsort(i_s[ap], kind="stable")
    return _Pairs(
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
class _Seg:
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


def _final_segments(trace: Any, device: int) -> list[dict[str, Any]]:
    return [s for s in trace.segments if int(s.get("device", device)) == device]


def _add_range(ranges: list[_Seg], new: _Seg) -> list[_Seg]:
    """Add a mapped range, merging with touching ranges of the same stream and pool."""
    out = sorted(ranges + [new], key=lambda s: s.addr)
    merged: list[_Seg] = []
    for s in out:
        last = merged[-1] if merged else None
        if (last is not None and s.addr <= last.addr + last.size and last.stream == s.stream
                and last.private == s.private):
            end = max(last.addr + last.size, s.addr + s.size)
            last.size = end - last.addr
            last.kind = last.kind or s.kind
        else:
            merged.append(_Seg(s.addr, s.size, s.stream, s.private, True, s.kind))
    return merged


def _sub_range(ranges: list[_Seg], lo: int, hi: int) -> list[_Seg]:
    out = []
    for s in ranges:
        a, b = s.addr, s.addr + s.size
        if b <= lo or a >= hi:
            out.append(s)
            continue
        if a < lo:
            out.append(_Seg(a, lo - a, s.stream, s.private, True, s.kind))
        if b > hi:
            out.append(_Seg(hi, b - hi, s.stream, s.private, True, s.kind))
    return out


class _SegmentWalk:
    """Segments at the start of the trace (final segments with the segment events undone), and
    at any later event count (start plus the segment events before it)."""

    def __init__(self, trace: Any, ev: np.ndarray, device: int) -> None:
        final = _final_segments(trace, device)
        self.final_kind = {int(s["address"]): s.get("segment_type") for s in final}
        self.final_private = {int(s["address"]): _private(s.get("segment_pool_id")) for s in final}
        native: dict[int, _Seg] = {}
        mapped: list[_Seg] = []
        for s in final:
            seg = _Seg(int(s["address"]), int(s["total_size"]), int(s.get("stream", 0)),
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

    def _new(self, addr: int, size: int, stream: int, pool: int, expandable: bool) -> _Seg:
        private = pool != 0 or self.final_private.get(addr, False)
        return _Seg(addr, size, stream, private, expandable, self.final_kind.get(addr))

    def at(self, k: int) -> list[_Seg]:
        """Segments after the first ``k`` events, sorted by address."""
        native = {a: _Seg(**vars(s)) for a, s in self.start_native.items()}
        mapped = [_Seg(**vars(s)) for s in self.start_mapped]
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


def _block_sizes(trace: Any, sizes: np.ndarray) -> tuple[np.ndarray, str]:
    """Block sizes of requests under the trace's device rounding rule (and recorded
    roundup_power2_divisions), plus the profile name used."""
    from ..sim.profiles import resolve_profile, round_requests

    prof = resolve_profile(None, trace.device_type)
    sizes = np.maximum(np.asarray(sizes, np.int64), 1)
    divisions = None
    if trace.allocator_settings:
        try:
            from ..alloc_conf import settings_from_snapshot

            dev = {"rocm": "hip", "xpu": "xpu"}.get(trace.device_type or "cuda", "cuda")
            s = settings_from_snapshot(trace.allocator_settings, dev)
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


def _curve(n: int, start: int, plus_idx: np.ndarray, plus: np.ndarray,
           minus_idx: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Values at states 0..n (state k: after the first k events)."""
    delta = np.zeros(n + 1, np.int64)
    ok = plus_idx != _NEVER
    np.add.at(delta, plus_idx[ok] + 1, plus[ok])
    ok = minus_idx != _NEVER
    np.add.at(delta, minus_idx[ok] + 1, -minus[ok])
    return start + np.cumsum(delta)


def _settings_info(trace: Any, device: int) -> dict[str, Any]:
    rec = trace.allocator_settings
    segs = _final_segments(trace, device)
    if isinstance(rec, dict) and isinstance(rec.get("expandable_segments"), bool):
        es, source = rec["expandable_segments"], "recorded"
    elif segs:
        es = any(bool(s.get("is_expandable")) for s in segs)
        source = "inferred from the final segments' is_expandable"
    else:
        es, source = None, "unknown (no settings and no final segments)"
    return {"recorded": rec, "expandable_segments": es, "expandable_segments_source": source,
            "config_variable": _ENV.get(trace.device_type or "cuda", "PYTORCH_ALLOC_CONF")}


@dataclass
class _Prepared:
    pairs: _Pairs
    req: np.ndarray  # requested size per alloc (event order)
    blk: np.ndarray  # block size per alloc
    pre_blk: np.ndarray  # block size per pre-existing freed block
    untouched: list[tuple[int, int, int, bool, int]]  # final blocks the trace never touches:
    #                                                   (addr, size, requested, allocated, stream)
    profile: str


def _prepare(trace: Any, device: int) -> _Prepared:
    """Pair the events, size the blocks and find the pre-existing state (all vectorised but the
    loop over the final segments' blocks)."""
    ev = trace.events(device)
    pairs = _pair(ev)

    # -- start state ---------------------------------------------------------------------------
    final = _final_segments(trace, device)
    untouched: list[tuple[int, int, int, bool, int]] = []
    final_live: dict[int, int] = {}
    for s in final:
        for b in s.get("blocks", ()):
            if b.get("state") in _ACTIVE_STATES:
                a = int(b["address"])
                final_live[a] = int(b["size"])
                untouched.append((a, int(b["size"]), int(b.get("requested_size") or 0),
                                  b.get("state") == "active_allocated",
                                  int(s.get("stream", 0))))
    if untouched:
        ua = np.array([u[0] for u in untouched], np.int64)
        keep = ~np.isin(ua, pairs.touched)
        untouched = [u for u, k in zip(untouched, keep.tolist(), strict=True) if k]

    # -- block sizes ---------------------------------------------------------------------------
    req = ev["size"][pairs.alloc_idx].astype(np.int64)
    blk, profile = _block_sizes(trace, req)
    if final_live and len(pairs.alloc_idx):
        # blocks live at the end: their recorded size (covers unsplit remainders)
        end_live = pairs.fr_idx == _NEVER
        a = ev["addr"][pairs.alloc_idx].astype(np.int64)
        fa = np.array(sorted(final_live), np.int64)
        fs = np.array([final_live[x] for x in fa.tolist()], np.int64)
        pos = np.clip(np.searchsorted(fa, a), 0, len(fa) - 1)
        hit = end_live & (fa[pos] == a) & (fs[pos] >= req)
        blk = np.where(hit, fs[pos], blk)
    pre_blk = _block_sizes(trace, pairs.pre_size)[0] if len(pairs.pre_size) else np.zeros(0, np.int64)
    return _Prepared(pairs, req, blk, pre_blk, untouched, profile)


def inspect_trace(trace: Any, device: int = 0, top: int = 10) -> dict[str, Any]:
    """Diagnose one device of a recorded trace; returns the ``accel-alloc/inspect/1`` document
    without the ``trace`` (file name) field.

    Contract:

    - ``trace`` is a :class:`~accel_graph.allocator.traces.model.Trace`; ``device`` its device index
      (a device without events gives a report of the start state); ``top`` (>= 0) the number of
      allocation sites to list.
    - Peaks are exact for the recorded events plus the reconstructed start state.
    - ``waste_at_peak`` splits reserved minus requested at the peak-of-reserved moment into
      :data:`WASTE_COMPONENTS`; the values are ints >= 0 except ``unattributed`` (0 for a
      consistent trace) and sum exactly to ``at_peak.reserved - at_peak.requested``.
    - The moment is the state (after some number of events) with the highest reserved bytes;
      among equal ones, the one with the most requested bytes (so that the transient state
      between a ``segment_alloc`` and its ``alloc`` is not picked).
    - Nothing is modified; the result holds only JSON types (dict, list, str, int, float, bool,
      None).
    """
    if top < 0:
        raise ValueError("top must be >= 0")
    ev = trace.events(device)
    n = len(ev)
    act = ev["action"]
    prep = _prepare(trace, device)
    pairs, req, blk, pre_blk, untouched, profile = (
        prep.pairs, prep.req, prep.blk, prep.pre_blk, prep.untouched, prep.profile)
    final = _final_segments(trace, device)
    u_live = [u for u in untouched if u[3]]
    start_requested = int(pairs.pre_size.sum()) + sum(u[2] for u in u_live)
    start_allocated = int(pre_blk.sum()) + sum(u[1] for u in u_live)
    start_active = int(pre_blk.sum()) + sum(u[1] for u in untouched)

    # -- curves --------------------------------------------------------------------------------
    seg_delta = np.concatenate(([0], np.cumsum(reserved_delta(ev))))
    final_reserved = sum(int(s["total_size"]) for s in final)
    start_reserved = final_reserved - int(seg_delta[-1])
    reserved = start_reserved + seg_delta
    requested = _curve(n, start_requested, pairs.alloc_idx, req,
                       np.concatenate((pairs.fr_idx, pairs.pre_fr)),
                       np.concatenate((req, pairs.pre_size)))
    allocated = _curve(n, start_allocated, pairs.alloc_idx, blk,
                       np.concatenate((pairs.fr_idx, pairs.pre_fr)), np.concatenate((blk, pre_blk)))
    active = _curve(n, start_active, pairs.alloc_idx, blk,
                    np.concatenate((pairs.fc_idx, pairs.pre_fc)), np.concatenate((blk, pre_blk)))
    peak_reserved = int(reserved.max())
    plateau = np.flatnonzero(reserved == peak_reserved)
    k = int(plateau[np.argmax(requested[plateau])])
    first_peak = int(plateau[0])

    # -- streams -------------------------------------------------------------------------------
    alloc_streams = ev["stream"][pairs.alloc_idx]
    streams = np.unique(ev["stream"][np.isin(act, (A_ALLOC, A_FREE_REQ, A_FREE) + SEGMENT_ACTIONS)])
    if len(alloc_streams):
        su, sc = np.unique(alloc_streams, return_counts=True)
        main_stream: int | None = int(su[np.argmax(sc)])
    else:
        main_stream = int(streams[0]) if len(streams) else None

    # -- the request that set the peak (for the pool boundary) ---------------------------------
    trigger = None
    if first_peak > 0:
        after = int(np.searchsorted(pairs.alloc_idx, first_peak - 1))
        if after < len(pairs.alloc_idx):
            trigger = {"event_index": int(pairs.alloc_idx[after]), "requested": int(req[after]),
                       "block": int(blk[after]),
                       "pool": "large" if int(blk[after]) > SMALL_SIZE else "small",
                       "stream": int(alloc_streams[after])}

    # -- layout and waste at the moment k ------------------------------------------------------
    layout = _layout_at(trace, ev, device, k, pairs, req, blk, pre_blk, untouched)
    waste, seg_info = _waste(layout, main_stream, trigger, int(reserved[k]), int(requested[k]))

    # -- sites ---------------------------------------------------------------------------------
    sites, sites_note = _sites(trace, ev, pairs, req, layout, top)

    counts = trace.action_counts(device)
    pre_frees = int((pairs.pre_fr != _NEVER).sum())
    n_pre = len(pairs.pre_addr) + len(untouched)
    settings = _settings_info(trace, device)
    env = settings["config_variable"]
    advice = [{"component": c, "bytes": int(waste[c]), "advice": ADVICE[c].format(env=env)}
              for c in sorted((c for c in WASTE_COMPONENTS if waste[c] > 0),
                              key=lambda c: (-waste[c], WASTE_COMPONENTS.index(c)))]
    # advice that depends on the trace: replaces the generic line of its component
    specific: dict[str, str] = {}
    if settings["expandable_segments"]:
        specific["free_in_live_segments"] = (
            "free gaps inside segments that hold live blocks, with expandable segments already "
            "on (page and alignment slack, blocks pinned between live ones): free in LIFO "
            "order, allocate long-lived tensors first, or reuse buffers in one arena")
    if profile == "npu":
        specific["internal_rounding"] = (
            "rounding of requests to block sizes: torch_npu adds 32 bytes and rounds up to 512, "
            "so a request of a multiple of 512 bytes wastes 512; size buffers as 512*k - 32 "
            "bytes, or pad to fewer, larger tensors")
    for a in advice:
        a["advice"] = specific.get(a["component"], a["advice"])
    peak_active = int(active.max())
    return {
        "schema": SCHEMA,
        "device": device,
        "device_type": trace.device_type,
        "profile": profile,
        "settings": settings,
        "events": {
            "total": n,
            "by_action": counts,
            "streams": len(streams),
            "stream_ids": [int(s) for s in streams],
            "main_stream": main_stream,
            "has_timestamps": bool(n and (ev["time_us"] != -1).any()),
            "has_stack_frames": bool(n and (ev["frames"] >= 0).any()),
            "starts_mid_run": bool(n_pre or start_reserved),
            "pre_existing_blocks": n_pre,
            "pre_existing_frees": pre_frees,
        },
        "start": {"reserved": start_reserved, "requested": start_requested,
                  "allocated": start_allocated, "active": start_active},
        "peaks": {
            "reserved": peak_reserved,
            "reserved_event_index": first_peak - 1,
            "allocated": int(allocated.max()),
            "requested": int(requested.max()),
            "active": peak_active,
            "final_reserved": final_reserved,
            "utilisation": round(peak_active / peak_reserved, 6) if peak_reserved else None,
            "utilisation_definition": "peak active / peak reserved",
            "utilisation_at_peak_reserved": (round(int(active[k]) / peak_reserved, 6)
                                             if peak_reserved else None),
        },
        "at_peak": {
            "state": k,
            "after_event_index": k - 1,
            "reserved": int(reserved[k]),
            "requested": int(requested[k]),
            "allocated": int(allocated[k]),
            "active": int(active[k]),
            "trigger": trigger,
            **seg_info,
        },
        "waste_at_peak": waste,
        "advice": advice,
        "sites": sites,
        "sites_note": sites_note,
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
    prep = _prepare(trace, device)
    lay = _layout_at(trace, ev, device, k, prep.pairs, prep.req, prep.blk, prep.pre_blk,
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


@dataclass
class _Layout:
    segs: list[_Seg]
    addr: np.ndarray  # live and pending blocks, sorted by address
    size: np.ndarray  # block bytes (refined: clipped to the next block / segment end, plus
    #                   unsplit remainders in large non-expandable segments)
    req: np.ndarray  # requested bytes (0 for pending blocks)
    live: np.ndarray  # bool: allocated (else freed, awaiting free_completed)
    seg: np.ndarray  # index into segs, -1 outside every segment
    site: np.ndarray  # site id per block (see _stack_sites)
    rule_size: np.ndarray  # block size by the rounding rule (pool class)


def _layout_at(trace: Any, ev: np.ndarray, device: int, k: int, pairs: _Pairs, req: np.ndarray,
               blk: np.ndarray, pre_blk: np.ndarray, untouched: list[Any]) -> _Layout:
    """Segments and blocks after the first ``k`` events (vectorised over blocks)."""
    segs = _SegmentWalk(trace, ev, device).at(k)
    ai = pairs.alloc_idx
    on = (ai < k) & (pairs.fc_idx >= k)
    live_a = on & (pairs.fr_idx >= k)
    pre_on = pairs.pre_fc >= k
    pre_live = pairs.pre_fr >= k
    a_site = _site_ids(_stack_sites(trace)[0], ev["frames"][ai[on]])
    addr = np.concatenate((ev["addr"][ai[on]].astype(np.int64), pairs.pre_addr[pre_on],
                           np.array([u[0] for u in untouched], np.int64)))
    size = np.concatenate((blk[on], pre_blk[pre_on], np.array([u[1] for u in untouched], np.int64)))
    rq = np.concatenate((req[on], pairs.pre_size[pre_on],
                         np.array([u[2] for u in untouched], np.int64)))
    live = np.concatenate((live_a[on], pre_live[pre_on],
                           np.array([u[3] for u in untouched], bool)))
    site = np.concatenate((a_site, np.ones(int(pre_on.sum()) + len(untouched), np.int64)))
    o = np.argsort(addr, kind="stable")
    addr, size, rq, live, site = addr[o], size[o], rq[o], live[o], site[o]
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
    return _Layout(segs, addr, size, rq, live, si, site, rule)


def _waste(lay: _Layout, main_stream: int | None, trigger: dict[str, Any] | None,
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


def _stack_sites(trace: Any) -> tuple[np.ndarray, list[str]]:
    """(site id per stack, labels): id 0 is "no stack frames", 1 "allocated before the recording
    began", then one id per distinct top user frame."""
    labels = [_NO_FRAMES_SITE, _PRE_EXISTING_SITE]
    index: dict[str, int] = {}
    ids = np.zeros(len(trace.stacks), np.int64)
    for i, st in enumerate(trace.stacks):
        f = top_user_frame(st)
        if f is None:
            continue
        label = _site_label(f)
        if label not in index:
            index[label] = len(labels)
            labels.append(label)
        ids[i] = index[label]
    return ids, labels


def _site_ids(stack_ids: np.ndarray, frames: np.ndarray) -> np.ndarray:
    f = frames.astype(np.int64)
    ok = (f >= 0) & (f < len(stack_ids))
    return np.where(ok, stack_ids[np.where(ok, f, 0)] if len(stack_ids) else 0, 0)


def _sites(trace: Any, ev: np.ndarray, pairs: _Pairs, req: np.ndarray, lay: _Layout,
           top: int) -> tuple[list[dict[str, Any]], str | None]:
    """Allocation sites by requested bytes live at the moment of ``lay``, then by bytes
    allocated over the whole trace."""
    if not (len(ev) and (ev["frames"] >= 0).any()):
        return [], "no stack frames recorded"
    stack_ids, labels = _stack_sites(trace)
    ids = _site_ids(stack_ids, ev["frames"][pairs.alloc_idx])
    m = len(labels)
    total_b = np.zeros(m, np.int64)
    np.add.at(total_b, ids, req)
    total_n = np.bincount(ids, minlength=m)
    live_b = np.zeros(m, np.int64)
    np.add.at(live_b, lay.site[lay.live], lay.req[lay.live])
    live_n = np.bincount(lay.site[lay.live], minlength=m)
    rows = [{"site": labels[i], "live_at_peak_bytes": int(live_b[i]),
             "live_at_peak_count": int(live_n[i]), "allocated_bytes": int(total_b[i]),
             "allocations": int(total_n[i])}
            for i in range(m) if live_n[i] or total_n[i]]
    rows.sort(key=lambda r: (-r["live_at_peak_bytes"], -r["allocated_bytes"], r["site"]))
    return rows[:top], None
