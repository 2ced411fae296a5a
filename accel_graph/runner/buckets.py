"""Bucket ladders: the default (vLLM's) and one fitted to observed traffic.

A *ladder* is the sorted list of batch sizes a :class:`~accel_graph.runner.GraphRunner`
captures; a live batch of size ``n`` is padded to the smallest bucket ``>= n``. Padding costs
compute (the padded rows run for nothing) and every bucket costs capture time and pool memory,
so a good ladder is dense where traffic is and sparse elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

__all__ = ["BucketSuggestion", "default_ladder", "suggest_buckets", "validate_ladder"]


def default_ladder(max_batch: int) -> list[int]:
    """vLLM's default capture sizes, capped at ``max_batch`` (which is always included).

    vLLM (``vllm/config/compilation.py``, ``cudagraph_capture_sizes`` unset; see
    ``reference/serving-anchors.md`` section 1.1): 1, 2, 4, then steps of 8 up to 248, then
    steps of 16 up to the maximum capture size. vLLM truncates the list at its maximum; we also
    append ``max_batch`` itself when it is off the ladder, so every batch up to ``max_batch``
    has a graph (``max_batch=10`` gives 1, 2, 4, 8, 10).
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"max_batch must be a positive int, got {max_batch!r}")
    sizes = [1, 2, 4, *range(8, 249, 8), *range(256, max_batch + 1, 16)]
    ladder = [s for s in sizes if s <= max_batch]
    if ladder[-1] != max_batch:
        ladder.append(max_batch)
    return ladder


def validate_ladder(buckets: Iterable[int], max_batch: int | None = None) -> list[int]:
    """``buckets`` sorted and de-duplicated; ConfigError for an empty ladder, a non-int or
    non-positive bucket, or a bucket above ``max_batch``."""
    try:
        items = list(buckets)
    except TypeError:
        raise ConfigError(f"buckets must be a list of positive ints, got {buckets!r}") from None
    if not items:
        raise ConfigError("buckets is empty: give at least one batch size, e.g. buckets=[1, 2, 4]")
    for b in items:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ConfigError(f"every bucket must be a positive int, got {b!r} in {items}")
    ladder = sorted({int(b) for b in items})
    if max_batch is not None and ladder[-1] > max_batch:
        raise ConfigError(f"bucket {ladder[-1]} exceeds max_batch={max_batch}")
    return ladder


@dataclass(frozen=True)
class BucketSuggestion:
    """The result of :func:`suggest_buckets`; unpacks as ``(buckets, expected_waste)``.

    ``expected_waste`` is the mean number of padded (wasted) rows per batch under the observed
    histogram; ``waste_fraction`` the share of all computed rows that are padding.
    """

    buckets: list[int]
    expected_waste: float
    waste_fraction: float = 0.0

    def __iter__(self):  # noqa: D105 - ``ladder, waste = suggest_buckets(...)``
        return iter((self.buckets, self.expected_waste))


def _histogram(observed: Iterable[int] | Mapping[int, int]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(observed, Mapping):
        # JSON histograms (a runner's stats()["batch_size_histogram"]) have string keys.
        counts = Counter({int(k) if isinstance(k, str) and k.isdigit() else k: v
                          for k, v in observed.items()})
    else:
        counts = Counter(observed)
    if not counts:
        raise ConfigError("observed_batch_sizes is empty: need at least one observed batch")
    for size, count in counts.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"observed batch sizes must be positive ints, got {size!r}")
        if not isinstance(count, (int, float, np.integer, np.floating)) or count < 0:
            raise ConfigError(f"count of batch size {size} must be >= 0, got {count!r}")
    sizes = np.array(sorted(int(s) for s in counts if counts[s] > 0), dtype=np.float64)
    if not len(sizes):
        raise ConfigError("observed_batch_sizes has no batch with a positive count")
    weights = np.array([float(counts[int(s)]) for s in sizes], dtype=np.float64)
    return sizes, weights


