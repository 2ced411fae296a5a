"""The allocator event vocabulary shared by the C engine, the snapshot reader/writer and the simulator.

Action codes are stable integers (they appear in the compact binary trace format and in the C
core); names are PyTorch's snapshot ``action`` strings.
"""

from __future__ import annotations

import numpy as np

#: PyTorch snapshot action names by code. Never renumber: the compact format stores the codes.
ACTIONS: tuple[str, ...] = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    # torch 2.14 (_annotate_tensor): metadata attached to a live allocation; allocates nothing
    "annotate",
)
ACTION_CODE: dict[str, int] = {name: code for code, name in enumerate(ACTIONS)}

# Named codes, for vectorised code over event arrays (``ev["action"] == A_ALLOC``).
A_ALLOC = ACTION_CODE["alloc"]
A_FREE_REQ = ACTION_CODE["free_requested"]
A_FREE = ACTION_CODE["free_completed"]
A_SEG_ALLOC = ACTION_CODE["segment_alloc"]
A_SEG_FREE = ACTION_CODE["segment_free"]
A_MAP = ACTION_CODE["segment_map"]
A_UNMAP = ACTION_CODE["segment_unmap"]
A_OOM = ACTION_CODE["oom"]
A_SNAPSHOT = ACTION_CODE["snapshot"]
#: ``addr`` is the annotated allocation's base address; the text is the event's user_metadata.
A_ANNOTATE = ACTION_CODE["annotate"]
#: Events that change reserved memory: growth (allocate, map) and shrinkage (free, unmap).
GROW_ACTIONS = (A_SEG_ALLOC, A_MAP)
SHRINK_ACTIONS = (A_SEG_FREE, A_UNMAP)
SEGMENT_ACTIONS = GROW_ACTIONS + SHRINK_ACTIONS


def reserved_delta(events: np.ndarray) -> np.ndarray:
    """How each event of a structured array (``action``, ``size``: a trace's or the engine's)
    changes reserved bytes: +size for segment_alloc/map, -size for segment_free/unmap, else 0
    (int64). Its cumulative sum is the reserved curve."""
    act = events["action"]
    size = events["size"].astype(np.int64)
    # two comparisons per kind: several times faster than np.isin on the event arrays a tuning
    # search replays hundreds of times
    grow = (act == A_SEG_ALLOC) | (act == A_MAP)
    shrink = (act == A_SEG_FREE) | (act == A_UNMAP)
    return np.where(grow, size, 0) - np.where(shrink, size, 0)


def recording_peak(start: int, events: np.ndarray) -> tuple[int, int]:
    """The peak reserved that the recording itself produced, and its state (after that many
    events): the highest reserved right after a growth event (segment_alloc / segment_map).

    The whole-trace peak (``max(start, ...)``) includes the start state, which a recording that
    begins with a full cache inherits from before it (a benchmark's earlier calls, then
    ``empty_cache`` right after recording starts): there every setting gives the same
    whole-trace peak. A trace without growth events produced no reserved memory of its own; its
    peak is the highest reserved after its first event (the start when it has none, state 0).
    """
    if not len(events):
        return int(start), 0
    return recording_peak_of(start + np.cumsum(reserved_delta(events)), events["action"])


def recording_peak_of(res: np.ndarray, actions: np.ndarray) -> tuple[int, int]:
    """:func:`recording_peak` from the reserved bytes after each event (``res``, non-empty) and
    the events' action codes, for a caller that has the curve already."""
    grow = np.flatnonzero((actions == A_SEG_ALLOC) | (actions == A_MAP))
    if len(grow):
        i = int(grow[np.argmax(res[grow])])
    else:
        i = int(np.argmax(res))
    return int(res[i]), i + 1
