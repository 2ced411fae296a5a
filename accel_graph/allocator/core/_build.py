"""cffi build script for the allocator's C core (API mode).

setup.py names ``accel_graph/allocator/core/_build.py:ffibuilder`` in ``cffi_modules``, so the core is
compiled when the package is installed (``pip install -e .``), never at import. The cdef is the
part of ``_core.h`` between the ``CDEF BEGIN``/``CDEF END`` markers, so the C header stays the one
place the API is declared. The core is the ``_core_*.c`` files (docs/allocator.md "The C core"),
compiled and linked into the one extension next to cffi's wrapper, which includes only ``_core.h``.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

#: The C core's translation units (headers: _core.h, the API; _core_internal.h and _core_sets.h,
#: shared between these files only).
SOURCES = (
    "_core_alloc.c",
    "_core_api.c",
    "_core_bfc.c",
    "_core_engine.c",
    "_core_events.c",
    "_core_native.c",
    "_core_plugin.c",
    "_core_pools.c",
    "_core_replay.c",
    "_core_segments.c",
    "_core_sets.c",
    "_core_stats.c",
    "_core_tensor.c",
    "_core_upstream.c",
)


def _cdef_text() -> str:
    header = (_HERE / "_core.h").read_text()
    begin = header.index("/* CDEF BEGIN */") + len("/* CDEF BEGIN */")
    end = header.index("/* CDEF END */")
    return header[begin:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "accel_graph.allocator.core._core",
    '#include "_core.h"',
    # relative to the working directory (the project root under pip), as setuptools expects
    sources=[os.path.relpath(_HERE / name) for name in SOURCES],
    include_dirs=[str(_HERE)],
    libraries=["dl"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":  # pragma: no cover - manual rebuild helper
    ffibuilder.compile(verbose=True)
