"""The torch releases accel-graph is verified on, and the one warning for any other.

:data:`VERIFIED` is the single list (the lead adjusts it as releases are run through the suite);
``import accel_graph`` calls :func:`warn_if_unverified` once. Outside the list accel-graph
still imports and runs: the warning names the verified releases so a bug report can say which
one was used. It never raises: a version that cannot be read or parsed is treated as unverified.

Reading the version must not import torch (``accel-alloc`` and ``accel_graph.allocator`` start
without it): when torch is already imported its ``__version__`` is used, else the one line of
``torch/version.py`` is read from where Python would import torch (``find_spec``, no import).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings

__all__ = [
    "VERIFIED",
    "UnsupportedTorchWarning",
    "installed_torch_version",
    "is_verified",
    "release_of",
    "unverified_message",
    "warn_if_unverified",
]

#: torch releases (major.minor) the suite has been run on and passes; any patch release of them.
VERIFIED: tuple[str, ...] = ("2.11", "2.13", "2.14")

_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


class UnsupportedTorchWarning(UserWarning):
    """The installed torch is outside :data:`VERIFIED`: accel-graph may work, but was not run
    on it. Silence with ``warnings.filterwarnings("ignore", category=UnsupportedTorchWarning)``."""


def release_of(version: str) -> str | None:
    """``"2.14.1+cu130"`` -> ``"2.14"``; None when ``version`` does not start with major.minor."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def is_verified(version: str) -> bool:
    """Whether ``version``'s release is in :data:`VERIFIED`."""
    return release_of(version) in VERIFIED


def installed_torch_version() -> str | None:
    """torch's version without importing torch, or None when torch is not found or unreadable."""
    mod = sys.modules.get("torch")
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return str(mod.__version__)
    try:
        spec = importlib.util.find_spec("torch")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in locations:
            path = os.path.join(root, "version.py")
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    m = _VERSION_LINE.search(f.read(65536))
                return m.group(1) if m else None
    except Exception:  # an odd installation: no version, no crash
        return None
    return None


def unverified_message(version: str) -> str | None:
    """The warning text for ``version``, or None when it is verified."""
    if is_verified(version):
        return None
    return (
        f"accel-graph is verified on torch {', '.join(VERIFIED)} (any patch release); the "
        f"installed torch is {version}. It may work, but it was not tested: report problems "
        f"with this version, or install a verified one (pip install 'torch=={VERIFIED[-1]}.*')"
    )


def warn_if_unverified(version: str | None = None) -> bool:
    """Warn once (:class:`UnsupportedTorchWarning`) when ``version`` (default: the installed
    torch's) is unverified. Returns whether it warned. Never raises; no torch found: no warning
    (importing torch will say so soon enough)."""
    try:
        version = installed_torch_version() if version is None else version
        message = None if version is None else unverified_message(version)
        if message is None:
            return False
        warnings.warn(message, UnsupportedTorchWarning, stacklevel=3)
        return True
    except Exception:
        return False
