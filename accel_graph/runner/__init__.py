"""Bucketed graph capture for inference servers: :class:`GraphRunner` and ladder helpers."""

from .buckets import BucketSuggestion, default_ladder, suggest_buckets
from .core import GraphRunner
from .reports import MEMORY_SCHEMA, STATS_SCHEMA

__all__ = [
    "MEMORY_SCHEMA",
    "STATS_SCHEMA",
    "BucketSuggestion",
    "GraphRunner",
    "default_ladder",
    "suggest_buckets",
]
