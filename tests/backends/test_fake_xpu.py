"""xpu backend against a FAKE torch.xpu / torch.accelerator.Graph: routing and plumbing only.

Nothing here runs on an Intel GPU or verifies XPU behaviour; the fakes (tests/backends/fakes.py)
only record which torch APIs the backend calls and with what arguments.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import accel_graph
from accel_graph.backends import get_backend, select_backend
from accel_graph.backends.xpu import XpuBackend

from .fakes import FakeXpuModule


def capture(g: accel_graph.Graph, fake: FakeXpuModule, *sizes: int, **kw: object) -> None:
    with accel_graph.graph(g, **kw):
        for n in sizes:
            fake.allocate(n)


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch, native_registry: None):  # noqa: ANN201
    def make(**kwargs: object) -> FakeXpuModule:
        fake = FakeXpuModule(**kwargs)  # type: ignore[arg-type]
        fake.install_into_torch(monkeypatch)
        return fake

    return make


def test_fake_xpu_without_graph_classes_falls_back_to_recorder(install) -> None:  # noqa: ANN001
    install(xpu_graph=False, accelerator_graph=None)
    reason = XpuBackend.probe()
    assert reason is not None and "neither torch.accelerator.Graph nor torch.xpu.XPUGraph" in reason
    assert "recorder" in reason
    backend, dev = select_backend("xpu:0")
    assert backend.name == "recorder" and dev == torch.device("xpu", 0)


def test_fake_xpu_unavailable(install) -> None:  # noqa: ANN001
    fake = install()
    fake.available = False
    assert XpuBackend.probe() == (
        "torch.xpu.is_available() is False (no Intel GPU or no XPU build of torch)"
    )


def test_fake_xpu_probe_does_not_initialise(install) -> None:  # noqa: ANN001
    fake = install(accelerator_graph="registered")
    assert XpuBackend.probe() is None
    assert not fake.initialized and fake.graphs == [] and fake.calls == []


def test_fake_xpu_uses_xpugraph_on_torch_2_11(install) -> None:  # noqa: ANN001
    fake = install()
    g = accel_graph.Graph(device="xpu")
    assert g.backend.name == "xpu" and g.device.index == 0
    capture(g, fake, 4096)
    tg = fake.graphs[-1]
    assert type(tg).__name__ == "FakeXPUGraph"
    begin = dict(tg.calls)["capture_begin"]
    assert begin["pool"][0] == 0 and begin["pool"][1] > 0
    assert g.memory_bytes() == 4096
    g.replay()
    assert fake.replays == 1


def test_fake_xpu_prefers_registered_accelerator_graph(install) -> None:  # noqa: ANN001
    fake = install(accelerator_graph="registered")
    h = accel_graph.graph_pool_handle("xpu:0")
    g = accel_graph.Graph(device="xpu:0", pool=h)
    capture(g, fake, 100)
    tg = fake.graphs[-1]
    assert type(tg).__name__ == "FakeAcceleratorGraph"
    # pool and mode went in as the 2.13 constructor keywords/attributes
    assert tg.graph_pool == dict(tg.calls)["capture_begin"]["pool"] and tg.capture_error_mode == "default"
    assert g.memory_bytes() == 100


def test_fake_xpu_accelerator_graph_with_main_signature(install) -> None:  # noqa: ANN001
    fake = install(accelerator_graph="main")
    g = accel_graph.Graph(device="xpu:0")
    capture(g, fake, 64)
    tg = fake.graphs[-1]
    assert type(tg).__name__ == "FakeAcceleratorGraph"
    assert dict(tg.calls)["capture_begin"] == {"pool": tg.graph_pool, "mode": "default"}
    assert tg.graph_pool is not None and g.memory_bytes() == 64


def test_fake_xpu_unregistered_accelerator_graph_falls_back(install) -> None:  # noqa: ANN001
    fake = install(accelerator_graph="unregistered")
    g = accel_graph.Graph(device="xpu:0")
    capture(g, fake)
    assert type(fake.graphs[-1]).__name__ == "FakeXPUGraph"


@pytest.mark.parametrize("accelerator_graph", [None, "registered"])
def test_fake_xpu_warns_on_ignored_modes(install, accelerator_graph: str | None) -> None:  # noqa: ANN001
    fake = install(accelerator_graph=accelerator_graph)
    g = accel_graph.Graph(device="xpu:0", capture_error_mode="relaxed")
    with pytest.warns(UserWarning, match="honours only capture_error_mode 'default'; 'relaxed' is ignored"):
        capture(g, fake)
    assert dict(fake.graphs[-1].calls)["capture_begin"]["mode"] == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(accel_graph.Graph(device="xpu:0", capture_error_mode="default"), fake)


def test_fake_xpu_debug_dump_needs_dot_suffix(install, tmp_path) -> None:  # noqa: ANN001
    fake = install()
    g = accel_graph.Graph(device="xpu:0")
    g.enable_debug_mode()
    capture(g, fake)
    g.debug_dump(str(tmp_path / "graph.txt"))
    assert ("debug_dump", str(tmp_path / "graph.txt.dot")) in fake.graphs[-1].calls
    assert (tmp_path / "graph.txt").read_text().startswith("digraph fake")
    assert not (tmp_path / "graph.txt.dot").exists()


def test_fake_xpu_pools_shared_and_per_device(install) -> None:  # noqa: ANN001
    fake = install(device_count=2)
    g1 = accel_graph.Graph(device="xpu:0")
    capture(g1, fake, 10)
    g2 = accel_graph.Graph(device="xpu:0", pool=g1.pool())
    capture(g2, fake, 20)
    assert fake.graphs[-1]._pool == fake.graphs[-2]._pool
    with pytest.raises(accel_graph.PoolError, match="lives on xpu:0, but this graph is on xpu:1"):
        accel_graph.Graph(device="xpu:1", pool=g1.pool())
    stats = get_backend("xpu").pool_stats(g1.pool())
    assert stats is not None and stats.reserved_bytes == 30 and stats.graphs == 2


def test_fake_xpu_describe(install) -> None:  # noqa: ANN001
    install(accelerator_graph="registered")
    facts = dict(get_backend("xpu").describe())
    assert facts["allocator plug-in"].startswith("out of scope")


def test_fake_xpu_unregistered_accelerator_graph_without_xpugraph(install) -> None:  # noqa: ANN001
    fake = install(xpu_graph=False, accelerator_graph="unregistered")
    assert XpuBackend.probe() is None  # the probe cannot construct a graph to find out
    g = accel_graph.Graph(device="xpu:0")
    with pytest.raises(accel_graph.BackendUnavailable, match="ACCEL_GRAPH_BACKEND=recorder"):
        capture(g, fake)
    assert g.state == "empty" and get_backend("xpu").pools.held() == {}
