"""Build hook: compiles the allocator's C core with cffi at install time, never at import.

Next to it, ``accel_graph.allocator.core._dlpack``: a small CPython extension (limited API) that makes
a tensor over an engine block in one call through DLPack (docs/allocator.md "Tensor blocks").
It is optional at run time: without it, pools build such tensors the slower way.
"""

from pathlib import Path

from setuptools import Extension, setup

_HERE = Path(__file__).parent
_BUILD = _HERE / "accel_graph" / "allocator" / "core" / "_build.py"
_DLPACK = Path("accel_graph") / "allocator" / "core" / "_dlpack.c"

setup(
    cffi_modules=[f"{_BUILD.relative_to(_HERE)}:ffibuilder"] if _BUILD.exists() else [],
    ext_modules=[
        Extension(
            "accel_graph.allocator.core._dlpack",
            [str(_DLPACK)],
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
    if (_HERE / _DLPACK).exists()
    else [],
)
