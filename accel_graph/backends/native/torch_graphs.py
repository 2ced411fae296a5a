"""What torch's graph classes offer the native backends, feature-detected (GPU hosts may run
torch 2.11): the keywords ``capture_begin`` accepts, and what ``torch.cuda.CUDAGraph`` gives.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..base import CAPTURE_ERROR_MODES, Capabilities

__all__ = ["CUDA_GRAPH_CAPABILITIES", "begin_params", "capture_begin_params"]

#: What torch.cuda.CUDAGraph gives the cuda and hip backends (HIP reuses the CUDA API).
CUDA_GRAPH_CAPABILITIES = Capabilities(
    native_graphs=True,
    capture_error_modes=CAPTURE_ERROR_MODES,
    standalone_bytes=False,
    compile=False,
    foreign_pool_handles=True,
)


def begin_params(graph: Any) -> frozenset[str]:
    """Keyword arguments ``graph.capture_begin`` accepts (torch 2.11 lacks some; XPU takes only
    ``pool``; ``torch.accelerator.Graph`` in 2.13 takes none and reads attributes instead)."""
    return capture_begin_params(type(graph))


@functools.lru_cache(maxsize=32)
def capture_begin_params(cls: type) -> frozenset[str]:
    """Keyword arguments ``cls.capture_begin`` accepts (cached per class)."""
    try:
        return frozenset(inspect.signature(cls.capture_begin).parameters) - {"self"}
    except (TypeError, ValueError):  # a C function without a signature: assume torch's CUDA form
        return frozenset({"pool", "capture_error_mode"})
