"""The one loader of the allocator's compiled parts: the cffi core and the DLPack extension.

Both are imported on first use, never built or opened at import of any accel_graph module. The
core (``accel_graph.allocator.core._core``) is compiled by ``_build.py`` at install time; a
missing build raises :class:`~accel_graph.errors.BackendUnavailable` saying how to rebuild. The
DLPack extension (``_dlpack``) is optional: without it :func:`load_dlpack` returns ``None`` and
pools build tensors over engine blocks the slower way.
"""

from __future__ import annotations

import importlib
from typing import Any

from ...errors import BackendUnavailable

__all__ = ["CORE_MODULE", "load_core", "load_dlpack"]

#: Import name of the cffi-built core; torch's plug-in loader opens the same shared object.
CORE_MODULE = "accel_graph.allocator.core._core"

_core_module: Any = None
_dlpack_module: Any = False  # False: not tried yet; None: unavailable


def load_core() -> Any:
    """The compiled core (``.ffi``, ``.lib``), imported once.

    Raises BackendUnavailable if it was never built.
    """
    global _core_module
    if _core_module is None:
        try:
            _core_module = importlib.import_module(CORE_MODULE)
        except ImportError as exc:
            raise BackendUnavailable(
                f"the allocator's C core ({CORE_MODULE}) is not built: reinstall the "
                "package to compile it, e.g. `pip install --no-build-isolation -e .` from the "
                f"repository root (needs a C compiler and cffi). Import error: {exc}"
            ) from exc
    return _core_module


def load_dlpack() -> Any:
    """The ``_dlpack`` extension bound to the core and to torch's DLPack importer, or ``None``
    when it is not built or cannot be bound (tried once)."""
    global _dlpack_module
    if _dlpack_module is False:
        _dlpack_module = None
        try:
            mod = importlib.import_module("accel_graph.allocator.core._dlpack")
            core = load_core()
            ffi, lib = core.ffi, core.lib
            alloc = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ag_tensor_alloc")))
            release = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ag_tensor_release")))
            drain = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ag_tensor_drain")))
            # torch only here, on first use of the optional DLPack maker: importing the
            # allocator must not import torch (start-up time; accel-alloc never needs it)
            import torch

            # torch >= 1.10 has the C importer; the Python wrapper is the fallback
            importer = getattr(torch._C, "_from_dlpack", None)
            if importer is None:
                from torch.utils.dlpack import from_dlpack as importer
            mod.bind(alloc, release, drain, importer)
            _dlpack_module = mod
        except (ImportError, AttributeError, BackendUnavailable):
            pass
    return _dlpack_module
