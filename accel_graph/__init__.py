"""accel-graph: one capture API for device graphs on every PyTorch device.

Public API only. Importing this package imports no vendor module and compiles nothing; backends
are loaded on first use.
"""

from typing import TYPE_CHECKING

from .errors import (
    AccelGraphError,
    BackendUnavailable,
    CaptureError,
    ConfigError,
    GraphStateError,
    PoolError,
    ReplayError,
)
from .foundation.lazy import lazy_exports
from .foundation.torch_support import UnsupportedTorchWarning, warn_if_unverified

if TYPE_CHECKING:
    from .backends import current_backend, get_backend
    from .errors import OutOfMemoryError
    from .foundation.compile_options import CompileOptions
    from .graphs.capturable import check_capturable
    from .graphs.graph import (
        Graph,
        graph,
        graph_pool_handle,
        is_current_stream_capturing,
    )
    from .graphs.graph_checks import EmptyGraphWarning
    from .graphs.graphed_callables import make_graphed_callables
    from .graphs.hooks import (
        register_graph_capture_end_hook,
        register_graph_capture_start_hook,
        register_graph_destroy_hook,
        register_graph_instantiate_hook,
        register_graph_replay_end_hook,
        register_graph_replay_start_hook,
    )
    from .graphs.islands import eager_island, is_eager_island
    from .graphs.memory_plan import plan_graph_memory
    from .runner import GraphRunner, suggest_buckets

#: Public names that need torch, imported on first access so that the allocator tools
#: (``accel-alloc``, ``accel_graph.allocator``) start without importing torch.
_LAZY: dict[str, str] = {
    "current_backend": ".backends",
    "get_backend": ".backends",
    "check_capturable": ".graphs.capturable",
    "CompileOptions": ".foundation.compile_options",
    "OutOfMemoryError": ".errors",
    "EmptyGraphWarning": ".graphs.graph_checks",
    "eager_island": ".graphs.islands",
    "is_eager_island": ".graphs.islands",
    "Graph": ".graphs.graph",
    "graph": ".graphs.graph",
    "graph_pool_handle": ".graphs.graph",
    "is_current_stream_capturing": ".graphs.graph",
    "make_graphed_callables": ".graphs.graphed_callables",
    "plan_graph_memory": ".graphs.memory_plan",
    "register_graph_capture_end_hook": ".graphs.hooks",
    "register_graph_capture_start_hook": ".graphs.hooks",
    "register_graph_destroy_hook": ".graphs.hooks",
    "register_graph_instantiate_hook": ".graphs.hooks",
    "register_graph_replay_end_hook": ".graphs.hooks",
    "register_graph_replay_start_hook": ".graphs.hooks",
    "GraphRunner": ".runner",
    "suggest_buckets": ".runner",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

# One warning for a torch outside the verified releases (torch_support.VERIFIED); it reads
# torch's version without importing torch and never raises.
warn_if_unverified()

__version__ = "0.1.0"

__all__ = [
    "AccelGraphError",
    "BackendUnavailable",
    "CaptureError",
    "CompileOptions",
    "ConfigError",
    "EmptyGraphWarning",
    "Graph",
    "GraphRunner",
    "GraphStateError",
    "OutOfMemoryError",
    "PoolError",
    "ReplayError",
    "UnsupportedTorchWarning",
    "check_capturable",
    "current_backend",
    "eager_island",
    "is_eager_island",
    "get_backend",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "make_graphed_callables",
    "plan_graph_memory",
    "register_graph_capture_end_hook",
    "register_graph_capture_start_hook",
    "register_graph_destroy_hook",
    "register_graph_instantiate_hook",
    "register_graph_replay_end_hook",
    "register_graph_replay_start_hook",
    "suggest_buckets",
]
