"""Build hook: compiles the allocator's C core with cffi at install time, never at import."""

from pathlib import Path

from setuptools import setup

_BUILD = Path(__file__).parent / "accel_graph" / "allocator" / "_build.py"

setup(cffi_modules=[f"{_BUILD.relative_to(Path(__file__).parent)}:ffibuilder"] if _BUILD.exists() else [])
