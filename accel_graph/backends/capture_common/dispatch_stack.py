"""The calling thread's torch dispatch-mode stack: reading it, and taking one mode off it
wherever it sits.

Both capturing modes need this (the recorder's ``RecordingMode`` and the native backends'
``ControlFlowMode``): a mode whose capture is over may sit below modes the user left open, and a
capture ended from another thread leaves its mode on the capturing thread's stack until that
thread next calls the backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["mode_stack", "remove_mode"]


def mode_stack() -> list[Any]:
    """The calling thread's torch dispatch modes, bottom first."""
    n = torch._C._len_torch_dispatch_stack()
    return [torch._C._get_dispatch_stack_at(i) for i in range(n)]


def remove_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off this thread's dispatch stack wherever it is. On top (the usual case)
    it is exited properly; below modes the user left open, those are lifted off and put back."""
    stack = mode_stack()
    if mode not in stack:
        return
    if stack[-1] is mode:
        try:
            mode.__exit__(None, None, None)
            return
        except Exception:  # flags of the mode disturbed by user code: pop it plainly below
            if torch._C._len_torch_dispatch_stack() < len(stack):
                return  # __exit__ popped it before failing
    above = []
    while torch._C._len_torch_dispatch_stack():
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)
