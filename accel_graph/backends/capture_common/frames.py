"""The user's source line that an error or a finding about an op names.

Capture refusals (the recorder's), ``check_capturable`` findings and baked-value reports all
name "the line that called it": the innermost Python frame outside torch and accel_graph.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_frame"]

# accel_graph/ itself: this module is accel_graph/backends/capture_common/frames.py.
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_frame() -> str:
    """``file:line in function`` of the innermost caller outside torch and accel_graph: the
    user's line that an error about an op should name."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = os.path.abspath(frame.f_code.co_filename)
        if not (fname.startswith(_TORCH_DIR) or fname.startswith(_PKG_DIR)) or "/tests/" in fname:
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"
