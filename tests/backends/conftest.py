"""Fixtures for the backend tests: FAKE torch.cuda / torch.xpu installs (plumbing tests only,
never GPU verification) and a registry that is restored after every test."""

from __future__ import annotations

import pytest

from .fakes import FakeCudaModule


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
