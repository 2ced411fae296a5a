"""What a recorded allocator trace did: peaks, utilisation, the waste at the peak and its causes.

:func:`inspect_trace` is the library behind ``accel-alloc inspect``. It reads one device's events
of a :class:`~accel_graph.allocator.traces.model.Trace` (no replay, no C engine) and answers:

- what was recorded: device type, allocator settings (or that none were), events by action,
  streams, timestamps, whether the recording began mid-run;
- the peaks of reserved, allocated, requested and active bytes, and utilisation;
- the bytes reserved but not requested at the peak of reserved, split into causes that add up
  exactly (:data:`WASTE_COMPONENTS`), each with the knob or code change that removes it;
- the allocation sites (top user stack frame) holding the most bytes at that moment.

The layout at one moment and the split of its waste are :mod:`.layout`'s. Everything per event
is vectorised with numpy (traces can have millions of events); Python loops
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

from typing import Any

import numpy as np

from ..devices import device_kind_or_default
from ..traces.actions import (
    A_ALLOC,
    A_ANNOTATE,
    A_FREE,
    A_FREE_REQ,
    SEGMENT_ACTIONS,
    recording_peak,
    reserved_delta,
)
from ..traces.torch_snapshot import host_memory_counts
from .layout import ADVICE, SMALL_SIZE, WASTE_COMPONENTS, layout_state, split_waste
from .sites import FRAME_RULE, held_by_site
from .walk import NEVER, Pairs, curve, final_segments, prepare, rounding_choice

__all__ = [
    "ADVICE",
    "SCHEMA",
    "WASTE_COMPONENTS",
    "inspect_trace",
]

SCHEMA = "accel-alloc/inspect/1"

def _settings_info(trace: Any, device: int) -> dict[str, Any]:
    rec = trace.allocator_settings
    segs = final_segments(trace, device)
    if isinstance(rec, dict) and isinstance(rec.get("expandable_segments"), bool):
        es, source = rec["expandable_segments"], "recorded"
    elif segs:
        es = any(bool(s.get("is_expandable")) for s in segs)
        source = "inferred from the final segments' is_expandable"
    else:
        es, source = None, "unknown (no settings and no final segments)"
    return {"recorded": rec, "expandable_segments": es, "expandable_segments_source": source,
            "config_variable": device_kind_or_default(trace.device_type).config_variable}



def _annotations_at(trace: Any, ev: np.ndarray, device: int, k: int, pairs: Pairs,
                    untouched: list[tuple[int, int, int, bool, int]]) -> dict[str, Any]:
    """torch 2.14's ``annotate`` events (``_annotate_tensor``) that name a block live at state
    ``k``: each annotation made after the live block at its address was allocated (or on a
    block live since before the recording), with its text (the event's ``user_metadata``)."""
    idx = np.flatnonzero(ev["action"] == A_ANNOTATE)
    out: dict[str, Any] = {"total": int(len(idx)), "on_blocks_live_at_peak": []}
    if not len(idx):
        return out
    # address -> index of the alloc event of the block live there at k (-1: from before)
    born: dict[int, int] = {int(u[0]): -1 for u in untouched if u[3]}
    born.update((int(a), -1) for a in pairs.pre_addr[pairs.pre_fr >= k].tolist())
    live = pairs.alloc_idx[(pairs.alloc_idx < k) & (pairs.fr_idx >= k)]
    born.update(zip(ev["addr"][live].tolist(), live.tolist(), strict=True))
    for i in idx[idx < k].tolist():
        addr = int(ev["addr"][i])
        if born.get(addr, i) < i:
            extra = trace.event_extras.get((device, i), {})
            out["on_blocks_live_at_peak"].append(
                {"event_index": i, "addr": addr, "text": str(extra.get("user_metadata", ""))})
    return out


def inspect_trace(trace: Any, device: int = 0, top: int = 10, *, profile: str | None = None,
                  torch: str | None = None) -> dict[str, Any]:
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
    - ``annotations`` lists torch 2.14's ``annotate`` events on blocks live at that moment;
      ``host_memory`` counts the snapshot's pinned host records (``host_segments``,
      ``host_traces``; None when it has none), which no figure here includes.
    - ``torch`` (a version, as ``accel-alloc --torch``) chooses the rounding profile and the
      rules that read the recorded config string; ``profile`` overrides the profile; neither:
      the newest of the trace's device (:func:`~.walk.rounding_choice`). ``profile`` and
      ``config_rules`` in the result say what was used.
    - Nothing is modified; the result holds only JSON types (dict, list, str, int, float, bool,
      None).
    """
    if top < 0:
        raise ValueError("top must be >= 0")
    ev = trace.events(device)
    if len(ev) and int(ev["addr"].max()) >= 1 << 63:
        # the loaders refuse these (TraceFormatError); a trace built in memory may still hold
        # one, and the layout below works in int64 (an OverflowError otherwise)
        raise ValueError(f"device {device}: an event address of {int(ev['addr'].max()):#x} is "
                         "at or above 2^63, which no device hands out; the trace is corrupt")
    n = len(ev)
    act = ev["action"]
    prof, rules, chosen_by = rounding_choice(trace, profile, torch)
    prep = prepare(trace, device, prof, rules)
    pairs, req, blk, pre_blk, untouched, profile = (
        prep.pairs, prep.req, prep.blk, prep.pre_blk, prep.untouched, prep.profile)
    final = final_segments(trace, device)
    u_live = [u for u in untouched if u[3]]
    start_requested = int(pairs.pre_size.sum()) + sum(u[2] for u in u_live)
    start_allocated = int(pre_blk.sum()) + sum(u[1] for u in u_live)
    start_active = int(pre_blk.sum()) + sum(u[1] for u in untouched)

    # -- curves --------------------------------------------------------------------------------
    seg_delta = np.concatenate(([0], np.cumsum(reserved_delta(ev))))
    final_reserved = sum(int(s["total_size"]) for s in final)
    start_reserved = final_reserved - int(seg_delta[-1])
    reserved = start_reserved + seg_delta
    requested = curve(n, start_requested, pairs.alloc_idx, req,
                       np.concatenate((pairs.fr_idx, pairs.pre_fr)),
                       np.concatenate((req, pairs.pre_size)))
    allocated = curve(n, start_allocated, pairs.alloc_idx, blk,
                       np.concatenate((pairs.fr_idx, pairs.pre_fr)), np.concatenate((blk, pre_blk)))
    active = curve(n, start_active, pairs.alloc_idx, blk,
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
    layout = layout_state(trace, ev, device, k, pairs, req, blk, pre_blk, untouched)
    waste, seg_info = split_waste(layout, main_stream, trigger, int(reserved[k]), int(requested[k]))

    # -- sites ---------------------------------------------------------------------------------
    sites, sites_note = held_by_site(trace, ev, pairs, req, layout, top)
    rec_peak, rec_state = recording_peak(start_reserved, ev)
    if rec_state:  # the growth event precedes its alloc: on the plateau it starts, the fullest
        run = np.flatnonzero(reserved[rec_state:] != rec_peak)
        end = rec_state + (int(run[0]) if len(run) else n + 1 - rec_state)
        rec_state += int(np.argmax(requested[rec_state:end]))
    at_rec: dict[str, Any] = {"state": rec_state, "after_event_index": rec_state - 1,
                              "reserved": int(reserved[rec_state]),
                              "requested": int(requested[rec_state]),
                              "same_as_at_peak": rec_state == k}
    if rec_state != k and top and not sites_note:
        # the whole-trace peak is elsewhere (the inherited start state, say): who holds the
        # bytes at the recording's own peak is what the recording can change
        rec_layout = layout_state(trace, ev, device, rec_state, pairs, req, blk, pre_blk, untouched)
        rec_sites, _ = held_by_site(trace, ev, pairs, req, rec_layout, top)
        at_rec["sites"], at_rec["stacks"] = rec_sites["sites"], rec_sites["stacks"]

    counts = trace.action_counts(device)
    pre_frees = int((pairs.pre_fr != NEVER).sum())
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
        "config_rules": {"torch": rules.name, "chosen_by": chosen_by},
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
            "reserved_scope": "whole trace: the start state included",
            "reserved_event_index": first_peak - 1,
            "reserved_is_start_state": first_peak == 0,
            "reserved_in_recording": rec_peak,
            "reserved_in_recording_state": rec_state,
            "reserved_in_recording_scope": (
                "the recording's own: the highest reserved right after a segment_alloc/map "
                "event (the start state, inherited from before the recording, excluded)"),
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
        "at_recording_peak": at_rec,
        "annotations": _annotations_at(trace, ev, device, k, pairs, untouched),
        "host_memory": host_memory_counts(trace.extra),
        "waste_at_peak": waste,
        "advice": advice,
        **sites,
        "sites_note": sites_note,
        "sites_rule": FRAME_RULE,
    }
