"""The KV cache sized from a memory budget left after the graph pool (issue 27, item 6).

The server recipe of docs/runner.md: ``slots = (budget - weights - graph pool - warm-up peak)
// bytes per slot``. The graph pool does not depend on the number of slots (the token-wise
graph pieces see ``[tokens, ...]`` tensors; attention over the slot cache is an eager island
outside the pool), so a probe executor with few slots tells the pool, and the final executor
is built with the slots the budget affords:

- where ``GraphRunner.plan_memory()`` exists (the memory plan of issue 28), the probe is never
  captured: the plan predicts the pool and the warm-up peak without running kernels
  (``source: "plan"``);
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


def _pool(executor: StepExecutor) -> tuple[int, int, str]:
    runner = getattr(executor, "runner", None)
    if runner is None:
        return 0, 0, "eager"
    plan = getattr(runner, "plan_memory", None)
    if plan is not None and not getattr(executor, "captured", False):
        p = plan()
        return int(p["pool_peak_reserved_bytes"]), int(p.get("warmup_peak_bytes") or 0), "plan"
    if not getattr(executor, "captured", True):
        executor.capture()
    rep = runner.memory_report()
    return int(rep["pool_peak_reserved_bytes"] or 0), 0, "measured"


def size_kv_cache(build: Callable[..., StepExecutor], budget_bytes: int, *,
                  probe_slots: int = 1, max_slots: int | None = None
                  ) -> tuple[StepExecutor, KVCacheSizing]:
    """Build the executor whose KV cache fills ``budget_bytes`` after weights, graph pool and
    warm-up peak; returns it (captured, if it has graphs) and how it was sized.

    Args:
        build: ``build(num_slots, capture=bool) -> executor``; called once with
            ``probe_slots`` and ``capture=False`` (the probe is planned, or captured here when
            its runner cannot plan), then with the slots the budget affords and ``capture=True``.
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
    executor = build(int(slots), capture=True)
    return executor, KVCacheSizing(int(slots), per_slot, int(slots) * per_slot, weights, pool,
                                   warm, budget_bytes, source)
