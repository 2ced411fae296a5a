"""``accel_graph.plan_graph_memory``: the memory one ``Graph`` capture will take, without capturing.

The single-graph form of ``GraphRunner.plan_memory()`` (``accel_graph.runner.memory_plan``):
``fn(*example_inputs, **example_kwargs)`` is recorded on metadata through the recorder's planning
machinery (``accel_graph.backends.memory_planner``) and every allocation is booked on a fresh
allocator engine under the target device's rules. Nothing is captured, no kernel runs, no device
memory is taken. Schema ``accel_graph.graph.memory-plan/1`` (docs/runner.md "Memory plan").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..allocator.alloc_conf import parse_config, settings_from_environment
from ..allocator.core.settings import EngineSettings
from ..allocator.devices import device_kind
from ..backends import memory_planner, select_backend
from ..errors import ConfigError

__all__ = ["GRAPH_PLAN_SCHEMA", "distinct_pool_bytes", "plan_graph_memory", "plan_settings"]

GRAPH_PLAN_SCHEMA = "accel_graph.graph.memory-plan/1"


def plan_settings(backend: str, device: torch.device, alloc_conf: str | None = None,
                  ) -> tuple[EngineSettings, str, bool, dict[str, Any]]:
    """``(engine settings, policy, reuses freed blocks, report)`` of the allocator serving graph
    pools of ``backend`` on ``device``:

    - ``recorder`` on the CPU: its pool is the engine with torch's default settings (it reads no
      ``PYTORCH_ALLOC_CONF``), blocks reused as they die;
    - ``recorder`` on another device: the same engine, blocks never reused within the pool's
      life (``backends/recorder/device_pool.py``);
    - a native backend (cuda, hip, xpu): torch's caching allocator of that device under the
      config its torch reads now (``PYTORCH_ALLOC_CONF`` or the device's variable).

    ``alloc_conf`` (a config string) replaces the environment's: what-if plans, such as
    ``"expandable_segments:True"``. ConfigError for a malformed string.
    """
    if backend == "recorder":
        info = device_kind("cuda")  # the engine's native policy: CUDA's caching allocator
        parsed = parse_config(alloc_conf or "", device=info.name)
        source = ("alloc_conf argument" if alloc_conf else
                  "the recorder's pool: torch's default settings (no PYTORCH_ALLOC_CONF read)")
        recycle = device.type == "cpu"
    else:
        try:
            info = device_kind(backend)
        except (KeyError, ValueError, ConfigError):
            info = device_kind("cuda")
        if alloc_conf is not None:
            parsed, source = parse_config(alloc_conf, device=info.name), "alloc_conf argument"
        else:
            parsed, var = settings_from_environment(device=info.name)
            source = var or "torch's defaults (no allocator config variable set)"
        recycle = True
    engine = EngineSettings.from_allocator_settings(parsed)
    report = dict(parsed.to_snapshot_dict())
    report.update({"policy": info.engine_policy, "device_type": info.name, "source": source,
                   "expandable_segments": bool(engine.expandable_segments),
                   "reuses_freed_blocks": recycle})
    return engine, info.engine_policy, recycle, report


def plan_graph_memory(fn: Callable[..., Any], example_inputs: Any = (), *,
                      example_kwargs: Mapping[str, Any] | None = None,
                      device: torch.device | str | int | None = None,
                      alloc_conf: str | None = None, trace: str | None = None) -> dict[str, Any]:
    """The memory a ``Graph`` capture of ``fn(*example_inputs, **example_kwargs)`` would take
    in a fresh pool, predicted without capturing (JSON-ready dict, schema
    ``accel_graph.graph.memory-plan/1``): ``pool_reserved_bytes`` (what the pool holds after the
    capture: the graph's ``memory_bytes()``), ``pool_peak_reserved_bytes``, ``standalone_bytes``
    (the graph's ``standalone_bytes()``), ``output_bytes``, ``warmup_peak_bytes`` (one eager run
    of ``fn`` on an empty general allocator), ``device``, ``backend``, ``allocator_settings``,
    ``unplanned`` and ``planning_seconds``.

    ``device``: routed as ``Graph(device=)`` (default: the device of the first tensor input, else
    the default route). ``alloc_conf``: plan under this allocator config string. ``trace``: also
    write the planned allocations as a memory-snapshot trace there. Raises the ``CaptureError``
    capture would raise (a refused op, a data-dependent size), naming the op and its line.
    """
    t0 = time.perf_counter()
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if device is None:
        first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
        device = first.device if first is not None else None
    backend, routed = select_backend(device)
    engine, policy, recycle, report = plan_settings(backend.name, routed, alloc_conf)
    planner = memory_planner(routed, engine, policy, recycle=recycle, record_events=trace is not None)
    with torch.no_grad():
        cp = planner.plan(fn, args, kwargs)
        out_bytes = distinct_pool_bytes([cp.outputs], planner.pool.owns)
        stats = planner.pool_stats()
        warm = planner.warmup_peak()
    result: dict[str, Any] = {
        "schema": GRAPH_PLAN_SCHEMA,
        "device": str(routed),
        "backend": backend.name,
        "allocator_settings": report,
        "pool_reserved_bytes": stats["reserved"],
        "pool_peak_reserved_bytes": stats["peak_reserved"],
        "standalone_bytes": cp.standalone_bytes,
        "output_bytes": out_bytes,
        "warmup_peak_bytes": warm,
        "unplanned": list(planner.unplanned),
        "planning_seconds": 0.0,
    }
    if trace is not None:
        planner.write_trace(trace, report, what=f"plan_graph_memory({getattr(fn, '__qualname__', fn)!r})")
        result["trace"] = str(trace)
    del cp
    result["planning_seconds"] = time.perf_counter() - t0
    return result


def distinct_pool_bytes(kept: list[Any], in_pool: Callable[[torch.Tensor], bool]) -> int:
    """Bytes of the distinct pool storages among the tensors of ``kept`` (views counted
    once): a plan's output bytes."""
    seen: dict[int, int] = {}
    for out in kept:
        for x in pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and in_pool(x):
                s = x.untyped_storage()
                seen[s._cdata] = s.nbytes()
    return sum(seen.values())
