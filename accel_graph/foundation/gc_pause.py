"""``gc_paused()``: the cyclic garbage collector off for a block, its previous state restored
even on error. Used where a collection in the middle would cost time or run finalizers at the
wrong moment: graph capture (vLLM and SGLang freeze the GC for it) and building millions of
acyclic trace records."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC inside the block; re-enable it after only if it was enabled."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
