"""Bucketed graph capture for inference servers: :class:`GraphRunner` and ladder helpers.

Modules: ``core`` (GraphRunner: construction and the hot path), ``options`` (RunnerOptions, the
settings checked once), ``runtime`` (RunnerRuntime, the runner's whole state, and Bucket),
``capture`` (capture_buckets over a runtime), ``serving`` (calls off the hot path), ``reports``
(memory_report/stats from a runtime), ``verify`` (first-replay verification), ``inputs``
(static inputs), ``buckets`` (ladders), ``support`` (small helpers).
"""

from .buckets import BucketSuggestion, default_ladder, suggest_buckets
from .core import GraphRunner
from .reports import MEMORY_SCHEMA, STATS_SCHEMA
from .runtime import Bucket, RunnerRuntime

__all__ = [
    "MEMORY_SCHEMA",
    "STATS_SCHEMA",
    "Bucket",
    "BucketSuggestion",
    "GraphRunner",
    "RunnerRuntime",
    "default_ladder",
    "suggest_buckets",
]
