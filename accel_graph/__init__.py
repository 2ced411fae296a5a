"""accel-graph: one capture API for device graphs on every PyTorch device.

Public API only. Importing this package imports no vendor module and compiles nothing; backends
are loaded on first use.
"""

import sys
import types
from typing import TYPE_CHECKING, Any

from ._lazy import lazy_exports
from .errors import (
    AccelGraphError,
    BackendUnavailable,
    CaptureError,
    ConfigError,
    GraphStateError,
    PoolError,
    ReplayError,
)

if TYPE_CHECKING:
    from .backends import current_backend, get_backend
    from .capturable import check_capturable
    from .errors import OutOfMemoryError
    from .graph import Graph, graph, graph_pool_handle, is_current_stream_capturing
    from .runner import GraphRunner, suggest_buckets

#: Public names that need torch, imported on first access so that the allocator tools
#: (``accel-alloc``, ``accel_graph.allocator``) start without importing torch.
_LAZY: dict[str, str] = {
    "current_backend": ".backends",
    "get_backend": ".backends",
    "check_capturable": ".capturable",
    "OutOfMemoryError": ".errors",
    "Graph": ".graph",
    "graph": ".graph",
    "graph_pool_handle": ".graph",
    "is_current_stream_capturing": ".graph",
    "GraphRunner": ".runner",
    "suggest_buckets": ".runner",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


class _Package(types.ModuleType):
    """Keeps ``accel_graph.graph`` the context-manager function, as the eager imports did.

    Importing the submodule ``accel_graph.graph`` makes the import system bind the module to
    the package attribute of the same name; with lazy exports that binding would hide the
    function. Bindings of that one submodule are therefore dropped (``sys.modules`` still has
    it), and the first access loads the function through ``__getattr__``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "graph" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
