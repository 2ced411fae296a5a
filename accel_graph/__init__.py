"""accel-graph: one capture API for device graphs on every PyTorch device.

Public API only. Importing this package imports no vendor module and compiles nothing; backends
are loaded on first use.
"""

from .backends import current_backend, get_backend
from .capturable import check_capturable
from .errors import (
    AccelGraphError,
    BackendUnavailable,
    CaptureError,
    ConfigError,
    GraphStateError,
    OutOfMemoryError,
    PoolError,
    ReplayError,
)
from .graph import Graph, graph, graph_pool_handle, is_current_stream_capturing
from .runner import GraphRunner, suggest_buckets

__version__ = "0.1.0"

__all__ = [
    "AccelGraphError",
    "BackendUnavailable",
    "CaptureError",
    "ConfigError",
    "Graph",
    "GraphRunner",
    "GraphStateError",
    "OutOfMemoryError",
    "PoolError",
    "ReplayError",
    "check_capturable",
    "current_backend",
    "get_backend",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "suggest_buckets",
]
