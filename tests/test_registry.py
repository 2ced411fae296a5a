"""Backend registry and routing: built-ins, plugins, ACCEL_GRAPH_BACKEND, probes that never raise."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import accel_graph as ag
from accel_graph import backends
from accel_graph.backends.base import Backend, Capabilities
from accel_graph.backends.recorder import RecorderBackend


class _BrokenProbe(RecorderBackend):
    """A recorder whose probe raises: routing must report, not crash."""

    name = "broken-probe-test"
    aliases = ()
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    priority = 50

    @classmethod
    def probe(cls):
        raise RuntimeError("driver exploded")


class _UnusableNative(RecorderBackend):
    name = "unusable-native-test"
    aliases = ()
    device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    priority = 60

    @classmethod
    def probe(cls):
        return "no such driver on this host"


@pytest.fixture
def registered():
    added = []

    def add(cls):
        backends.register_backend(cls)
        added.append(cls.name)

    yield add
    for name in added:
        backends.unregister_backend(name)


def test_recorder_is_registered_and_usable():
    assert "recorder" in backends.registered_backends()
    assert backends.probe_all()["recorder"] is None
    assert "recorder" in backends.available_backends()


def test_no_accelerator_routes_to_the_cpu_recorder(monkeypatch):
    monkeypatch.delenv("ACCEL_GRAPH_BACKEND", raising=False)
    backend, device = backends.select_backend(None)
    assert backend.name == "recorder" and device.type == "cpu"
    assert ag.current_backend().name == "recorder"


def test_aliases_resolve():
    assert backends.get_backend("cpu") is backends.get_backend("recorder")


def test_unknown_backend_names_what_exists(monkeypatch):
    with pytest.raises(ag.BackendUnavailable, match="registered: .*recorder"):
        backends.get_backend("tpu-9000")
    monkeypatch.setenv("ACCEL_GRAPH_BACKEND", "tpu-9000")
    with pytest.raises(ag.BackendUnavailable, match="no backend named 'tpu-9000'"):
        ag.Graph()


def test_env_var_forces_a_backend(monkeypatch):
    monkeypatch.setenv("ACCEL_GRAPH_BACKEND", "recorder")
    assert ag.Graph().backend.name == "recorder"


def test_probe_exceptions_become_reasons(registered):
    registered(_BrokenProbe)
    reason = backends.probe_all()["broken-probe-test"]
    assert "RuntimeError" in reason and "driver exploded" in reason
    # Routing skips it (with the reason logged) and falls back to the recorder.
    assert ag.Graph(device="cpu").backend.name == "recorder"
    with pytest.raises(ag.BackendUnavailable, match="driver exploded"):
        backends.get_backend("broken-probe-test")


def test_unusable_native_backend_falls_back_with_reason(registered, caplog):
    registered(_UnusableNative)
    with caplog.at_level("INFO", logger="accel_graph"):
        g = ag.Graph(device="cpu")
    assert g.backend.name == "recorder"
    assert "no such driver on this host" in caplog.text


def test_a_usable_higher_priority_backend_wins(registered):
    class Preferred(RecorderBackend):
        name = "preferred-test"
        aliases = ()
        device_types: ClassVar[tuple[str, ...]] = ("cpu",)
        priority = 70

    registered(Preferred)
    assert ag.Graph(device="cpu").backend.name == "preferred-test"


def test_plugin_module_must_define_exactly_one_backend():
    import types

    mod = types.ModuleType("fake_plugin_mod")

    class A(RecorderBackend):
        pass

    A.__module__ = "fake_plugin_mod"
    mod.A = A
    assert backends._single_backend_class(mod) is A

    class B(RecorderBackend):
        pass

    B.__module__ = "fake_plugin_mod"
    mod.B = B
    with pytest.raises(ag.BackendUnavailable, match="exactly one"):
        backends._single_backend_class(mod)


def test_entry_point_plugins_are_discovered(monkeypatch):
    class EP:
        name = "ep-test"

        @staticmethod
        def load():
            class Plugged(RecorderBackend):
                name = "plugged-test"
                aliases = ()

            return Plugged

    monkeypatch.setattr(backends, "entry_points", lambda group: [EP()] if group == backends.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(backends, "_classes", None)
    try:
        assert "plugged-test" in backends.registered_backends()
    finally:
        backends._classes = None


def test_contracts_are_abstract():
    with pytest.raises(TypeError):
        Backend()  # type: ignore[abstract]
    caps = backends.get_backend("recorder").capabilities()
    assert isinstance(caps, Capabilities) and not caps.native_graphs


def test_device_that_does_not_exist():
    with pytest.raises(ag.BackendUnavailable, match="does not exist|no accelerator"):
        ag.Graph(device="cuda:7" if not torch.cuda.is_available() else "cuda:99")


def test_import_has_no_side_effects():
    import subprocess
    import sys

    code = (
        "import sys, accel_graph;"
        "bad=[m for m in sys.modules if m.startswith(('accel_graph.backends.cuda','accel_graph.backends.hip',"
        "'accel_graph.backends.xpu','accel_graph.backends.recorder','accel_graph.allocator.core._core','intel_extension'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_device_type_without_a_torch_module_is_not_refused_by_counting():
    # Counting cannot know (no torch.<type> module): routing leaves the device to the backends,
    # which say what they say; it must not claim a driver error.
    from accel_graph.backends.presence import count_devices

    count, error, source = count_devices("lazy")
    assert count is None and error is None and "no torch.lazy module" in source
    assert backends.select_backend("lazy")[0].name == "recorder"


def test_cpu_and_meta_are_never_counted(monkeypatch):
    monkeypatch.delenv("ACCEL_GRAPH_BACKEND", raising=False)
    assert backends.select_backend("cpu")[1] == torch.device("cpu")
    assert backends.select_backend("meta")[1] == torch.device("meta")
