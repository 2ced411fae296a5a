"""The KV cache sized from a memory budget left after the graph pool (issue 27, item 6).

The server recipe of docs/runner.md: ``slots = (budget - weights - graph pool - warm-up peak)
// bytes per slot``. The token-bucket graphs do not depend on the number of slots (they see
``[tokens, ...]`` tensors; attention over the slot cache is an eager island outside the pool);
the decode graphs (:mod:`.full_graphs`) have one row per slot, so their activations grow with
the slots, a little. So a probe executor with few slots tells the pool, and the final executor
is built with the slots the budget affords, then checked:

- where ``GraphRunner.plan_memory()`` exists (the memory plan of issue 28), nothing is captured
  to size: the plan predicts the pool and the warm-up peak without running kernels
  (``source: "plan"``). An executor with several runners (token buckets and decode graphs)
  plans them all into its one shared pool (``executor.plan_memory()``). The final executor
  is planned again at its slot count before it is captured, and given fewer slots if its
  graphs would no longer fit;
- otherwise the probe is captured and ``memory_report()["pool_peak_reserved_bytes"]`` is
  measured (``source: "measured"``; the warm-up peak is then not known and counted as 0);
- an executor without graphs (eager) has no pool (``source: "eager"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from .step import StepExecutor

__all__ = ["KVCacheSizing", "kv_bytes_per_slot", "size_kv_cache", "weight_bytes"]


@dataclass(frozen=True)
class KVCacheSizing:
    """How the KV cache was sized (all bytes). ``source``: ``"plan"``, ``"measured"`` or
    ``"eager"`` (module docstring)."""

    slots: int
    bytes_per_slot: int
    kv_bytes: int
    weights_bytes: int
    pool_bytes: int
    warmup_peak_bytes: int
    budget_bytes: int
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model(executor: StepExecutor) -> Any:
    model = getattr(executor, "model", None)
    if model is None:
        raise ConfigError(f"{type(executor).__name__} has no .model: KV-cache sizing reads the "
                          f"model's weights and cache buffers (use EagerExecutor/GraphExecutor)")
    return model


def weight_bytes(executor: StepExecutor) -> int:
    """Bytes of the executor's model parameters."""
    return sum(p.numel() * p.element_size() for p in _model(executor).parameters())


def kv_bytes_per_slot(executor: StepExecutor) -> int:
    """Bytes one slot takes in every layer's key and value caches (buffers named
    ``k_cache``/``v_cache``, one row per slot)."""
    total = sum(b.numel() * b.element_size() for name, b in _model(executor).named_buffers()
                if name.rsplit(".", 1)[-1] in ("k_cache", "v_cache"))
    if total == 0:
        raise ConfigError("the executor's model has no k_cache/v_cache buffers to size")
    return total // executor.num_slots


def _runners(executor: StepExecutor) -> list[Any]:
    runners = getattr(executor, "runners", None)
    if callable(runners):
        return list(runners())
    runner = getattr(executor, "runner", None)
    return [] if runner is None else [runner]


def _pool(executor: StepExecutor) -> tuple[int, int, str]:
    runners = _runners(executor)
    if not runners:
        return 0, 0, "eager"
    # An executor with several runners plans them into its one shared pool.
    plan = getattr(executor, "plan_memory", None)
    if plan is None and len(runners) == 1:
        plan = getattr(runners[0], "plan_memory", None)
    if plan is not None and not getattr(executor, "captured", False):
        p = plan()
        return int(p["pool_peak_reserved_bytes"]), int(p.get("warmup_peak_bytes") or 0), "plan"
    if not getattr(executor, "captured", True):
        executor.capture()
    # The runners share the executor's pool: the first one's report counts all of it.
    rep = (getattr(executor, "memory_report", None) or runners[0].memory_report)()
    return int(rep["pool_peak_reserved_bytes"] or 0), 0, "measured"


def size_kv_cache(build: Callable[..., StepExecutor], budget_bytes: int, *,
                  probe_slots: int = 1, max_slots: int | None = None
                  ) -> tuple[StepExecutor, KVCacheSizing]:
    """Build the executor whose KV cache fills ``budget_bytes`` after weights, graph pool and
    warm-up peak; returns it (captured, if it has graphs) and how it was sized.

    Args:
        build: ``build(num_slots, capture=bool) -> executor``; called once with
            ``probe_slots`` and ``capture=False`` (the probe is planned, or captured here when
            its runner cannot plan), then with the slots the budget affords: with
            ``capture=True`` when measured; with ``capture=False`` when planned (the final
            executor is planned, rebuilt with fewer slots if its pool grew past the budget,
            then ``capture()``d).
        budget_bytes: the memory the engine may use (weights, graph pool, warm-up, KV cache).
        max_slots: a cap on the slots (e.g. more would not help the workload).

    Raises ConfigError when the budget leaves no room for one slot (the message gives each
    term, so the caller sees what to change).
    """
    probe = build(probe_slots, capture=False)
    pool, warm, source = _pool(probe)
    weights, per_slot = weight_bytes(probe), kv_bytes_per_slot(probe)
    del probe
    free = budget_bytes - weights - pool - warm
    slots = free // per_slot if free > 0 else 0
    if max_slots is not None:
        slots = min(slots, max_slots)
    if slots < 1:
        raise ConfigError(
            f"a memory budget of {budget_bytes} bytes leaves no room for one KV slot: weights "
            f"{weights} + graph pool {pool} ({source}) + warm-up peak {warm} leave {free}, one slot "
            f"takes {per_slot}; raise the budget to at least {weights + pool + warm + per_slot}")
    if source != "plan":
        executor = build(int(slots), capture=True)
    else:  # plan the final executor too (decode graphs grow with the slots), then capture
        known = (probe_slots, pool + warm)
        for _ in range(4):
            executor = build(int(slots), capture=False)
            pool, warm, _source = _pool(executor)
            if weights + pool + warm + slots * per_slot <= budget_bytes:
                break
            # Graph memory grows with the slots: fit a line through the two plans and solve
            # weights + graphs(s) + s * per_slot <= budget for s.
            s0, g0 = known
            growth = max(0.0, (pool + warm - g0) / max(1, slots - s0))
            known = (slots, pool + warm)
            fit = int((budget_bytes - weights - g0 + growth * s0) // (per_slot + growth))
            fit = min(fit, slots - 1)
            if fit < 1:
                raise ConfigError(
                    f"a memory budget of {budget_bytes} bytes leaves no room for one KV slot once "
                    f"the graphs of {slots} slots are planned: weights {weights} + graph pool "
                    f"{pool} + warm-up peak {warm}; raise the budget")
            slots = fit
        else:
            raise ConfigError(f"KV-cache sizing did not settle for a budget of {budget_bytes} "
                              f"bytes (the graph pool keeps growing with the slots); pass "
                              f"max_slots= or raise the budget")
        executor.capture()
    return executor, KVCacheSizing(int(slots), per_slot, int(slots) * per_slot, weights, pool,
                                   warm, budget_bytes, source)
