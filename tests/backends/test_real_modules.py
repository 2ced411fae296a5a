"""The native backends' probes, routing and graph-API presence against the REAL torch modules.

No fakes here: ``torch.cuda`` / ``torch.xpu`` / ``torch.accelerator`` are the installed build's
(on torch 2.14.1+cu130 a CUDA build with no device on these machines; on 2.13.0+cpu a CPU
build). Every expectation is derived from the installed torch (its version strings, its own
``device_count()``), never hard-coded for one version. The broken-driver cases patch ONE real
function to raise (named "simulated" below); on a CPU build they also mark the build as CUDA,
since only a CUDA build asks a driver.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import accel_graph
from accel_graph import BackendUnavailable
from accel_graph.backends import probe_all, routing_report, select_backend
from accel_graph.backends.cuda import CudaBackend
from accel_graph.backends.hip import HipBackend
from accel_graph.backends.presence import accelerator_presence, build_label
from accel_graph.backends.torch_apis import CONDITIONAL_NODES, GRAPH_HOOKS, graph_api_presence
from accel_graph.backends.xpu import XpuBackend
from accel_graph.cli import doctor
from accel_graph.foundation.torch_support import release_of

DRIVER_ERROR = "CUDA driver initialization failed, you might not have a CUDA gpu."
RELEASE = release_of(torch.__version__)


def real_cuda_devices() -> int:
    """What the installed torch itself says, asked independently of accel-graph."""
    return torch.cuda.device_count() if torch.version.cuda or torch.version.hip else 0


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    monkeypatch.delenv("ACCEL_GRAPH_BACKEND", raising=False)


# -- probes give reasons, never exceptions ------------------------------------------------------
@pytest.mark.parametrize("cls", [CudaBackend, HipBackend, XpuBackend], ids=lambda c: c.name)
def test_real_probe_returns_a_reason_or_none_without_raising(clean: None, cls: type) -> None:
    reason = cls.probe()  # called directly: safe_probe would hide an exception
    assert reason is None or (isinstance(reason, str) and reason)
    assert probe_all()[cls.name] == reason


def test_real_cuda_probe_matches_the_build(clean: None) -> None:
    reason = CudaBackend.probe()
    if torch.version.hip:
        assert "ROCm build" in reason
    elif torch.version.cuda is None:
        assert reason == "torch.version.cuda is None: this torch build has no CUDA support"
    elif real_cuda_devices() == 0:  # a CUDA build on a GPU-less host (pip's default 2.14.1 here)
        assert reason.startswith("torch.cuda.is_available() is False") or "device_count() is 0" in reason
    else:
        assert reason is None


def test_real_hip_probe_matches_the_build(clean: None) -> None:
    if not torch.version.hip:
        assert HipBackend.probe() == "torch.version.hip is None: this is not a ROCm build of torch"
    else:
        assert (HipBackend.probe() is None) == (real_cuda_devices() > 0)


# -- routing on the real build --------------------------------------------------------------------
def test_real_routing_follows_the_devices_present(clean: None) -> None:
    found = accelerator_presence()
    acc = torch.accelerator.current_accelerator()
    assert found.device_type == (None if acc is None else acc.type)
    assert found.device_count == torch.accelerator.device_count()
    backend, dev = select_backend(None)
    report = routing_report()
    if torch.accelerator.device_count() == 0:
        assert (backend.name, dev) == ("recorder", torch.device("cpu"))
        assert accel_graph.Graph().backend.name == "recorder"  # the README's first example
        if acc is not None:  # an accelerator build without a device: the doctor says why
            assert report["reason"] == (
                f"build has {build_label(acc.type)}, 0 devices: graphs use the recorder on the CPU"
            )
            if acc.type == "cuda" and torch.version.cuda:
                assert report["reason"].startswith(f"build has CUDA {torch.version.cuda}, 0 devices")
    else:
        assert dev.type == acc.type and dev.index == torch.accelerator.current_device_index()


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_real_explicit_device_without_one_is_a_clear_error(clean: None, device: object) -> None:
    if isinstance(device, int) and torch.accelerator.current_accelerator() is None:
        with pytest.raises(BackendUnavailable, match="no accelerator; pass device='cpu'"):
            accel_graph.Graph(device=device)
        return
    if real_cuda_devices() > 0:  # a GPU host: the device exists and is used
        assert accel_graph.Graph(device=device).device_spec.device_type == "cuda"
        return
    with pytest.raises(BackendUnavailable, match=r"0 cuda devices.*Pass device='cpu'"):
        accel_graph.Graph(device=device)


def test_real_forced_recorder_still_refuses_a_missing_device(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_BACKEND", "recorder")
    assert accel_graph.Graph().backend.name == "recorder"
    if real_cuda_devices() == 0:
        with pytest.raises(BackendUnavailable, match="does not exist: this host has 0 cuda devices"):
            accel_graph.Graph(device="cuda")


# -- graph-API presence is read from the real modules ---------------------------------------------
#: What each verified release's wheels have, as read off them (docs/backends.md). Checked only
#: for the installed release; the generic test below covers every other.
KNOWN: dict[str, dict[str, bool]] = {
    "2.14": {"hooks": True, "while_loop_node": True, "if_else_node": True, "make_graphed_callables": True},
    "2.13": {"hooks": False, "while_loop_node": False, "if_else_node": True, "make_graphed_callables": True},
    # 2.11 (the GPU hosts): no cudagraph_conditional_nodes module at all
    "2.11": {"hooks": False, "while_loop_node": False, "if_else_node": False, "make_graphed_callables": True},
}


def test_real_api_presence_is_what_the_modules_have() -> None:
    apis = graph_api_presence()
    try:
        nodes = importlib.import_module(CONDITIONAL_NODES)
    except ImportError:  # torch 2.11: the module does not exist, so neither do its builders
        nodes = None
    assert apis["torch.cuda.make_graphed_callables"]["present"] == hasattr(torch.cuda, "make_graphed_callables")
    assert apis[f"{CONDITIONAL_NODES}.if_else_node"]["present"] == hasattr(nodes, "if_else_node")
    assert apis[f"{CONDITIONAL_NODES}.while_loop_node"]["present"] == hasattr(nodes, "while_loop_node")
    assert apis["torch.accelerator.Graph"]["present"] == hasattr(torch.accelerator, "Graph")
    for hook in GRAPH_HOOKS:
        assert apis[f"torch.cuda.graphs.{hook}"]["present"] == hasattr(torch.cuda.graphs, hook)
    cg = torch.cuda.CUDAGraph
    assert apis["while_loop capture (while nodes)"]["present"] == (
        hasattr(nodes, "while_loop_node") and hasattr(cg, "begin_capture_to_while_node")
        and hasattr(cg, "set_conditional_handle_for_current_node")
    )
    known = KNOWN.get(RELEASE or "")
    if known is not None:
        assert all(apis[f"torch.cuda.graphs.{h}"]["present"] is known["hooks"] for h in GRAPH_HOOKS)
        assert apis[f"{CONDITIONAL_NODES}.while_loop_node"]["present"] is known["while_loop_node"]
        assert apis[f"{CONDITIONAL_NODES}.if_else_node"]["present"] is known["if_else_node"]
        assert apis["torch.cuda.make_graphed_callables"]["present"] is known["make_graphed_callables"]


def test_real_api_presence_is_read_live(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = f"torch.cuda.graphs.{GRAPH_HOOKS[0]}"
    monkeypatch.setattr(torch.cuda.graphs, GRAPH_HOOKS[0], lambda fn: None, raising=False)
    assert graph_api_presence()[hook]["present"] is True
    monkeypatch.delattr(torch.cuda.graphs, GRAPH_HOOKS[0])
    assert graph_api_presence()[hook]["present"] is False


def test_real_doctor_reports_presence_and_why_it_routed(clean: None) -> None:
    r = doctor.collect()
    assert r["graph_apis"]["apis"] == graph_api_presence()
    assert r["routing"]["reason"] == routing_report()["reason"]
    assert r["routing"]["accelerator"]["device_count"] == torch.accelerator.device_count()
    text = doctor.format_report(r)
    assert f"why: {r['routing']['reason']}" in text
    assert "torch.cuda.make_graphed_callables" in text


# -- a broken driver (simulated: one real function raises) ---------------------------------------
@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch, clean: None) -> None:
    """The installed build when it is a CUDA build; on a CPU build, SIMULATED as one (the
    version string and the accelerator type), since only a CUDA build asks a driver."""
    if torch.version.cuda is None or torch.version.hip:
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))


def _raise(*args: object, **kwargs: object) -> None:
    raise RuntimeError(DRIVER_ERROR)


def test_simulated_device_count_failure_is_reported_everywhere(cuda_build: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", _raise)
    found = accelerator_presence()
    assert found.device is None and DRIVER_ERROR in found.error
    assert DRIVER_ERROR in CudaBackend.probe()  # a reason, not an exception
    backend, dev = select_backend(None)
    assert (backend.name, dev) == ("recorder", torch.device("cpu"))
    report = routing_report()
    assert DRIVER_ERROR in report["reason"] and "recorder on the CPU" in report["reason"]
    with pytest.raises(BackendUnavailable, match="counting cuda devices failed.*driver initialization failed"):
        accel_graph.Graph(device="cuda:0")
    r = doctor.collect()
    assert any(DRIVER_ERROR in p for p in r["problems"])
    assert DRIVER_ERROR in {b["name"]: b for b in r["backends"]}["cuda"]["reason"]


def test_simulated_is_available_failure_is_a_reason(cuda_build: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", _raise)
    assert CudaBackend.probe() == f"torch.cuda.is_available() raised RuntimeError: {DRIVER_ERROR}"


def test_simulated_device_properties_failure_falls_back_to_the_cpu(
    cuda_build: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The count says one device, but reading it fails (the driver broke after enumeration).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", _raise)
    monkeypatch.setattr(torch.cuda, "get_device_capability", _raise)
    assert CudaBackend.probe() is None  # the probe touches no device, so it cannot know
    with caplog.at_level("WARNING", logger="accel_graph"):
        g = accel_graph.Graph()
    assert g.backend.name == "recorder" and g.device_spec.device_type == "cpu" and g.device == torch.device("cpu")
    assert DRIVER_ERROR in caplog.text
    report = routing_report(check_device=True)
    assert DRIVER_ERROR in report["device_error"] and "recorder on the CPU" in report["reason"]
    r = doctor.collect(probe_devices=True)
    assert any(DRIVER_ERROR in p for p in r["problems"])
    assert r["nvidia"]["devices"][0]["error"].endswith(DRIVER_ERROR)
    with pytest.raises(BackendUnavailable, match=r"compute capability of cuda:0 \(CUDA driver.*nvidia-smi"):
        accel_graph.Graph(device="cuda:0")  # an explicit device: an error that says what to do
