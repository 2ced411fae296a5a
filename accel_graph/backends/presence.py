"""Which accelerator devices are present: what routing decides on, read without raising.

A torch build names one accelerator type (``torch.accelerator.current_accelerator()``: ``cuda``
on CUDA and ROCm builds, ``xpu``, ``mps``, a PrivateUse1 name), whether or not a device of that
type is installed: ``pip install torch`` gives the CUDA build on machines without a GPU. Routing
must therefore follow the *devices present* (the device count), not the build, and this module
is the one place that counts them.

Every function here is a probe in the backend sense: it never raises. A driver that fails while
devices are counted (``RuntimeError: ... driver ...``) is reported as the error text, and
routing then treats the host as having no usable device of that type.

Counting asks ``is_available()`` (cheap; False means 0), then ``torch.accelerator.device_count()``
where torch has it, else the device module's ``device_count()``. On CUDA this is ``cudaGetDeviceCount`` (or NVML):
it does not run torch's lazy CUDA initialisation. The current device index is read only when a
device exists (``torch.accelerator.current_device_index()`` raises on a driverless host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AcceleratorPresence",
    "accelerator_presence",
    "build_label",
    "count_devices",
    "module_reason",
]

#: Device types that always exist and are never counted.
ALWAYS_PRESENT = ("cpu", "meta")


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _devices(n: int | None) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def build_label(device_type: str | None) -> str:
    """What the torch build carries for ``device_type``, for messages: ``"CUDA 13.0"``,
    ``"ROCm 7.0.51831"``, ``"XPU"``, ``"MPS"``, or ``"no accelerator"``."""
    version = getattr(torch, "version", None)
    if device_type is None:
        return "no accelerator"
    if device_type == "cuda":
        hip = getattr(version, "hip", None)
        if hip:
            return f"ROCm {hip}"
        cuda = getattr(version, "cuda", None)
        return f"CUDA {cuda}" if cuda else "no CUDA (torch.version.cuda is None)"
    if device_type == "xpu":
        xpu = getattr(version, "xpu", None)
        return f"XPU {xpu}" if xpu else "XPU"
    return device_type.upper() if device_type == "mps" else device_type


def _build_accelerator() -> tuple[str | None, str | None]:
    """The build's accelerator type and, if asking torch failed, why."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        try:
            dev = acc.current_accelerator()
        except Exception as exc:  # an accelerator runtime that fails to load
            return None, f"torch.accelerator.current_accelerator() raised {_err(exc)}"
        return (None if dev is None else torch.device(dev).type), None
    # torch without torch.accelerator (older than any verified release): the version table
    version = getattr(torch, "version", None)
    if getattr(version, "cuda", None) or getattr(version, "hip", None):
        return "cuda", None
    if getattr(version, "xpu", None):
        return "xpu", None
    return None, None


def count_devices(device_type: str) -> tuple[int | None, str | None, str]:
    """``(count, error, source)`` for devices of ``device_type``; never raises.

    ``count`` is None when it cannot be known: the device module has no counting API (then
    ``error`` is None too) or counting raised (``error`` is the exception's text). ``source``
    names the API that answered, for reports.

    ``is_available()`` is asked first: it is cheap (torch caches the driver's answer), while
    ``torch.cuda.device_count()`` re-reads NVML on every call until CUDA is initialised
    (about 0.5 ms on a GPU-less host, per ``Graph()``). False means no usable device: 0.
    """
    acc = getattr(torch, "accelerator", None)
    source = f"counting {device_type} devices"
    try:
        build_type, _ = _build_accelerator()
        if build_type == device_type and acc is not None and hasattr(acc, "device_count"):
            if hasattr(acc, "is_available"):
                source = "torch.accelerator.is_available()"
                if not acc.is_available():
                    return 0, None, source
            source = "torch.accelerator.device_count()"
            return int(acc.device_count()), None, source
        mod: Any = getattr(torch, device_type, None)
        if mod is None:
            try:  # torch raises for a type without a module (xla, lazy): unknown, not an error
                mod = torch.get_device_module(device_type)
            except Exception:
                mod = None
        if mod is None:
            return None, None, f"torch has no torch.{device_type} module"
        if hasattr(mod, "is_available"):
            source = f"torch.{device_type}.is_available()"
            if not mod.is_available():
                return 0, None, source
            if not hasattr(mod, "device_count"):
                return 1, None, source
        if hasattr(mod, "device_count"):
            source = f"torch.{device_type}.device_count()"
            return int(mod.device_count()), None, source
        return None, None, f"torch.{device_type} has neither device_count() nor is_available()"
    except Exception as exc:  # a broken driver: report its text, route as if no device
        return None, _err(exc), source


