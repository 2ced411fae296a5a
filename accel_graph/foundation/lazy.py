"""Lazy public names for a package: ``__getattr__``/``__dir__`` that import on first access.

Used by ``accel_graph`` and ``accel_graph.allocator`` so that importing them runs nothing heavy
(torch, the C core); a name is imported from its submodule the first time it is read, then kept
in the package's namespace.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``; ``table`` maps a public name to the relative
    module that defines it (``{"parse_config": ".alloc_conf"}``)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
