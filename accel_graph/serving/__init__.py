"""Serving on graphs: a continuous-batching engine over flat mixed prefill/decode steps.

``accel_graph.serving.Engine`` schedules requests into steps (:mod:`.step`), and an executor runs
each step eagerly or from graphs captured per token bucket.
"""
