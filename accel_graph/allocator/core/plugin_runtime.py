"""What the device plug-in (:mod:`.device_plugin`) needs from outside this package, checked
before use: the shared object torch loads (:func:`library_path`, :func:`check_library` for the
two ``CUDAPluggableAllocator`` entry points, :func:`control_functions` for the cffi control
functions) and torch's pluggable-allocator pieces (:func:`cuda_memory`, :func:`runtime_kind`,
:func:`cuda_initialized`), feature-detected per call so tests can substitute fakes.

Every missing piece raises :class:`~accel_graph.BackendUnavailable` naming it and what to do.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from ...errors import BackendUnavailable
from .loader import CORE_MODULE, load_core

__all__ = [
    "ALLOC_SYMBOL",
    "CONTROL_SYMBOLS",
    "FREE_SYMBOL",
    "REBUILD",
    "check_library",
    "control_functions",
    "core_path",
    "cuda_initialized",
    "cuda_memory",
    "library_path",
    "runtime_kind",
    "same_file",
]

#: The exported ``CUDAPluggableAllocator`` entry points (looked up by torch with ctypes).
ALLOC_SYMBOL = "ag_pluggable_alloc"
FREE_SYMBOL = "ag_pluggable_free"
#: Control functions the Python side calls through cffi (see the report / docs/backends.md).
CONTROL_SYMBOLS = (
    "ag_pluggable_install",
    "ag_pluggable_uninstall",
    "ag_engine_set_threadsafe",
    "ag_pluggable_errors",
    "ag_pluggable_last_error",
)

#: The advice every "library lacks a symbol" message ends with.
REBUILD = (
    "rebuild the allocator core with a version that exports them "
    "(`pip install --no-build-isolation -e .` from the repository root); until then use "
    "torch's own allocator"
)


# ----------------------------------------------------------------------------------------------
# the shared library


def library_path() -> str:
    """Path of the compiled core (cffi's extension module), the ``.so`` torch will load."""
    return core_path(load_core())


def core_path(core: Any) -> str:
    """:func:`library_path` of an already loaded ``core`` module (the device plug-in passes
    the core it binds engines in, so both name the same file)."""
    path = getattr(core, "__file__", None)
    if not path:
        raise BackendUnavailable(
            "the allocator core module has no file path, so torch cannot load it with ctypes; "
            "install accel-graph from source so the core is a shared object on disk"
        )
    return str(path)


def check_library(path: str | None = None) -> str:
    """Load ``path`` (default :func:`library_path`) with ``ctypes.CDLL``, as torch will, and
    check it exports :data:`ALLOC_SYMBOL` and :data:`FREE_SYMBOL`. Returns the path.

    Raises :class:`BackendUnavailable` naming the path tried and what to do.
    """
    path = library_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise BackendUnavailable(
            f"allocator library {path!r} does not exist; pass the path of a built "
            f"{CORE_MODULE} shared object, or omit it to use the installed one"
        )
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise BackendUnavailable(
            f"could not load allocator library {path!r} with ctypes.CDLL: {exc}; check that it "
            f"was built for this platform and Python, or {REBUILD}"
        ) from exc
    missing = [s for s in (ALLOC_SYMBOL, FREE_SYMBOL) if not hasattr(lib, s)]
    if missing:
        raise BackendUnavailable(
            f"allocator library {path!r} loads but does not export {', '.join(missing)} "
            f"(the CUDAPluggableAllocator entry points); {REBUILD}"
        )
    return path


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (False when either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def control_functions(core: Any) -> Any:
    """``core.lib`` once it is known to export every :data:`CONTROL_SYMBOLS` function; else
    :class:`BackendUnavailable` naming the missing ones."""
    lib = core.lib
    missing = [s for s in CONTROL_SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise BackendUnavailable(
            f"the allocator core ({getattr(core, '__file__', CORE_MODULE)}) "
            f"lacks the plug-in control functions {', '.join(missing)}; {REBUILD}"
        )
    return lib


# ----------------------------------------------------------------------------------------------
# torch pieces (feature-detected; looked up per call so tests can substitute fakes)


def cuda_memory() -> Any:
    """``torch.cuda.memory`` once it has ``CUDAPluggableAllocator``; else BackendUnavailable."""
    cuda = getattr(torch, "cuda", None)
    mem = getattr(cuda, "memory", None)
    if mem is None or not hasattr(mem, "CUDAPluggableAllocator"):
        raise BackendUnavailable(
            f"torch {torch.__version__} has no torch.cuda.memory.CUDAPluggableAllocator; "
            f"the device allocator plug-in needs a CUDA or ROCm build of torch"
        )
    return mem


def runtime_kind() -> str:
    """The runtime of the running torch build: ``"hip"`` (ROCm) or ``"cuda"``."""
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def cuda_initialized() -> bool:
    """Whether CUDA is initialised in this process (False where torch cannot say)."""
    fn = getattr(torch.cuda, "is_initialized", None)
    return bool(fn()) if fn is not None else False
