"""Allocator simulation: whole-trace replay through the engine (``replayer``), what-if scenarios
(``scenario``), torch version x device profiles (``profiles``), fidelity against recordings
(``fidelity``) and synthetic workloads (``generate``)."""
