"""Facts about native devices, read without initialising one: what the cuda, hip and xpu
backends put into their ``accel-graph doctor`` sections (``Backend.doctor_versions`` and
``Backend.doctor_section``).

Runtime versions come from the runtime library torch has already mapped into the process
(``cudaRuntimeGetVersion``/``hipRuntimeGetVersion`` create no context); driver versions from
``/proc`` and ``/sys``. Per-device facts are read only when the caller allows it
(:func:`cuda_devices`): reading a capability or an arch starts the device runtime.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "NOT_CHECKED_CUDA",
    "NOT_CHECKED_XPU",
    "cuda_device_name",
    "cuda_devices",
    "fact",
    "nvidia_driver_version",
    "read_text",
    "runtime_version",
    "safe",
]

NOT_CHECKED_CUDA = "not checked: would initialise CUDA (rerun with --probe-devices)"
NOT_CHECKED_XPU = "not checked: would initialise XPU (rerun with --probe-devices)"


def safe(fn: Callable[[], Any], default: Any = None) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(default, "Type: message")`` if it raised (a report must not crash)."""
    try:
        return fn(), None
    except Exception as exc:
        return default, f"{type(exc).__name__}: {exc}"


def fact(value: Any, note: str | None = None) -> dict[str, Any]:
    """One entry of the doctor's ``versions`` block: the value and where it came from (or why
    it is None)."""
    return {"value": value, "note": note}


def read_text(path: str) -> str | None:
    """The text of ``path``, or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _mapped_library(stem: str) -> str | None:
    """Path of a shared library already mapped into this process whose name starts with stem."""
    maps = read_text("/proc/self/maps") or ""
    for line in maps.splitlines():
        path = line.rsplit(None, 1)[-1] if "/" in line else ""
        if os.path.basename(path).startswith(stem):
            return path
    return None


def runtime_version(stem: str, symbol: str) -> tuple[str | None, str]:
    """``cudaRuntimeGetVersion``/``hipRuntimeGetVersion`` of the runtime torch already loaded
    (neither creates a context), as "M.m" (HIP: "M.m.p"); None and why when unavailable."""
    path = _mapped_library(stem)
    if path is None:
        return None, f"{stem} is not loaded in this process"
    try:
        fn = getattr(ctypes.CDLL(path), symbol)
        out = ctypes.c_int(0)
        if fn(ctypes.byref(out)) != 0:
            return None, f"{symbol} failed ({path})"
    except (OSError, AttributeError) as exc:
        return None, f"{symbol} unavailable in {path}: {exc}"
    v = out.value
    if stem.startswith("libamdhip"):  # HIP encodes major*10000000 + minor*100000 + patch
        return f"{v // 10000000}.{(v // 100000) % 100}.{v % 100000}", f"{symbol} ({path})"
    return f"{v // 1000}.{(v % 1000) // 10}", f"{symbol} ({path})"


def nvidia_driver_version() -> tuple[str | None, str]:
    """The NVIDIA kernel module's version from ``/proc``, or None and why."""
    text = read_text("/proc/driver/nvidia/version")
    if text is None:
        return None, "no NVIDIA kernel driver loaded (/proc/driver/nvidia/version is absent)"
    m = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9][0-9.]*)", text)
    return (m.group(1) if m else text.strip().splitlines()[0]), "/proc/driver/nvidia/version"


def cuda_devices(probe: bool, per_device: Callable[[int], dict[str, Any]]) -> tuple[list | None, str | None]:
    """``per_device(i)`` for every ``torch.cuda`` device when allowed (``probe``, or CUDA already
    initialised), else None and why not. A device whose facts raised gets ``{index, error}``."""
    cuda = torch.cuda
    if not cuda.is_available():
        return None, "no visible device (torch.cuda.is_available() is False)"
    if not (probe or cuda.is_initialized()):
        return None, NOT_CHECKED_CUDA
    count, err = safe(lambda: int(cuda.device_count()), 0)
    devices = []
    for i in range(count):
        entry, err = safe(lambda i=i: per_device(i))
        devices.append(entry if entry is not None else {"index": i, "error": err})
    return devices, None if count else f"device_count() is 0 ({err or 'no devices'})"


def cuda_device_name(i: int) -> str | None:
    """The name of ``torch.cuda`` device ``i`` (initialises the runtime)."""
    fn = getattr(torch.cuda, "get_device_name", None)
    if fn is not None:
        return str(fn(i))
    return getattr(torch.cuda.get_device_properties(i), "name", None)
