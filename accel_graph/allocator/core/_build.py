"""cffi build script for the allocator's C core (API mode).

setup.py names ``accel_graph/allocator/core/_build.py:ffibuilder`` in ``cffi_modules``, so the core is
compiled when the package is installed (``pip install -e .``), never at import. The cdef is the
part of ``_core.h`` between the ``CDEF BEGIN``/``CDEF END`` markers, so the C header stays the one
place the API is declared.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent


def _cdef_text() -> str:
    header = (_HERE / "_core.h").read_text()
    begin = header.index("/* CDEF BEGIN */") + len("/* CDEF BEGIN */")
    end = header.index("/* CDEF END */")
    return header[begin:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "accel_graph.allocator.core._core",
    # The whole core is one translation unit: the extension compiles _core.c's text directly.
    (_HERE / "_core.c").read_text(),
    include_dirs=[str(_HERE)],
    libraries=["dl"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":  # pragma: no cover - manual rebuild helper
    ffibuilder.compile(verbose=True)
