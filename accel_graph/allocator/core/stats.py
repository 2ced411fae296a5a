"""Turn the C core's raw statistics and layout into PyTorch's shapes.

Contract:

- :func:`memory_stats_dict` gives the flat, key-sorted dict of ``torch.cuda.memory_stats()``
  (``allocation.all.current``, ``num_alloc_retries``, ``oversize_allocations.peak``,
  ``max_split_size`` ...), plus extra counters under an ``accel.`` prefix that torch lacks:
  device mallocs, frees, maps and unmaps, and the bytes the upstream holds.
- :func:`snapshot_segments` gives ``torch.cuda.memory_snapshot()``'s Segment dicts, sorted by
  address; an expandable segment is reported as one segment per contiguous mapped range, as
  torch does.
- :func:`oom_message` gives torch's out-of-memory text for the numbers of a failed request.
- :func:`trace_entries` gives engine events as the trace-entry dicts of
  ``torch.cuda.memory._snapshot()``'s ``device_traces``.

Pure functions over plain data: no cffi here, so they can be tested and reused without the core.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..traces.actions import ACTIONS

#: torch's StatArray keys, in the C core's index order.
POOL_KINDS = ("all", "small_pool", "large_pool")
#: StatArray statistics (torch's DeviceStats fields, in ag_stats order).
ARRAY_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
SCALAR_STATS = ("oversize_allocations", "oversize_segments")
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)
#: Ours, not torch's: torch folds maps into num_device_alloc and unmaps into num_device_free.
EXTRA_COUNTERS = {
    "accel.device_mallocs": "device_mallocs",
    "accel.device_frees": "device_frees",
    "accel.device_maps": "device_maps",
    "accel.device_unmaps": "device_unmaps",
    "accel.upstream_bytes": "upstream_bytes",
    "accel.upstream_peak_bytes": "upstream_peak_bytes",
}
STAT_FIELDS = ("current", "peak", "allocated", "freed")

#: Block states as torch's snapshot spells them (the C core's AG_BLOCK_* order).
BLOCK_STATES = ("inactive", "active_allocated", "active_pending_free", "unmapped")


def memory_stats_dict(raw: Any, max_split_size: int | None) -> dict[str, int]:
    """Flatten an ``ag_stats`` struct (anything with its attributes) into torch's dict.

    ``max_split_size`` is reported as torch does: ``-1`` when unlimited.
    """
    out: dict[str, int] = {}
    for name in ARRAY_STATS:
        arr = getattr(raw, name)
        for i, kind in enumerate(POOL_KINDS):
            stat = arr[i]
            for f in STAT_FIELDS:
                out[f"{name}.{kind}.{f}"] = int(getattr(stat, f))
    for name in SCALAR_STATS:
        stat = getattr(raw, name)
        for f in STAT_FIELDS:
            out[f"{name}.{f}"] = int(getattr(stat, f))
    for name in COUNTERS:
        out[name] = int(getattr(raw, name))
    out["max_split_size"] = -1 if max_split_size is None else int(max_split_size)
    for key, attr in EXTRA_COUNTERS.items():
        out[key] = int(getattr(raw, attr))
    return dict(sorted(out.items()))


def _segment_dict(
    seg: Mapping[str, Any], blocks: Sequence[Mapping[str, Any]], device: int
) -> dict[str, Any]:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = [b for b in blocks if b["state"] != "inactive"]
    return {
        "device": device,
        "address": blocks[0]["address"],
        "total_size": sum(b["size"] for b in blocks),
        "allocated_size": allocated,
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": seg["stream"],
        "segment_type": "small" if seg["is_small"] else "large",
        "segment_pool_id": (0, seg["pool_id"]),
        "is_expandable": bool(seg["is_expandable"]),
        "frames": [],
        "blocks": [
            {
                "address": b["address"],
                "size": b["size"],
                "requested_size": b["requested_size"],
                "state": b["state"],
                "frames": [],
            }
            for b in blocks
        ],
    }


def snapshot_segments(layout: Iterable[Mapping[str, Any]], device: int = 0) -> list[dict[str, Any]]:
    """Torch-shaped segments from the raw layout (see ``Engine.layout``).

    Unmapped blocks never appear: an expandable address range contributes one segment per run
    of mapped blocks, and nothing when it is entirely unmapped.
    """
    out: list[dict[str, Any]] = []
    for seg in layout:
        blocks = seg["blocks"]
        if not seg["is_expandable"]:
            out.append(_segment_dict(seg, blocks, device))
            continue
        run: list[Mapping[str, Any]] = []
        for b in [*blocks, None]:
            if b is not None and b["state"] != "unmapped":
                run.append(b)
            elif run:
                out.append(_segment_dict(seg, run, device))
                run = []
    out.sort(key=lambda s: s["address"])
    return out


def format_size(size: int) -> str:
    """torch's ``format_size``: bytes up to 1 KiB, then KiB/MiB/GiB with two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


UNBOUNDED = (1 << 64) - 1


def oom_message(info: Any, device_name: str, device_index: int, conf_var: str) -> str:
    """torch's CUDA out-of-memory text for an ``ag_oom_info`` (kind 1) or the 1 EB refusal (kind 2).

    The expandable-segments hint is left out when expandable segments are already on, as newer
    torch does (pytorch/pytorch#173051).
    """
    if info.kind == 2:
        return f"{device_name} out of memory. Tried to allocate more than 1EB memory."
    private = int(info.cached_in_private_pools)
    allocated = int(info.allocated) + private
    unallocated = int(info.reserved) - allocated
    if info.capacity == UNBOUNDED:
        capacity = f"GPU {device_index} has no capacity limit; "
    else:
        capacity = (
            f"GPU {device_index} has a total capacity of {format_size(int(info.capacity))} "
            f"of which {format_size(int(info.device_free))} is free. "
        )
    allowed = f"{format_size(int(info.allowed))} allowed; " if info.fraction_set else ""
    pools = (
        f"with {format_size(private)} allocated in private pools (e.g., CUDA Graphs), "
        if private
        else ""
    )
    msg = (
        f"{device_name} out of memory. Tried to allocate {format_size(int(info.alloc_size))}. "
        f"{capacity}{allowed}Of the allocated memory {format_size(allocated)} is allocated by "
        f"PyTorch, {pools}and {format_size(unallocated)} is reserved by PyTorch but unallocated."
    )
    if not info.expandable_segments:
        msg += (
            " If reserved but unallocated memory is large try setting"
            f" {conf_var}=expandable_segments:True to avoid fragmentation.  See documentation for"
            " Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
    return msg


def trace_entries(events: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    """Engine events ``(seq, time_us, addr, size, pool_id, stream, action)`` as torch's
    trace-entry dicts (``oom`` carries ``device_free`` instead of ``addr``)."""
    out = []
    for _seq, time_us, addr, size, pool_id, stream, action in events:
        name = ACTIONS[action]
        entry: dict[str, Any] = {"action": name}
        entry["device_free" if name == "oom" else "addr"] = int(addr)
        entry.update(size=int(size), stream=int(stream), time_us=int(time_us), frames=[])
        if pool_id:
            entry["pool_id"] = int(pool_id)
        out.append(entry)
    return out
