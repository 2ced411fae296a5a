"""The caching-allocator side of accel-graph: config strings, the C engine, traces, replay.

The names below are loaded on first access (nothing is imported, built or opened at package
import). Submodules: ``config`` (PYTORCH_ALLOC_CONF grammar), ``engine`` (the C core),
``snapshot`` (trace files), ``replay`` (whole-trace replay), ``whatif`` (scenarios for the
``accel-alloc`` CLI), ``profiles`` (torch version x device), ``generate`` (synthetic traces:
``accel_graph.allocator.generate.generate``).
"""

from __future__ import annotations

from .._lazy import lazy_exports

_LAZY: dict[str, str] = {
    "AllocatorSettings": ".config",
    "parse_config": ".config",
    "settings_from_environment": ".config",
    "settings_from_snapshot": ".config",
    "Engine": ".engine",
    "EngineSettings": ".engine",
    "Trace": ".snapshot",
    "load_trace": ".snapshot",
    "save_trace": ".snapshot",
    "replay_trace": ".replay",
    "Profile": ".profiles",
    "get_profile": ".profiles",
    "profile_for": ".profiles",
    "make_scenario": ".whatif",
    "simulate": ".whatif",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
