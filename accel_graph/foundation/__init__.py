"""Foundations every other part of accel-graph may import: environment settings (:mod:`.config`),
per-dtype tolerances, compile options, the GC pause around capture, lazy package faces and the
torch releases accel-graph is verified on. Nothing here imports torch at import time, and
nothing here imports any other part of the package except :mod:`accel_graph.errors`."""