def _current_index(device_type: str) -> tuple[int | None, str | None]:
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is not None and hasattr(acc, "current_device_index"):
            return int(acc.current_device_index()), None
        mod = getattr(torch, device_type, None)
        return (int(mod.current_device()) if mod is not None else 0), None
    except Exception as exc:
        return None, _err(exc)


@dataclass(frozen=True)
class AcceleratorPresence:
    """The build's accelerator and the devices of it that this host has.

    ``device_type``: the build's accelerator type (None: a CPU-only build). ``build``: what the
    build carries, for messages (:func:`build_label`). ``device_count``: devices present (None:
    unknown, see ``error``). ``current_index``: torch.accelerator's current device (only read
    when a device exists). ``error``: the text of what failed while asking (a broken driver),
    None when nothing did. ``source``: the API that counted.
    """

    device_type: str | None
    build: str
    device_count: int | None
    current_index: int | None
    error: str | None
    source: str

    @property
    def present(self) -> bool:
        """Whether at least one device of the build's accelerator can be used here."""
        return self.device_type is not None and bool(self.device_count) and self.current_index is not None

    @property
    def device(self) -> torch.device | None:
        """The current accelerator device (``cuda:0``), or None when none is present."""
        if not self.present:
            return None
        assert self.device_type is not None
        return torch.device(self.device_type, self.current_index)

    def state(self) -> str:
        """Why routing goes where it goes, first half: ``"build has CUDA 13.0, 0 devices"``."""
        if self.device_type is None:
            why = f" ({self.error})" if self.error else ""
            return f"torch {torch.__version__} has no accelerator{why}"
        if self.error is not None and self.device_count is None:
            return f"build has {self.build}, but counting {self.device_type} devices failed ({self.error})"
        if self.error is not None:
            return (f"build has {self.build}, {_devices(self.device_count)}, but reading the "
                    f"current device failed ({self.error})")
        return f"build has {self.build}, {_devices(self.device_count)}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the doctor's ``routing.accelerator``)."""
        return {
            "device_type": self.device_type,
            "build": self.build,
            "device_count": self.device_count,
            "current_index": self.current_index,
            "count_source": self.source,
            "error": self.error,
        }


def accelerator_presence() -> AcceleratorPresence:
    """Read the build's accelerator, its device count and current index. Never raises; cheap
    enough to call per ``Graph()`` without ``device=`` (no device is initialised by counting)."""
    device_type, acc_error = _build_accelerator()
    if device_type is None:
        return AcceleratorPresence(None, build_label(None), 0, None, acc_error, "torch.accelerator")
    count, error, source = count_devices(device_type)
    index = None
    if error is None and count:
        index, error = _current_index(device_type)
    return AcceleratorPresence(device_type, build_label(device_type), count, index, error, source)


def module_reason(module_name: str, module: Any, no_device_reason: str) -> str | None:
    """Why the vendor module ``torch.<module_name>`` offers no device here (None: it has one):
    the native backends' probe after the build check. Never raises, never initialises a device.

    A broken driver that raises from ``is_available()`` or ``device_count()`` is reported with
    its text; routing then falls back to the recorder and ``accel-graph doctor`` shows it.
    """
    if module is None:
        return f"torch {torch.__version__} has no torch.{module_name} module"
    try:
        available = bool(module.is_available())
    except Exception as exc:
        return f"torch.{module_name}.is_available() raised {_err(exc)}"
    if not available:
        return f"torch.{module_name}.is_available() is False ({no_device_reason})"
    try:
        count = int(module.device_count())
    except Exception as exc:
        return f"torch.{module_name}.device_count() raised {_err(exc)}"
    if count <= 0:
        return f"torch.{module_name}.device_count() is {count} ({no_device_reason})"
    return None
