"""Allocator simulation: whole-trace replay through the engine (``replayer``; the trace-to-ops
conversion in ``trace_ops``, the result types in ``results``), what-if scenarios (``scenario``),
torch version x device profiles (``profiles``), fidelity against recordings (``fidelity``) and
synthetic workloads (``generate``)."""
