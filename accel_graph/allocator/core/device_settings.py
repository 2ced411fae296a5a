"""The engine settings the device plug-in binds to each GPU, from what its caller gave.

:func:`device_engine_settings` turns ``None`` (the allocator config environment variable), a
config string, :class:`~accel_graph.allocator.alloc_conf.AllocatorSettings` or
:class:`~accel_graph.allocator.core.settings.EngineSettings` into the one ``EngineSettings`` a
device upstream is created with. Nothing here imports torch.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ...errors import ConfigError
from ..alloc_conf import AllocatorSettings, parse_config, settings_from_environment
from ..devices import runtime_device_kind
from .settings import EngineSettings

__all__ = ["device_engine_settings", "loaded_runtime_libs"]


def loaded_runtime_libs(kind: str) -> tuple[str, ...]:
    """Paths of the CUDA/HIP runtime libraries already mapped into this process (torch's own),
    so the engine calls the same copy torch does instead of whatever ``dlopen`` finds by name."""
    stem = runtime_device_kind(kind).runtime_library or ""  # CUDA-family kinds have one
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(stem) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return tuple(found)



def device_engine_settings(settings: object, kind: str) -> EngineSettings:
    """``settings`` as the engine settings of a ``kind`` (``"cuda"``/``"hip"``) device upstream.

    ``device_kind`` is set to ``kind``; ``expandable_segments`` is turned off with a
    ``RuntimeWarning`` (the device upstream has no virtual-memory path); ``device_libs``, when
    unset, names the runtime libraries torch already loaded. Raises :class:`ConfigError` for any
    other type of ``settings``.
    """
    if settings is None:
        parsed, _ = settings_from_environment(device=kind)
        settings = parsed
    if isinstance(settings, str):
        settings = parse_config(settings, device=kind)
    if isinstance(settings, AllocatorSettings):
        settings = EngineSettings.from_allocator_settings(settings)
    if not isinstance(settings, EngineSettings):
        raise ConfigError(
            f"settings must be None (use PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF), a config "
            f"string, AllocatorSettings or EngineSettings; got {type(settings).__name__}"
        )
    overrides: dict[str, Any] = {"device_kind": kind}
    if settings.expandable_segments:
        warnings.warn(
            "expandable_segments is ignored by the device allocator plug-in: its device "
            "upstream uses cudaMalloc/hipMalloc, not the driver's virtual-memory API",
            RuntimeWarning,
            stacklevel=3,
        )
        overrides["expandable_segments"] = False
    if not settings.device_libs:
        overrides["device_libs"] = loaded_runtime_libs(kind)
    values = {f: getattr(settings, f) for f in EngineSettings.__dataclass_fields__}
    values.update(overrides)
    return EngineSettings(**values)
