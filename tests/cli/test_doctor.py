"""``accel-graph doctor``: the true report on this CPU-only machine, and FAKE-module variants.

The CUDA/ROCm/XPU variants run against the FAKE ``torch.cuda`` / ``torch.xpu`` of
tests/backends/fakes.py: they check which facts the doctor reads and how it reports them
(plumbing only), never GPU behaviour.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import accel_graph.backends as backends_mod
from accel_graph.backends import (
    probe_all,
    register_backend,
    registered_backends,
)
from accel_graph.backends.base import Backend
from accel_graph.backends.device_facts import NOT_CHECKED_CUDA
from accel_graph.cli import doctor
from accel_graph.cli.main import main
from accel_graph.foundation.torch_support import release_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for backends.fakes
from backends.fakes import FakeCudaModule, FakeXpuModule  # noqa: E402

ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    """A clean environment and the built-in registry with cuda/hip/xpu, restored after the test
    (``native_registry``; FAKE installs leave cached backend instances behind otherwise)."""
    for name in (*ALLOC_VARS, "ACCEL_GRAPH_BACKEND", "ACCEL_GRAPH_POOL_LIMIT", "ACCEL_GRAPH_COMPILE"):
        monkeypatch.delenv(name, raising=False)


def by_name(report: dict) -> dict[str, dict]:
    return {b["name"]: b for b in report["backends"]}


# -- the true report on this machine ---------------------------------------------------------------
def test_cpu_report_is_true(registry: None) -> None:
    was_init = torch.cuda.is_initialized()
    r = doctor.collect()
    assert r["schema"] == "accel-graph.doctor" and r["schema_version"] == doctor.SCHEMA_VERSION
    assert r["torch"]["version"] == torch.__version__
    assert r["torch"]["cuda"] == torch.version.cuda
    b = by_name(r)
    assert set(b) == set(registered_backends())
    for name, reason in probe_all().items():
        assert b[name]["reason"] == reason and b[name]["usable"] is (reason is None)
    if torch.version.cuda is None and not torch.xpu.is_available():  # this CI machine
        assert b["recorder"]["usable"] and not b["cuda"]["usable"]
        assert b["cuda"]["capabilities"]["native_graphs"] is True
        assert b["recorder"]["capabilities"]["compile"] is True
        assert r["routing"]["backend"] == "recorder" and r["routing"]["device"] == "cpu"
        assert r["nvidia"] is None and r["rocm"] is None
        assert r["xpu"]["route"] is None and "is_available() is False" in r["xpu"]["explanation"]
        assert r["versions"]["cuda_runtime"]["value"] is None
        assert "not a CUDA build" in r["versions"]["cuda_runtime"]["note"]
        assert r["allocator"]["device"] == "cpu"
        assert r["allocator"]["plugin"]["usable"] is False
        assert r["problems"] == []
    if torch.version.cuda and torch.accelerator.device_count() == 0:  # pip's CUDA build, no GPU
        assert b["recorder"]["usable"] and not b["cuda"]["usable"]
        assert r["routing"]["backend"] == "recorder" and r["routing"]["device"] == "cpu"
        assert r["routing"]["reason"] == (
            f"build has CUDA {torch.version.cuda}, 0 devices: graphs use the recorder on the CPU"
        )
        assert r["routing"]["accelerator"]["device_count"] == 0
        assert r["nvidia"]["devices"] is None and r["problems"] == []
    assert r["torch"]["verified"] is (release_of(torch.__version__) in r["torch"]["verified_releases"])
    assert r["allocator"]["variable"] is None and r["allocator"]["canonical"] == ""
    assert r["recorder"]["usable"] and r["recorder"]["pool_limit_bytes"] is None
    assert torch.cuda.is_initialized() == was_init  # nothing was initialised
    json.dumps(r)  # JSON-ready


def test_cli_json_and_table(registry: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schema_version"] == 1 and json.loads(out.read_text())["schema"] == printed["schema"]
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for header in ("versions", "backends", "NVIDIA", "ROCm", "XPU", "allocator", "recorder", "problems:"):
        assert f"\n{header}" in text
    for name in registered_backends():
        assert f"\n  {name} " in text
    assert "routing: Graph() without device= uses" in text


def test_allocator_variable_precedence_and_canonical(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.5,max_split_size_mb:128")
    a = doctor.collect()["allocator"]
    assert a["variable"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert a["ignored_variables"] == ["PYTORCH_ALLOC_CONF"]
    assert a["settings"]["max_split_size"] == 128 << 20
    assert a["canonical"] == "max_split_size_mb:128,garbage_collection_threshold:0.5"
    assert a["raw"] == "garbage_collection_threshold:0.5,max_split_size_mb:128"


def test_bad_allocator_config_is_a_problem_not_a_crash(
    registry: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb")
    r = doctor.collect()
    assert r["allocator"]["variable"] == "PYTORCH_ALLOC_CONF" and r["allocator"]["settings"] is None
    assert "PYTORCH_ALLOC_CONF" in r["allocator"]["error"]
    assert any(p.startswith("allocator config:") for p in r["problems"])
    assert main(["doctor"]) == 0
    assert "allocator config:" in capsys.readouterr().out


def test_recorder_env_is_reported(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_POOL_LIMIT", "64M")
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE", "inductor")
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE_REPLAY", "compiled")
    rec = doctor.collect()["recorder"]
    assert rec["pool_limit_bytes"] == 64 << 20 and rec["compile_default"] == "inductor"
    assert rec["compile_replay_default"] == "compiled"
    monkeypatch.setenv("ACCEL_GRAPH_POOL_LIMIT", "lots")
    assert "ACCEL_GRAPH_POOL_LIMIT" in doctor.collect()["recorder"]["pool_limit_error"]


def test_broken_builtin_and_raising_probe_are_reported(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(backends_mod.BUILTIN_BACKENDS, "ghost", "accel_graph.backends.ghost:Ghost")
    monkeypatch.setattr(backends_mod, "_classes", None)  # rediscover with the broken entry

    class Raising(Backend):
        name = "raising"
        device_types = ("cpu",)

        @classmethod
        def probe(cls) -> str | None:
            raise OSError("driver exploded")

    register_backend(Raising)  # type: ignore[type-abstract]
    r = doctor.collect()
    b = by_name(r)
    assert b["ghost"]["usable"] is False and "failed to load" in b["ghost"]["reason"]
    assert "ModuleNotFoundError" in b["ghost"]["reason"]
    assert any("ghost" in p for p in r["problems"])
    assert b["raising"]["reason"] == "probe raised OSError: driver exploded"
    assert b["raising"]["origin"] == "plugin" and "capabilities_error" in b["raising"]


def test_forced_unknown_backend_is_reported_in_routing(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_BACKEND", "nope")
    routing = doctor.collect()["routing"]
    assert routing["ACCEL_GRAPH_BACKEND"] == "nope" and routing["backend"] is None
    assert "no backend named 'nope'" in routing["error"]


# -- FAKE CUDA --------------------------------------------------------------------------------------
def fake_cuda(monkeypatch: pytest.MonkeyPatch, **kw: object) -> FakeCudaModule:
    fake = FakeCudaModule(**kw)  # type: ignore[arg-type]
    fake.install_into_torch(monkeypatch)
    return fake


def test_fake_cuda_without_probe_initialises_nothing(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_cuda(monkeypatch)
    r = doctor.collect()
    assert not fake.initialized
    nv = r["nvidia"]
    assert nv["arch_list"] == ["sm_80", "sm_90", "compute_90"]
    assert nv["devices"] is None and nv["note"] == NOT_CHECKED_CUDA
    b = by_name(r)
    assert b["cuda"]["usable"] and b["cuda"]["facts"]["torch.version.cuda"] == "12.8"
    assert b["cuda"]["facts"]["device_count"] == "2"
    assert r["routing"]["backend"] == "cuda"
    assert r["versions"]["cuda_build"]["value"] == "12.8"
    assert r["allocator"]["device"] == "cuda"
    text = doctor.format_report(r)
    assert "per-device verdict: not checked: would initialise CUDA" in text


def test_fake_cuda_build_without_devices_says_why(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_cuda(monkeypatch, device_count=0)
    fake.available = False
    r = doctor.collect()
    assert r["routing"]["backend"] == "recorder" and r["routing"]["device"] == "cpu"
    assert r["routing"]["reason"] == "build has CUDA 12.8, 0 devices: graphs use the recorder on the CPU"
    assert r["routing"]["accelerator"] == {
        "device_type": "cuda", "build": "CUDA 12.8", "device_count": 0, "current_index": None,
        "count_source": "torch.accelerator.is_available()", "error": None,
    }
    assert r["problems"] == []  # 0 devices is not a problem
    assert "why: build has CUDA 12.8, 0 devices" in doctor.format_report(r)


def test_fake_cuda_with_devices_names_the_current_one(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_cuda(monkeypatch)
    with fake.device(1):
        routing = doctor.collect()["routing"]
    assert (routing["backend"], routing["device"]) == ("cuda", "cuda:1")
    assert routing["reason"] == "build has CUDA 12.8, 2 devices: graphs use the cuda backend on cuda:1 (the current device)"
    assert not fake.initialized


def test_fake_cuda_probe_gives_arch_verdicts(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_cuda(monkeypatch)
    r = doctor.collect(probe_devices=True)
    assert fake.initialized
    devs = r["nvidia"]["devices"]
    assert [d["index"] for d in devs] == [0, 1]
    assert devs[0]["capability"] == "9.0" and devs[0]["name"] == "Fake GPU"
    assert devs[0]["verdict"]["kind"] == "native" and devs[0]["verdict"]["target"] == "sm_90"
    assert "cuda:0 Fake GPU sm 9.0: native" in doctor.format_report(r)


def test_fake_sm107_is_marked_assumed(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, capability=(10, 7), arch_list=("sm_90", "sm_100"))
    v = doctor.collect(probe_devices=True)["nvidia"]["devices"][0]["verdict"]
    assert v["kind"] == "binary_compatible" and v["assumed"] is True


def test_fake_unsupported_device_is_a_problem(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, capability=(7, 0), arch_list=("sm_80", "sm_90"))
    r = doctor.collect(probe_devices=True)
    assert r["nvidia"]["devices"][0]["verdict"]["kind"] == "unsupported"
    assert any(p.startswith("cuda:0:") and "not supported" in p for p in r["problems"])


def test_fake_cuda_already_initialised_is_read_without_the_flag(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_cuda(monkeypatch)
    fake.initialized = True
    r = doctor.collect()
    assert r["cuda_initialized_before"] is True
    assert r["nvidia"]["devices"][0]["verdict"]["kind"] == "native"


# -- FAKE ROCm --------------------------------------------------------------------------------------
def test_fake_rocm_version_and_quirks_without_probe(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaModule(arch_list=("gfx90a", "gfx942"))
    fake.install_into_torch(monkeypatch, hip="7.0.51831-7c9236b16")
    r = doctor.collect()
    assert not fake.initialized and r["nvidia"] is None
    rocm = r["rocm"]
    assert rocm["parsed"] == [7, 0, 51831] and rocm["devices"] is None
    ids = {q["id"] for q in rocm["quirks"]}
    # by version alone: the arch-specific quirks cannot be ruled out; the ROCm<7 one can
    assert {"warmup-same-stream", "replay-corruption-mi300x", "stale-external-write-gfx950"} <= ids
    assert "expandable-segments-rocm7" not in ids and "captured-event-rocm-7.2.0" not in ids
    assert all(q["references"] for q in rocm["quirks"])
    assert by_name(r)["hip"]["usable"] and not by_name(r)["cuda"]["usable"]
    assert r["allocator"]["device"] == "hip"
    assert r["versions"]["hip_build"]["value"] == "7.0.51831-7c9236b16"


def test_fake_rocm_probe_gives_gfx_and_device_quirks(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaModule(arch_list=("gfx90a", "gfx942"))
    fake.install_into_torch(monkeypatch, hip="6.4.43482")
    r = doctor.collect(probe_devices=True)
    dev = r["rocm"]["devices"][0]
    assert dev["gfx"] == "gfx942" and dev["features"] == {"sramecc": True, "xnack": False}
    assert dev["in_build"] is True
    assert "replay-corruption-mi300x" in dev["quirks"] and "stale-external-write-gfx950" not in dev["quirks"]
    ids = {q["id"] for q in r["rocm"]["quirks"]}
    assert "expandable-segments-rocm7" in ids and "stale-external-write-gfx950" not in ids
    text = doctor.format_report(r)
    assert "cuda:0 gfx942" in text and "expandable-segments-rocm7" in text


# -- FAKE XPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "route"),
    [
        ({"accelerator_graph": "registered"}, "torch.accelerator.Graph"),
        ({"accelerator_graph": None}, "torch.xpu.XPUGraph"),
        ({"accelerator_graph": None, "xpu_graph": False}, "recorder"),
    ],
)
def test_fake_xpu_route(registry: None, monkeypatch: pytest.MonkeyPatch, kw: dict, route: str) -> None:
    fake = FakeXpuModule(**kw)
    fake.install_into_torch(monkeypatch)
    r = doctor.collect()
    x = r["xpu"]
    assert x["available"] and x["route"] == route
    if route == "recorder":
        assert x["explanation"].startswith("recorder fallback:")
        assert not by_name(r)["xpu"]["usable"]
    else:
        assert "native XPU graphs" in x["explanation"] and by_name(r)["xpu"]["usable"]
    assert f"route: {route}" in doctor.format_report(r)


def test_plugin_state_is_reported(registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from accel_graph.allocator.core import device_plugin as plugin

    p = doctor.collect()["allocator"]["plugin"]
    assert p["core_built"] and p["library"] == plugin.library_path()
    assert p["process_allocator"] is False
    if not p["abi_symbols"]:  # today's engine: the missing symbols are named
        assert plugin.ALLOC_SYMBOL in p["missing_symbols"] and not p["usable"]
    monkeypatch.setattr(plugin, "_process", object())  # pretend the swap happened
    r = doctor.collect()
    assert r["allocator"]["plugin"]["process_allocator"] is True
    assert "process swap  active (captures on cuda/hip refused)" in doctor.format_report(r)


def test_native_control_flow_lines_say_build_or_host(registry: None) -> None:
    """``native_control_flow`` reads the build's modules; the text says "captured natively" only
    where the backend is usable here, and "build supports ...; no usable ... device here" on a
    build without a device (pip's CUDA build on a GPU-less host), never the former there."""
    r = doctor.collect()
    r["graph_apis"]["native_control_flow"] = {
        "cuda": {"cond": None, "while_loop": None, "switch": "no switch nodes in this build"}}
    cuda = by_name(r)["cuda"]
    cuda["usable"] = False
    text = doctor.format_report(r)
    assert "cuda cond        build supports native capture; no usable cuda device here" in text
    assert "cuda while_loop  build supports native capture; no usable cuda device here" in text
    assert "cuda switch      refused at capture: no switch nodes in this build" in text
    assert "captured natively" not in text
    cuda["usable"] = True
    text = doctor.format_report(r)
    assert "cuda cond        captured natively" in text and "no usable cuda device" not in text
    real = doctor.format_report(doctor.collect())
    if not torch.cuda.is_available():  # this machine (either torch build): nothing claims a GPU
        assert "captured natively" not in real
