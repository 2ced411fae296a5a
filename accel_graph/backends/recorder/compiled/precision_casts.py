"""Can Inductor's CPU code keep eager's fp16/bf16 rounding? If not, compiled replay refuses.

Compiled replay compiles with ``emulate_precision_casts`` (:mod:`.settings`) so a fused
kernel rounds every fp16/bf16 intermediate as eager does. Inductor's C++ (CPU) code generator
honours it only in torch releases that carry pytorch#185337: before it, ``CppOverrides.to_dtype``
caches the fp32 -> fp16 -> fp32 round trip as the fp32 value itself, whatever the setting, so
``(x.half() + 1).float()`` skips both roundings (4e-4 off eager on torch 2.11; the setting does
nothing there on the CPU). Triton (GPU) code honours the setting in every supported release.

:func:`refusal` says why a CPU program holding fp16/bf16 tensors cannot be compiled faithfully
on such a torch; the caller raises it as ``CompileUnsupported``, so the graph replays
interpreted with that reason (docs/recorder.md, "Compiled replay"), never a silently different
result. Detection reads the code generator's source (a feature check: the fix is exactly
``to_dtype`` consulting the setting); a torch whose source cannot be read is treated as lacking
it, the safe side.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from ..pool_protocol import PoolRef
from ..steps import Step

__all__ = ["LOW_PRECISION", "cpu_codegen_keeps_casts", "program_steps", "refusal"]

# torch._inductor is imported inside the functions below, on first use: importing it takes
# seconds, and most processes never compile. Each import is feature-detected there (torch
# 2.11 to 2.14 differ).

#: The float dtypes whose intermediate rounding Inductor may elide.
LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.cache
def cpu_codegen_keeps_casts() -> bool:
    """True when this torch's C++ code generator honours ``emulate_precision_casts`` (its
    ``to_dtype`` reads the setting). Never raises; imports Inductor's codegen (only asked when
    a CPU program has fp16/bf16 tensors, right before compiling it, which imports it anyway)."""
    try:
        from torch._inductor.codegen import cpp

        return all("emulate_precision_casts" in inspect.getsource(cls.to_dtype)
                   for cls in (cpp.CppOverrides, cpp.CppVecOverrides))
    except Exception:  # no source (stripped install), renamed classes: assume the old code
        return False


def program_steps(steps: Iterable[Any]) -> Iterable[Step]:
    """``steps`` and, depth first, the sub-programs of their control flow (``Step.extra``)."""
    for step in steps:
        if not isinstance(step, Step):
            continue
        yield step
        if step.kind in ("cond", "while") and isinstance(step.extra, tuple):
            for sub in step.extra:
                if isinstance(sub, list):
                    yield from program_steps(sub)


def _low_precision(x: Any) -> bool:
    if isinstance(x, (PoolRef, torch.Tensor)):
        return x.dtype in LOW_PRECISION
    if isinstance(x, (list, tuple)):
        return any(_low_precision(y) for y in x)
    if isinstance(x, dict):
        return any(_low_precision(y) for y in x.values())
    return False


def refusal(steps: list[Step], device_type: str) -> str | None:
    """Why the program ``steps`` on ``device_type`` cannot be compiled with eager's rounding,
    or None when it can: a CPU program with an fp16/bf16 tensor (read, written or made) on a
    torch whose C++ code generator ignores ``emulate_precision_casts``."""
    if device_type != "cpu":
        return None
    for step in program_steps(steps):
        if _low_precision((step.args, step.kwargs, step.outputs)):
            if cpu_codegen_keeps_casts():
                return None
            return (f"{step.func} works on float16/bfloat16, and torch {torch.__version__}'s "
                    f"Inductor CPU code ignores emulate_precision_casts (pytorch#185337), so a "
                    f"fused kernel would skip eager's rounding of its intermediates")
    return None
