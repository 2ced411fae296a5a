"""The caching-allocator side of accel-graph: config strings, the C engine, traces, simulation.

The names below are loaded on first access (nothing is imported, built or opened at package
import, and nothing here imports torch). Sub-packages, lowest layer first (a module imports only
from its own layer or lower ones; docs/architecture.md):

- ``units``, ``alloc_conf``: byte formatting; ``PYTORCH_ALLOC_CONF`` grammar, parsed as torch does.
- ``traces``: the ``Trace`` model and action codes, one reader/writer front (``load_trace``,
  ``save_trace``), one module per file format.
- ``core``: the C engine (``Engine``), its statistics, the device plug-in, the one loader of the
  compiled parts.
- ``sim``: whole-trace replay through the engine, what-if scenarios, torch version x device
  profiles, fidelity checks, synthetic workloads.
- ``tune``: the configuration search, ranking and advice behind ``accel-alloc tune``.
- ``analysis``: ``accel-alloc inspect`` (waste at the peak, sites) and timelines for plots.
"""

from __future__ import annotations

from ..foundation.lazy import lazy_exports

_LAZY: dict[str, str] = {
    "AllocatorSettings": ".alloc_conf",
    "parse_config": ".alloc_conf",
    "settings_from_environment": ".alloc_conf",
    "settings_from_snapshot": ".alloc_conf",
    "Engine": ".core.engine",
    "EngineSettings": ".core.settings",
    "Trace": ".traces",
    "load_trace": ".traces",
    "save_trace": ".traces",
    "replay_trace": ".sim.replayer",
    "Profile": ".sim.profiles",
    "get_profile": ".sim.profiles",
    "profile_for": ".sim.profiles",
    "make_scenario": ".sim.scenario",
    "simulate": ".sim.scenario",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
