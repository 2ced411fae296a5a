"""Whole-trace replay: a recorded allocator trace through the C engine in one call.

``replay_trace(trace)`` turns a :class:`~accel_graph.allocator.traces.model.Trace`'s events into one
:data:`~accel_graph.allocator.core.records.OP_DTYPE` array (vectorised with numpy) and runs it with a
single :meth:`Engine.replay`. Before that, a short prologue (a second, small ``replay`` call)
rebuilds the allocator state at the trace's start when the recording began mid-run.

Mapping (see docs/allocator-fidelity.md):

- ``alloc`` -> ``malloc`` of the requested size into a fresh slot per allocation (the engine
  rounds it as the profile's device does: ``EngineSettings.round_extra``, the ``xpu`` policy),
  or ``malloc_pool`` into an engine private pool when the event's ``pool`` is nonzero, or, when
  it is 0, when the final segment holding it is in a private pool (:func:`~.trace_state.infer_pools`);
- ``free_completed`` -> ``free`` of the slot allocated last at that address (``free_requested``
  is ignored: the engine completes cross-stream frees itself, and the real trace's completion
  time is the ``free_completed`` event);
- streams -> engine stream ids 0..63 in order of first appearance;
- a run of consecutive ``segment_free``/``segment_unmap`` events (whose frames, when there are
  any, name ``empty_cache``) -> one ``empty_cache`` op at the start of the run;
- frees of addresses never allocated in the trace, and active blocks of the final segments
  never touched by the trace, are the pre-existing state: allocated in the prologue in address
  order inside segments recreated with their recorded sizes.

Profiles (:mod:`.profiles`): ``replay_trace(profile=...)`` simulates one torch version on one
device; :func:`apply_profile` says which engine settings that changes, with notes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ..alloc_conf import settings_from_snapshot
from ..core.engine import Engine
from ..core.records import OP, OP_DTYPE
from ..core.settings import EngineSettings
from ..devices import config_dialect_of, rounding_rule_or_default
from ..traces.actions import (
    A_MAP,
    A_SEG_ALLOC,
    A_SEG_FREE,
    A_UNMAP,
    SEGMENT_ACTIONS,
    recording_peak_of,
)
from ..units import MIB
from .profiles import Profile, resolve_profile
from .results import ReplayResult, fragmentation_at_peak, usage_curves
from .trace_ops import build_ops, build_ops_reusing

__all__ = ["apply_profile", "replay_trace"]



def apply_profile(settings: EngineSettings, profile: Profile | str | None,
                  policy: str | None = None) -> tuple[EngineSettings, str, list[str]]:
    """Engine settings and policy that simulate ``profile`` (a :class:`Profile`, a profile
    name, or a device name) with the allocator ``settings`` the user asked for.

    Returns ``(settings, policy, notes)``; ``notes`` are human-readable lines saying what the
    profile changed or what the engine cannot model. Applied: the engine policy (unless
    ``policy`` is given), rounding (``round_extra``; ``roundup_power2_divisions`` forced to 0
    where the build ignores it), expandable segments where the build has none, the
    pytorch#193400 oversize rule (``expandable_oversize_rule``), and ``large_segment_size``
    fixed at the build's value where ``large_segment_size_mb`` is not honoured.
    """
    p = resolve_profile(profile)
    notes: list[str] = []
    pol = policy or p.policy
    if policy and policy != p.policy:
        notes.append(f"policy {policy!r} given explicitly; profile {p.name} uses {p.policy!r}")
    ch: dict[str, Any] = {}
    divs = settings.divisions()
    rule = rounding_rule_or_default(p.rounding)
    if rule.extra:
        ch["round_extra"] = rule.extra
        notes.append(f"{p.name}: requests rounded as ceil((size + {rule.extra}) / 512) * 512")
    elif settings.round_extra:
        ch["round_extra"] = 0
    if any(divs) and (not rule.power2_divisions or pol == "xpu" or not p.roundup_applied):
        ch["roundup_power2_divisions"] = 0
        notes.append(f"{p.name}: roundup_power2_divisions is not applied by this build; "
                     "simulated as 0")
    elif any(divs) and not p.roundup_gt_fills_after_last:
        notes.append(f"{p.name}: an older revision filled the roundup_power2_divisions '>' entry "
                     "from its own interval; the divisions are simulated as parsed")
    es = settings.expandable_segments and p.expandable_segments
    if settings.expandable_segments and not p.expandable_segments:
        ch["expandable_segments"] = False
        notes.append(f"{p.name}: expandable_segments:True is not available on this build "
                     "(torch warns and ignores it); simulated off")
    ch["expandable_oversize_rule"] = bool(p.max_split_blocks_expandable_reuse)
    if es and settings.max_split_size is not None and pol == "native":
        notes.append(
            f"{p.name}: max_split_size_mb with expandable segments: cached expandable blocks "
            + ("at or above max_split_size are kept from smaller requests (pytorch#193400; "
               "reserved can grow)" if p.max_split_blocks_expandable_reuse else
               "are reused regardless of max_split_size (torch 2.9-2.11 behaviour)"))
    if pol == "xpu" and settings.max_split_size is not None:
        notes.append(f"{p.name}: the xpu policy has no max_split_size rules; ignored")
    if ("large_segment_size_mb" not in p.settings_keys
            and settings.large_segment_size != p.large_segment_size):
        ch["large_segment_size"] = p.large_segment_size
        if settings.max_non_split_rounding_size == settings.large_segment_size:
            ch["max_non_split_rounding_size"] = None
        notes.append(f"{p.name}: large_segment_size_mb is not honoured by this build; "
                     f"kept at {p.large_segment_size // MIB} MiB")
    # Builds with large_segment_size_mb (2.13+) map large-pool expandable pages of
    # large_segment_size (torch-internals.md 4), as the engine does; older builds and NPU have a
    # fixed page, which differs from the engine's only if large_segment_size was forced above.
    if (es and "large_segment_size_mb" not in p.settings_keys
            and p.es_page_size != (ch.get("large_segment_size") or settings.large_segment_size)):
        notes.append(f"{p.name}: expandable large-pool page {p.es_page_size // MIB} MiB not "
                     "modelled; the engine maps large_segment_size pages")
    if es and p.expandable_large_align > 512:
        ch["expandable_head_align"] = p.expandable_large_align
        notes.append(f"{p.name}: blocks of 2 MiB or more in expandable segments start on "
                     f"{p.expandable_large_align // 1024} KiB boundaries (base_addr_aligned_kb)")
    elif settings.expandable_head_align:
        ch["expandable_head_align"] = 0
    return replace(settings, **ch), pol, notes


def _trace_settings(trace: Any, device: int) -> EngineSettings:
    # The trace's device kind picks the config dialect (a ROCm trace's settings read as "hip").
    parsed = settings_from_snapshot(trace.allocator_settings or {},
                                    config_dialect_of(trace.device_type))
    es = EngineSettings.from_allocator_settings(parsed)
    inferred = any(s.get("is_expandable") for s in trace.segments
                   if s.get("device", device) == device)
    if inferred and not es.expandable_segments:
        es = replace(es, expandable_segments=True)
    return es


def replay_trace(trace: Any, settings: Any = None, *, policy: str | None = None,
                 device: int = 0, profile: Profile | str | None = None,
                 expandable: bool | None = None, empty_cache: Any = None,
                 keep_layout: bool = False, keep_events: bool = False,
                 ops_cache: dict[Any, dict[str, Any]] | None = None) -> ReplayResult:
    """Replay one device's trace in the engine (one C call for the whole trace).

    ``settings``: an :class:`EngineSettings`, a parsed ``AllocatorSettings``, or None for the
    trace's own (``settings_from_snapshot``, with ``expandable_segments`` inferred from the
    final segments' ``is_expandable``). ``expandable`` overrides ``expandable_segments``.
    ``profile``: the torch version x device to simulate: a :class:`~.profiles.Profile`, a
    profile name (``"cuda-2.9"``, ``"rocm-6"``, ``"npu"``) or a device name (``"cuda"``,
    ``"rocm"``/``"hip"``, ``"npu"``, ``"xpu"``: its newest profile); None: the trace's device
    type. Applied with :func:`apply_profile`; ``result.notes`` say what it changed.
    ``policy``: the engine policy; None: the profile's.
    ``empty_cache``: as in :func:`build_ops` (None: inferred from the trace).
    ``keep_events``: keep the engine events after the prologue and the start statistics
    (``result.events``, ``result.start_stats``; see :meth:`ReplayResult.curves`).
    ``ops_cache``: a dict the caller keeps for this (unchanging) trace, to reuse the
    conversion across calls (:func:`build_ops_reusing`; identical results).
    """
    prof = resolve_profile(profile, trace.device_type)
    if settings is None:
        es = _trace_settings(trace, device)
    elif isinstance(settings, EngineSettings):
        es = settings
    else:
        es = EngineSettings.from_allocator_settings(settings)
    if expandable is not None and es.expandable_segments != expandable:
        es = replace(es, expandable_segments=expandable)
    es, pol, notes = apply_profile(es, prof, policy)
    convert: Any = (build_ops if ops_cache is None
                    else functools.partial(build_ops_reusing, ops_cache))
    built = convert(trace, device, prof, expandable=es.expandable_segments,
                    empty_cache=empty_cache, round_extra=es.round_extra)
    pools = built["pools"]
    if pools:
        notes.append(f"{len(pools)} private pool(s) from the trace's pool ids "
                     f"({', '.join(map(str, pools[:8]))}{', ...' if len(pools) > 8 else ''}) "
                     "replayed as engine pools that are never released")
    if built["pools_inferred"]:
        notes.append(f"{built['pools_inferred']} allocation(s) without a pool id placed in a "
                     "private pool inferred from the final segments' segment_pool_id (or a "
                     "pooled segment_alloc)")

    def make() -> Engine:
        e = Engine(pol, "counting", es, streams=max(1, built["n_streams"]))
        for i in range(len(pools)):
            if e.create_pool() != i + 1:  # pragma: no cover - the engine numbers pools from 1
                raise RuntimeError("engine pool ids are not 1..n")
        return e

    slots = built["n_slots"]
    # Slots live in one replay call, so the prologue and the trace run as one array. A first,
    # throw-away engine runs the prologue alone to learn its events and statistics (the engine
    # is deterministic, so they are the first events of the full run); a reset_peak_stats op
    # between the two makes the engine's peaks those of the trace.
    pro = make()
    pro.enable_events()
    if len(built["prologue"]):
        pro.replay(built["prologue"], n_slots=slots)
    n_pro_events = len(pro.drain_events())
    start = pro.memory_stats()
    pro.close()
    eng = make()
    eng.enable_events()
    reset = np.zeros(1, dtype=OP_DTYPE)
    reset["op"] = OP["reset_peak_stats"]
    ops = np.concatenate((built["prologue"], reset, built["ops"]))
    t0 = time.perf_counter()
    eng.replay(ops, n_slots=slots)
    dt = time.perf_counter() - t0
    events = eng.drain_events()[n_pro_events:]
    stats = eng.memory_stats()
    seg = events[np.isin(events["action"], SEGMENT_ACTIONS)]
    start_res = int(start["reserved_bytes.all.current"])
    start_req = int(start["requested_bytes.all.current"])
    res, req = usage_curves(events, start_res, start_req)
    act = seg["action"]
    result = ReplayResult(
        peak_reserved=max(start_res, int(res.max()) if len(res) else 0),
        peak_reserved_recording=(recording_peak_of(res, events["action"])[0] if len(res)
                                 else start_res),
        device_mallocs=int((act == A_SEG_ALLOC).sum()),
        device_frees=int((act == A_SEG_FREE).sum()),
        maps=int((act == A_MAP).sum()),
        unmaps=int((act == A_UNMAP).sum()),
        retries=int(stats["num_alloc_retries"]) - int(start["num_alloc_retries"]),
        ooms=int(stats["num_ooms"]) - int(start["num_ooms"]),
        segment_events=seg,
        fragmentation_at_peak=fragmentation_at_peak(res, req, start_res, start_req),
        final_stats=stats,
        start_reserved=start_res,
        n_ops=len(built["ops"]),
        replay_seconds=dt,
        inferred_empty_cache=len(built["empty_cache_at"]),
        layout=eng.layout() if keep_layout else None,
        peak_allocated=int(stats["allocated_bytes.all.peak"]),
        peak_active=int(stats["active_bytes.all.peak"]),
        peak_requested=int(stats["requested_bytes.all.peak"]),
        profile=prof.name,
        notes=notes,
        events=events if keep_events else None,
        start_stats=start if keep_events else None,
        pools={p: i + 1 for i, p in enumerate(pools)},
    )
    eng.close()
    return result
