"""Serving on graphs: a continuous-batching engine over flat mixed prefill/decode steps.

``accel_graph.serving.Engine`` schedules requests into steps (:mod:`.step`), and an executor runs
each step eagerly or from captured graphs (token buckets with attention islands, or whole-step
graphs: docs/serving.md "Graph modes"). docs/serving.md is the guide.

Names are imported on first access (importing this package imports neither torch nor a model).
"""

from ..foundation.lazy import lazy_exports

_LAZY = {
    "Engine": ".engine",
    "EngineRun": ".engine",
    "Request": ".requests",
    "RequestResult": ".requests",
    "QueueFull": ".requests",
    "InvalidRequest": ".requests",
    "Scheduler": ".scheduler",
    "KVCacheSizing": ".engine_memory",
    "LeaderExecutor": ".engine_tp",
    "follow": ".engine_tp",
    "poisson_requests": ".workload",
    "EagerExecutor": ".executors",
    "GraphExecutor": ".executors",
    "Segment": ".step",
    "StepBatch": ".step",
    "StepExecutor": ".step",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
