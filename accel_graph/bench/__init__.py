"""Benchmarks: timing helpers and the decode-step benchmark behind ``accel-graph bench``."""

from .decode import SCHEMA_VERSION, VARIANTS, DecodeBenchSettings, run_decode_bench
from .timing import count_allocations, hardware_info, interleaved_samples, summarize_ns

__all__ = [
    "SCHEMA_VERSION",
    "VARIANTS",
    "DecodeBenchSettings",
    "count_allocations",
    "hardware_info",
    "interleaved_samples",
    "run_decode_bench",
    "summarize_ns",
]
