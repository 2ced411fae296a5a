"""Calibrated synthetic allocator traces in PyTorch's snapshot format.

:func:`generate` builds the alloc/free sequence of a workload in Python, drives the C engine
(``Engine(policy="native", upstream="counting")``, events on) with it, and converts the engine's
events with :meth:`Trace.from_events`: so ``segment_alloc``/``segment_free`` (or
``segment_map``) events and addresses are exactly what the native allocator would produce under
the given settings. The settings and the generator's parameters are recorded in the trace's
``allocator_settings`` (torch's fields plus an ``"accel_graph_generator"`` entry).

Workloads follow shared/reference/allocator-semantics.md section 3.2 ("Synthetic-but-realistic
generators"), calibrated on the measured traces of section 3.1:

- ``train``: dense LM training step (zero_grad, forward, backward, AdamW step). Calibration
  targets (3.1): ~25 distinct sizes per step, ~42 % of allocations freed within two subsequent
  allocations (median lifetime ~3 allocations), a long-lived tail (activations held from forward to
  backward; parameters, grads and optimiser state live across the window), ~25 % of allocations
  <= 1 MiB carrying < 1 % of bytes, utilisation ~0.88-0.90.
- ``shapes``: the training step with the sequence length drawn per step (3.2 item 2).
- ``moe``: expert FFNs with per-step token counts drawn per expert (3.2 item 3).
- ``serve``: weight load, profile run, KV cache, CUDA-graph capture per batch size into one
  private pool (decreasing order), then decode/prefill steps (3.2 item 4).
- ``rl``: alternating training and generation phases with offload/reload of weights and
  optimiser state (3.2 item 5).
- ``frag``: KNOWN fragmentation. Growing large allocations (each bigger than any cached block)
  interleaved with long-lived small blocks. Under the default native settings every request gets
  a new segment and peak reserved grows with the sum of the sizes; ``expandable_segments:True``
  removes it (the freed range is extended in place), giving peak reserved ~ the largest request.
  ``max_split_size_mb`` does not help without a memory cap (it only acts when cudaMalloc fails).

Deterministic: the same arguments give the same trace (numpy ``default_rng(seed)``).

The workloads' alloc/free programs are written in :mod:`.workloads`; this module runs them
through the engine and measures the result (:func:`trace_stats`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alloc_conf import AllocatorSettings, parse_config
from ..core.engine import Engine
from ..core.settings import EngineSettings
from ..traces.actions import ACTION_CODE
from ..traces.model import Trace
from ..units import MIB
from .workloads import DEFAULT_STEPS, WORKLOADS, Tape, make_model

__all__ = ["WORKLOADS", "Tape", "generate", "trace_stats"]

_US_PER_EVENT = 5


# ----------------------------------------------------------------------------------------------
# driving the engine


def _settings(settings: str | AllocatorSettings | None) -> AllocatorSettings:
    if settings is None:
        return AllocatorSettings()
    if isinstance(settings, str):
        return parse_config(settings)
    if isinstance(settings, AllocatorSettings):
        return settings
    raise TypeError(f"settings must be a config string or AllocatorSettings, got {settings!r}")


def _run(tape: Tape, parsed: AllocatorSettings) -> tuple[np.ndarray, list[dict[str, Any]]]:
    engine = Engine(policy="native", upstream="counting",
                    settings=EngineSettings.from_allocator_settings(parsed))  # fmt: skip
    engine.enable_events()
    ptr: dict[int, int] = {}
    pending: list[list[int]] = []  # [handle, allocations left]
    private = 0
    malloc, free = engine.malloc, engine.free
    for kind, h, size, pool in tape.ops:
        if kind == 0:
            if pool:
                if not private:
                    private = engine.create_pool()
                ptr[h] = malloc(size, 0, private)
            else:
                ptr[h] = malloc(size)
            if pending:
                for p in pending:
                    p[1] -= 1
                    if p[1] <= 0:
                        free(ptr.pop(p[0]))
                pending = [p for p in pending if p[1] > 0]
        elif kind == 1:
            free(ptr.pop(h))
        else:
            pending.append([h, size])
    for p in pending:
        free(ptr.pop(p[0]))
    events = engine.drain_events()
    # the engine stamps wall-clock time; a synthetic clock (5 us per event) keeps traces
    # deterministic while giving viewers and free_completed timing a usable time axis
    events = events[np.argsort(events["seq"], kind="stable")]
    events["time_us"] = np.arange(len(events), dtype=np.int64) * _US_PER_EVENT
    segments = engine.snapshot()
    engine.close()
    return events, segments


def generate(workload: str, *, seed: int = 0, steps: int | None = None, scale: float = 0.25,
             layers: int | None = None,
             settings: str | AllocatorSettings | None = None) -> Trace:  # fmt: skip
    """A synthetic trace of ``workload`` (one of :data:`WORKLOADS`).

    ``steps``: training steps / serving rounds / RL iterations (default per workload);
    ``scale``: hidden size relative to the 3.1 anchor model (d=2560; 0.25 gives d=640);
    ``layers``: transformer layers (default 8); ``settings``: allocator config string or
    :class:`AllocatorSettings` the engine runs under (default: torch's defaults).
    Deterministic in all arguments.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if steps is None:
        steps = DEFAULT_STEPS[workload]
    if steps < 1 or not 0 < scale < 1e6:  # also refuses nan and inf
        raise ValueError(f"steps must be >= 1 and 0 < scale < 1e6 (got steps={steps}, "
                         f"scale={scale})")
    parsed = _settings(settings)
    rng = np.random.default_rng(seed)
    tape = Tape()
    WORKLOADS[workload](tape, rng, steps, make_model(scale, layers))
    events, segments = _run(tape, parsed)
    alloc_settings: dict[str, Any] = dict(parsed.to_snapshot_dict())
    alloc_settings["accel_graph_generator"] = {
        "workload": workload, "seed": seed, "steps": steps, "scale": scale,
        "layers": layers if layers is not None else 8, "policy": "native",
        "upstream": "counting", "reference": "allocator-semantics.md 3.2",
    }  # fmt: skip
    return Trace.from_events(events, device_type="cuda", segments=segments,
                             allocator_settings=alloc_settings)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# calibration statistics


def trace_stats(trace: Trace, device: int = 0) -> dict[str, float]:
    """The section 3.1 statistics of a trace recorded from empty.

    ``short_lived``: fraction of allocations freed within two subsequent allocations;
    ``lifetime_median`` / ``lifetime_p90`` in allocations (blocks freed in the window);
    ``never_freed``; ``small_fraction`` (allocations <= 1 MiB) and ``small_bytes``;
    ``peak_allocated`` (requested bytes), ``peak_reserved``, ``utilisation``.
    """
    a = trace.events(device)
    act = a["action"]
    alloc_c, free_c = ACTION_CODE["alloc"], ACTION_CODE["free_requested"]
    grow = {ACTION_CODE["segment_alloc"], ACTION_CODE["segment_map"]}
    shrink = {ACTION_CODE["segment_free"], ACTION_CODE["segment_unmap"]}
    live: dict[int, tuple[int, int]] = {}
    lifetimes: list[int] = []
    n_alloc = allocated = reserved = peak_a = peak_r = 0
    sizes: list[int] = []
    for code, addr, size in zip(act.tolist(), a["addr"].tolist(), a["size"].tolist(),
                                strict=True):  # fmt: skip
        if code == alloc_c:
            live[addr] = (n_alloc, size)
            n_alloc += 1
            sizes.append(size)
            allocated += size
            peak_a = max(peak_a, allocated)
        elif code == free_c:
            start, sz = live.pop(addr)
            lifetimes.append(n_alloc - start - 1)
            allocated -= sz
        elif code in grow:
            reserved += size
            peak_r = max(peak_r, reserved)
        elif code in shrink:
            reserved -= size
    lt = np.array(lifetimes or [0])
    sz = np.array(sizes or [0], dtype=np.float64)
    small = sz <= MIB
    return {
        "allocs": n_alloc,
        "distinct_sizes": len(set(sizes)),
        "short_lived": float((lt <= 2).sum() / max(1, n_alloc)),
        "lifetime_median": float(np.median(lt)),
        "lifetime_p90": float(np.percentile(lt, 90)),
        "never_freed": len(live),
        "small_fraction": float(small.mean()),
        "small_bytes": float(sz[small].sum() / max(1.0, sz.sum())),
        "peak_allocated": peak_a,
        "peak_reserved": peak_r,
        "utilisation": peak_a / peak_r if peak_r else 0.0,
        "segment_allocs": int(np.isin(act, list(grow)).sum()),
        "segment_frees": int(np.isin(act, list(shrink)).sum()),
    }
