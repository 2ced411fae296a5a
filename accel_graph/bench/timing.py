"""Timing helpers for benchmarks: interleaved per-call samples, percentiles, allocation counts.

Every variant is timed in the same process, round-robin: each round runs every variant
``calls_per_round`` times in a freshly shuffled order (a local, seeded ``random.Random``), so
drift in clock speed, caches or neighbours spreads over all variants alike. Each call is timed on
its own with ``time.perf_counter_ns``; summaries are medians and percentiles, never means.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from time import perf_counter_ns

import torch

__all__ = [
    "count_allocations",
    "hardware_info",
    "interleaved_samples",
    "load_avg",
    "percentile",
    "summarize_ns",
]


def interleaved_samples(
    variants: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    calls_per_round: int,
    warmup: int = 0,
    seed: int = 0,
) -> dict[str, list[int]]:
    """Time every callable in ``variants`` ``rounds * calls_per_round`` times, interleaved.

    Each variant first runs ``warmup`` untimed calls (also interleaved). Returns, per variant,
    the per-call wall times in nanoseconds, in the order they were taken.
    """
    if rounds < 1 or calls_per_round < 1:
        raise ValueError(
            f"rounds and calls_per_round must be >= 1, got {rounds}, {calls_per_round}"
        )
    names = list(variants)
    rng = random.Random(seed)
    for _ in range(max(0, warmup)):
        for name in names:
            variants[name]()
    samples: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            fn, out = variants[name], samples[name]
            for _ in range(calls_per_round):
                t0 = perf_counter_ns()
                fn()
                out.append(perf_counter_ns() - t0)
    return samples


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of an already sorted list, linearly interpolated."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def summarize_ns(samples: list[int]) -> dict[str, float | int]:
    """Median, p10 and p90 of per-call samples, converted to microseconds, plus the count."""
    s = sorted(samples)
    return {
        "median_us": percentile(s, 50) / 1e3,
        "p10_us": percentile(s, 10) / 1e3,
        "p90_us": percentile(s, 90) / 1e3,
        "samples": len(s),
    }


def count_allocations(fn: Callable[[], object], calls: int) -> float | None:
    """Mean number of host/device allocations per call of ``fn`` over ``calls`` calls.

    Counted with ``torch.profiler`` memory events (``profile_memory=True``): every event with a
    positive size is one allocation by a c10 allocator (CPU, or the device's). Memory that does
    not go through a c10 allocator (a graph pool's own upstream, numpy) is not seen. Returns None
    when this torch's profiler does not expose the raw memory events.
    """
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(calls):
            fn()
    # FunctionEvent lists fold allocations made inside an op into that op, so read the raw
    # (kineto) events, where each allocation and each free is its own "[memory]" event.
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None or not hasattr(results, "events"):
        return None
    count = 0
    for ev in results.events():
        if ev.name() == "[memory]" and ev.nbytes() > 0:
            count += 1
    return count / calls


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the block: kineto logs two lines from C++ on every profiler
    start/stop, which would clutter the CLI's output. Restored even if the block raises."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): leave it alone
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _nproc() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        try:
            return len(affinity(0))
        except OSError:
            pass
    return os.cpu_count() or 1


def hardware_info() -> dict[str, object]:
    """Where the numbers come from: CPU model, usable cores (like ``nproc``), torch version,
    torch's intra-op thread count now, Python version and platform."""
    return {
        "cpu": _cpu_model(),
        "nproc": _nproc(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def load_avg() -> list[float] | None:
    """``os.getloadavg()`` rounded to 2 places, or None where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None
