"""Shared pytest configuration: the accel-graph plugin gives every test a backend/device fixture
(and, on backends that compile, an interpreted and a ``+inductor`` case); ``pytester`` lets the
conformance suite check the plugin itself."""

from collections.abc import Iterator

import pytest

from accel_graph.backends import register_backend, registered_backends, unregister_backend
from accel_graph.backends.cuda import CudaBackend
from accel_graph.backends.hip import HipBackend
from accel_graph.backends.xpu import XpuBackend

pytest_plugins = ["accel_graph.testing.plugin", "pytester"]


@pytest.fixture
def native_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register the cuda/hip/xpu backends for one test; restore the registry afterwards (the
    built-in table may already hold them: those entries come back as they were)."""
    monkeypatch.delenv("ACCEL_GRAPH_BACKEND", raising=False)
    before = registered_backends()
    for cls in (CudaBackend, HipBackend, XpuBackend):
        register_backend(cls)
    yield
    for name in registered_backends():
        if name not in before:
            unregister_backend(name)
    for cls in before.values():
        register_backend(cls)  # also drops instances that cached fake state