def suggest_buckets(
    observed_batch_sizes: Iterable[int] | Mapping[int, int],
    max_graphs: int | None = None,
    memory_per_graph: int | None = None,
    memory_budget: int | None = None,
) -> BucketSuggestion:
    """The ladder that minimises expected padding waste for an observed traffic histogram.

    Args:
        observed_batch_sizes: batch sizes seen (one entry per batch) or a ``{size: count}``
            histogram (string keys allowed, so a runner's ``stats()["batch_size_histogram"]``
            can be passed as it is).
        max_graphs: at most this many buckets.
        memory_per_graph: bytes one graph costs (e.g. the largest ``standalone_bytes`` from a
            runner's ``memory_report()``); with ``memory_budget`` it caps the count at
            ``memory_budget // memory_per_graph`` (a conservative, additive model: graphs
            sharing a pool usually cost less).
        memory_budget: bytes available for graphs.

    Returns a :class:`BucketSuggestion`. The largest observed size is always a bucket (so every
    observed batch has a graph); with no limit every distinct size is a bucket (zero waste).
    Exact: dynamic programming over the sorted distinct sizes (an optimal bucket always sits on
    an observed size), O(graphs x sizes^2) vectorised.
    """
    sizes, weights = _histogram(observed_batch_sizes)
    limit = len(sizes)
    if max_graphs is not None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ConfigError(f"max_graphs must be a positive int, got {max_graphs!r}")
        limit = min(limit, max_graphs)
    if (memory_per_graph is None) != (memory_budget is None):
        raise ConfigError("give memory_per_graph and memory_budget together (or neither)")
    if memory_per_graph is not None and memory_budget is not None:
        if memory_per_graph <= 0 or memory_budget <= 0:
            raise ConfigError("memory_per_graph and memory_budget must be positive")
        fit = int(memory_budget // memory_per_graph)
        if fit < 1:
            raise ConfigError(
                f"memory_budget={memory_budget} bytes holds no graph of {memory_per_graph} bytes; "
                f"at least one graph (the largest observed batch, {int(sizes[-1])}) is needed"
            )
        limit = min(limit, fit)
    k = len(sizes)
    cum_w = np.concatenate(([0.0], np.cumsum(weights)))
    cum_ws = np.concatenate(([0.0], np.cumsum(weights * sizes)))
    # cost[i, j]: waste of one bucket at sizes[j] covering sizes[i..j] (i <= j).
    # best[m][j]: least waste covering sizes[0..j] with m buckets, the last at sizes[j].
    inf = float("inf")
    best = np.full(k, inf)
    best[:] = sizes * cum_w[1:] - cum_ws[1:]  # one bucket covering 0..j
    back = [np.full(k, -1, dtype=np.int64)]
    layers = [best.copy()]
    for _m in range(2, limit + 1):
        new = np.full(k, inf)
        arg = np.full(k, -1, dtype=np.int64)
        prev = layers[-1]
        for j in range(1, k):
            i = np.arange(j)  # previous bucket at sizes[i]; this one covers i+1..j
            cand = prev[:j] + sizes[j] * (cum_w[j + 1] - cum_w[i + 1]) - (cum_ws[j + 1] - cum_ws[i + 1])
            t = int(np.argmin(cand))
            new[j], arg[j] = cand[t], t
        layers.append(new)
        back.append(arg)
    m = int(np.argmin([layer[k - 1] for layer in layers]))  # fewest buckets among ties
    waste = float(layers[m][k - 1])
    ladder = []
    j = k - 1
    for level in range(m, -1, -1):
        ladder.append(int(sizes[j]))
        j = int(back[level][j])
    ladder.reverse()
    total = float(cum_w[-1])
    live = float(cum_ws[-1])
    return BucketSuggestion(ladder, waste / total, waste / (live + waste) if live + waste else 0.0)
