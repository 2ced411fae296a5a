"""The Inductor configuration compiled replay compiles under, and why each setting is there.

:func:`inductor_settings` is patched around every compilation (``torch._inductor.config.patch``)
by :mod:`.inductor`; ``tools/profile_compiled.py`` measures the settings evaluated for speed
(docs/recorder.md, "Compiled replay").
"""

from __future__ import annotations

from typing import Any

from . import random_order

__all__ = ["inductor_settings"]


def inductor_settings(freeze: bool, cpp_wrapper: bool = False) -> dict[str, Any]:
    """The Inductor config compiled replay compiles under (docs/recorder.md, "Compiled replay").

    - ``fallback_random``: random ops call aten's kernels, so draws equal eager's after a seed;
      on a torch whose Inductor may reorder them (2.11), ``post_grad_custom_post_pass`` chains
      them in program order (:mod:`.random_order`).
    - ``emulate_precision_casts``: keep eager's rounding of fp16/bf16 intermediates, which
      Inductor otherwise elides when it fuses low-precision ops (results then differ from eager
      by more than the fp32 tolerance, e.g. ``(x.half() + 1).float()``).
    - ``size_asserts`` off: Inductor's Python wrapper would check the size and stride of every
      placeholder at every call (about 0.5 us each); replay already checks every input captured
      by reference for storage, shape and stride first (a stale input raises ``ReplayError``),
      and the other placeholders are pool memory and static outputs compile_program materializes.
      About 7 % of a batch-1 decode step (``tools/profile_compiled.py``).
    - ``freezing`` only with ``compile_options={"freeze": True}`` (:mod:`.freezing`).
    - ``cpp_wrapper`` only with ``compile_options={"cpp_wrapper": True}``: 24 % faster batch-1
      decode steps, but 4-5x the cold compilation time on this project's 2-core machine.
    """
    settings: dict[str, Any] = {"fallback_random": True, "emulate_precision_casts": True,
                                "size_asserts": False}
    # A torch whose Inductor does not keep random ops in program order (2.11) gets the pass
    # that does (:mod:`.random_order`); nothing on later torches.
    settings.update(random_order.ordering_settings())
    if freeze:
        settings["freezing"] = True
    if cpp_wrapper:
        settings["cpp_wrapper"] = True
    return settings
