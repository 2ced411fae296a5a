"""The record layouts the C core exchanges with Python in bulk: the replay ops
(:data:`OP_DTYPE`, opcodes :data:`OP`) that :meth:`~.engine.Engine.replay` runs in one C call,
and the events (:data:`EVENT_DTYPE`) that :meth:`~.engine.Engine.drain_events` returns.

Both mirror structs of ``_core.h`` (``ag_op``, ``ag_event``, ``AG_OP_*``) field for field; a test
checks the sizes. Simulators build op arrays with these without touching an engine.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EVENT_DTYPE", "EVENT_FIELDS", "OP", "OP_DTYPE", "OP_FIELDS"]

#: Opcodes of :meth:`Engine.replay` (``AG_OP_*`` in _core.h).
OP = {
    "malloc": 0,
    "free": 1,
    "record_stream": 2,
    "process_events": 3,
    "synchronize": 4,
    "empty_cache": 5,
    "begin_pool": 6,
    "end_pool": 7,
    "release_pool": 8,
    "malloc_pool": 9,
    "reset_peak_stats": 10,
    "set_requested": 11,
}
#: numpy layouts of ``ag_event`` and ``ag_op`` (kept in step with _core.h; a test checks sizes).
EVENT_FIELDS = [
    ("seq", "<i8"),
    ("time_us", "<i8"),
    ("addr", "<u8"),
    ("size", "<u8"),
    ("pool_id", "<i8"),
    ("stream", "<i4"),
    ("action", "<i4"),
]
OP_FIELDS = [("op", "<i4"), ("stream", "<i4"), ("size", "<i8"), ("id", "<i8"), ("size2", "<i8")]


EVENT_DTYPE = np.dtype(EVENT_FIELDS)
OP_DTYPE = np.dtype(OP_FIELDS)
