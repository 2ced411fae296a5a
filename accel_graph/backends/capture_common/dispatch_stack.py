"""The calling thread's torch dispatch-mode stack: reading it, and taking one mode off it
wherever it sits.

Both capturing modes need this (the recorder's ``RecordingMode`` and the native backends'
``ControlFlowMode``): a mode whose capture is over may sit below modes the user left open, and a
capture ended from another thread leaves its mode on the capturing thread's stack until that
thread next calls the backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["lifted", "mode_stack", "remove_mode"]


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


@contextmanager
def lifted(mode: TorchDispatchMode) -> Iterator[None]:
    """Run the block with ``mode`` off this thread's dispatch stack (modes above it stay, in
    order), and put it back where it was afterwards, whatever the block raised. The mode is
    neither exited nor entered: its own state is untouched (an eager island runs this way
    inside a capture). A no-op if ``mode`` is not on the stack."""
    stack = mode_stack()
    if mode not in stack:
        yield
        return
    depth = stack.index(mode)
    above = []
    while torch._C._len_torch_dispatch_stack() > depth:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is not mode:
            above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)
    try:
        yield
    finally:
        # Modes the block left open above ours stay above it, as they would have in eager.
        rest = []
        while torch._C._len_torch_dispatch_stack() > depth:
            rest.append(torch._C._pop_torch_dispatch_stack(None))
        torch._C._push_on_torch_dispatch_stack(mode)
        for m in reversed(rest):
            torch._C._push_on_torch_dispatch_stack(m)
