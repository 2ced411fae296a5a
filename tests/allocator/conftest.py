"""Shared helpers for the allocator-engine tests: a full consistency check of an Engine.

``check_engine(engine)`` recounts every statistic from the raw layout and checks the layout
itself; it is a session fixture so hypothesis tests can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch_stat_names import TORCH_STAT_NAMES

KINDS = ("all", "small_pool", "large_pool")


def _recount(engine: Any, layout: list[dict[str, Any]]) -> dict[str, int]:
    """Every statistic with a `current` value that the layout determines, recounted."""
    want: dict[str, int] = {}

    def add(name: str, kind: str, amount: int) -> None:
        for k in ("all", kind):
            key = f"{name}.{k}.current"
            want[key] = want.get(key, 0) + amount

    for name in TORCH_STAT_NAMES:
        for k in KINDS:
            want[f"{name}.{k}.current"] = 0
    max_split = engine.settings.max_split_size
    oversize_alloc = oversize_seg = 0
    for seg in layout:
        kind = "small_pool" if seg["is_small"] else "large_pool"
        blocks = seg["blocks"]
        if not seg["is_expandable"]:
            add("segment", kind, 1)
            add("reserved_bytes", kind, seg["size"])
            if engine.policy == "native" and max_split is not None and seg["size"] >= max_split:
                oversize_seg += 1
        for b in blocks:
            state = b["state"]
            if seg["is_expandable"] and state != "unmapped":
                add("reserved_bytes", kind, b["size"])
            if state == "active_allocated":
                add("allocation", kind, 1)
                add("allocated_bytes", kind, b["size"])
                if engine.policy == "native" and max_split is not None and b["size"] >= max_split:
                    oversize_alloc += 1
            if state in ("active_allocated", "active_pending_free"):
                add("active", kind, 1)
                add("active_bytes", kind, b["size"])
                add("requested_bytes", kind, b["requested_size"])
            if state == "inactive" and not seg["is_expandable"] and len(blocks) > 1:
                add("inactive_split", kind, 1)
                add("inactive_split_bytes", kind, b["size"])
    want["oversize_allocations.current"] = oversize_alloc
    want["oversize_segments.current"] = oversize_seg
    return want


def _check_engine(engine: Any) -> list[dict[str, Any]]:
    layout = engine.layout()
    # 1. blocks tile their segments, in address order, with no gaps or overlaps
    for seg in layout:
        addr = seg["address"]
        assert seg["blocks"], seg
        for b in seg["blocks"]:
            assert b["address"] == addr, (seg, b)
            assert b["size"] > 0
            assert b["stream"] == seg["stream"]
            addr += b["size"]
        assert addr == seg["address"] + seg["size"], seg
    # 2. segments never overlap each other
    spans = sorted((s["address"], s["address"] + s["size"]) for s in layout)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans
    # 3. merging is complete: no two neighbours that could merge are left apart
    for seg in layout:
        for a, b in zip(seg["blocks"], seg["blocks"][1:]):
            assert not (a["state"] == "inactive" and b["state"] == "inactive"), seg
            assert not (a["state"] == "unmapped" and b["state"] == "unmapped"), seg
    # 4. statistics equal a recount from the layout
    stats = engine.memory_stats()
    for key, value in _recount(engine, layout).items():
        assert stats[key] == value, (key, stats[key], value)
    for key, value in stats.items():
        if key.endswith(".current"):
            peak = stats[key[: -len("current")] + "peak"]
            assert 0 <= value <= peak, (key, value, peak)
    # 5. the counting upstream holds exactly the reserved bytes
    assert stats["accel.upstream_bytes"] == stats["reserved_bytes.all.current"]
    assert stats["num_device_alloc"] == stats["accel.device_mallocs"] + stats["accel.device_maps"]
    assert stats["num_device_free"] == stats["accel.device_frees"] + stats["accel.device_unmaps"]
    return layout


@pytest.fixture(scope="session")
def check_engine() -> Callable[[Any], list[dict[str, Any]]]:
    """Assert every layout and statistics invariant of an Engine; returns its layout."""
    return _check_engine
