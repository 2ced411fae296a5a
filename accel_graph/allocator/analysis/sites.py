"""Allocation sites: the top user stack frame of each allocation, and the bytes each site holds
at a moment of a :class:`~.walk.Layout` (the ``sites`` section of ``accel-alloc inspect``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .walk import Layout, Pairs

__all__ = ["NO_FRAMES_SITE", "PRE_EXISTING_SITE", "held_by_site", "site_ids", "stack_sites", "top_user_frame"]

PRE_EXISTING_SITE = "(allocated before the recording began)"
NO_FRAMES_SITE = "(no stack frames)"


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




def stack_sites(trace: Any) -> tuple[np.ndarray, list[str]]:
    """(site id per stack, labels): id 0 is "no stack frames", 1 "allocated before the recording
    began", then one id per distinct top user frame."""
    labels = [NO_FRAMES_SITE, PRE_EXISTING_SITE]
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


def site_ids(stack_ids: np.ndarray, frames: np.ndarray) -> np.ndarray:
    f = frames.astype(np.int64)
    ok = (f >= 0) & (f < len(stack_ids))
    return np.where(ok, stack_ids[np.where(ok, f, 0)] if len(stack_ids) else 0, 0)


def held_by_site(trace: Any, ev: np.ndarray, pairs: Pairs, req: np.ndarray, lay: Layout,
                 top: int) -> tuple[list[dict[str, Any]], str | None]:
    """Allocation sites by requested bytes live at the moment of ``lay``, then by bytes
    allocated over the whole trace."""
    if not (len(ev) and (ev["frames"] >= 0).any()):
        return [], "no stack frames recorded"
    stack_ids, labels = stack_sites(trace)
    ids = site_ids(stack_ids, ev["frames"][pairs.alloc_idx])
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
