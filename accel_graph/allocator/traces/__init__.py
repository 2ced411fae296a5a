"""Allocator traces: the :class:`Trace` model, its action codes, and one reader/writer front.

:func:`load_trace` sniffs the format (a PyTorch memory snapshot pickle, our JSON or compact
binary, an RMM logging CSV) and returns a :class:`Trace`; :func:`save_trace` writes one
atomically (module ``files``). ``record`` holds the event record, limits and sniffing; ``model`` holds :class:`Trace`, ``segments`` its data checks and
derived segments. Each format has its own module (``torch_snapshot``, ``compact``, ``rmm_csv``;
``safe_pickle`` refuses every global). Nothing here imports torch.
"""

from __future__ import annotations

from ...errors import TraceFormatError
from .files import load_trace, save_trace
from .model import Trace, TraceReport
from .record import DEVICE_TYPES, TRACE_DTYPE, TraceLimits
from .segments import segments_from_layout

__all__ = [
    "DEVICE_TYPES",
    "TRACE_DTYPE",
    "Trace",
    "TraceFormatError",
    "TraceLimits",
    "TraceReport",
    "load_trace",
    "save_trace",
    "segments_from_layout",
]
