"""The allocator event vocabulary shared by the C engine, the snapshot reader/writer and the simulator.

Action codes are stable integers (they appear in the compact binary trace format and in the C
core); names are PyTorch's snapshot ``action`` strings.
"""

from __future__ import annotations

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
)
ACTION_CODE: dict[str, int] = {name: code for code, name in enumerate(ACTIONS)}
