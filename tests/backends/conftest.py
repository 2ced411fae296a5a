"""Fixtures for the backend tests: FAKE torch.cuda / torch.xpu installs (plumbing tests only,
never GPU verification) and a registry that is restored after every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from accel_graph.backends import register_backend, registered_backends, unregister_backend
from accel_graph.backends.cuda import CudaBackend
from accel_graph.backends.hip import HipBackend
from accel_graph.backends.xpu import XpuBackend

from .fakes import FakeCudaModule


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


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> FakeCudaModule:
    """A FAKE CUDA build with two sm_90 devices, installed into torch.cuda."""
    fake = FakeCudaModule()
    fake.install_into_torch(monkeypatch)
    return fake


@pytest.fixture
def fake_rocm(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> FakeCudaModule:
    """A FAKE ROCm 7.0 build with two gfx942 devices, installed into torch.cuda."""
    fake = FakeCudaModule(arch_list=("gfx90a", "gfx942"))
    fake.install_into_torch(monkeypatch, hip="7.0.51831-7c9236b16")
    return fake
