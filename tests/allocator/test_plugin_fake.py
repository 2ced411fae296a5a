"""The device allocator plug-in against FAKE torch pieces: plumbing only.

Nothing here allocates device memory or verifies GPU behaviour. The fakes stand in for
``torch.cuda.memory.CUDAPluggableAllocator``, ``torch.cuda.MemPool``,
``torch.cuda.memory.change_current_allocator`` and ``torch.cuda.is_initialized``, and for the C
core's plug-in control functions (which the engine does not export yet); the engines under them
are real, on the *host* upstream. What is real: loading shared objects with ctypes and checking
their exported symbols (a tiny .so is compiled for that), settings resolution, the error texts,
the statistics and traces read from real engines, and the capture guard through
``accel_graph.Graph`` on the FAKE torch.cuda of tests/backends/fakes.py. Hardware checks are in
tools/device_check.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accel_graph
from accel_graph import BackendUnavailable, CaptureError, ConfigError
from accel_graph.allocator.core import device_plugin as plugin
from accel_graph.allocator.core.loader import load_core
from accel_graph.allocator.core.settings import EngineSettings
from accel_graph.backends import register_backend, registered_backends, unregister_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for backends.fakes
from backends.fakes import FakeCudaModule  # noqa: E402

MIB = 1 << 20


# -- FAKES ---------------------------------------------------------------------------------------
class FakeControlLib:
    """FAKE plug-in control functions over the real cffi lib (plumbing only): binds engines per
    device in a dict, as the C side's table would."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.bound: dict[int, Any] = {}
        self.threadsafe: list[Any] = []
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def ag_engine_set_threadsafe(self, e: Any, on: int) -> int:
        self.threadsafe.append(e)
        return 0

    def ag_pluggable_install(self, device: int, e: Any) -> int:
        self.calls.append(("install", device))
        if device in self.bound:
            return self._real.AG_ERR_STATE
        self.bound[device] = e
        return 0

    def ag_pluggable_uninstall(self, device: int) -> int:
        self.calls.append(("uninstall", device))
        self.bound.pop(device, None)
        return 0

    def ag_pluggable_errors(self, device: int) -> int:
        return 0

    def ag_pluggable_last_error(self, device: int) -> Any:
        return load_core().ffi.NULL


class FakeCore:
    """FAKE core module: the real ffi and __file__, the FAKE control lib."""

    def __init__(self, path: str) -> None:
        real = load_core()
        self.ffi = real.ffi
        self.lib = FakeControlLib(real.lib)
        self.__file__ = path


class FakePluggableAllocator:
    """FAKE torch.cuda.memory.CUDAPluggableAllocator: loads the .so and looks the symbols up
    with ctypes exactly as torch 2.13 does, then hands out an opaque handle."""

    made: list[FakePluggableAllocator] = []

    def __init__(self, path: str, alloc_fn_name: str, free_fn_name: str) -> None:
        lib = ctypes.CDLL(path)
        self.addrs = (
            ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value,
            ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value,
        )
        self.args = (path, alloc_fn_name, free_fn_name)
        self.handle = object()
        FakePluggableAllocator.made.append(self)

    def allocator(self) -> object:
        return self.handle


class FakeMemPool:
    """FAKE torch.cuda.MemPool (2.13 signature): records what it was given."""

    def __init__(self, allocator: object = None, use_on_oom: bool = False, no_split: bool = False) -> None:
        self.allocator, self.use_on_oom, self.no_split = allocator, use_on_oom, no_split
        self.id = (0, 7)


class FakeTorchCuda:
    """FAKE is_initialized / change_current_allocator state."""

    def __init__(self) -> None:
        self.initialized = False
        self.swapped: list[object] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def change_current_allocator(self, allocator: Any) -> None:
        if self.initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        self.swapped.append(allocator)


def _compile_so(tmp_path: Path, name: str, body: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(body)
    out = tmp_path / f"{name}.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the test library")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=60)
    return out


ABI_SOURCE = """
#include <stddef.h>
void *ag_pluggable_alloc(size_t size, int device, void *stream) { return NULL; }
void ag_pluggable_free(void *ptr, size_t size, int device, void *stream) {}
"""


@pytest.fixture(scope="module")
def abi_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real shared object exporting the two CUDAPluggableAllocator symbols (no-op bodies)."""
    return _compile_so(tmp_path_factory.mktemp("abi"), "abi", ABI_SOURCE)


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch, abi_so: Path) -> FakeTorchCuda:
    """FAKE torch allocator pieces + FAKE C control functions; registry restored afterwards."""
    state = FakeTorchCuda()
    core = FakeCore(str(abi_so))
    monkeypatch.setattr(plugin, "load_core", lambda: core)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", state.change_current_allocator)
    monkeypatch.setattr(torch.cuda, "MemPool", FakeMemPool, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", state.is_initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("ACCEL_GRAPH_BACKEND", raising=False)
    before = registered_backends()
    state.core = core  # type: ignore[attr-defined]
    yield state
    proc = plugin.process_allocator()
    plugin._reset_for_tests()
    for alloc in list(plugin._live):
        if alloc is not proc:
            alloc.close()
    plugin._live.clear()
    for name in registered_backends():
        if name not in before:
            unregister_backend(name)
    for cls in before.values():
        register_backend(cls)


def make(**kw: Any) -> plugin.DeviceAllocator:
    kw.setdefault("upstream", "host")  # plumbing: real engines on host memory, no device
    return plugin.DeviceAllocator(**kw)


# -- the library ---------------------------------------------------------------------------------
def test_check_library_real_core_names_path_and_missing_symbols() -> None:
    path = plugin.library_path()
    assert path == load_core().__file__ and Path(path).exists()
    lib = ctypes.CDLL(path)
    if hasattr(lib, plugin.ALLOC_SYMBOL) and hasattr(lib, plugin.FREE_SYMBOL):
        assert plugin.check_library() == path  # the engine exports the ABI now
        return
    with pytest.raises(BackendUnavailable) as info:
        plugin.check_library()
    msg = str(info.value)
    assert path in msg and plugin.ALLOC_SYMBOL in msg and "pip install" in msg


def test_check_library_accepts_a_library_with_the_abi(abi_so: Path) -> None:
    assert plugin.check_library(str(abi_so)) == str(abi_so)


def test_check_library_missing_file_and_unloadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.so"
    with pytest.raises(BackendUnavailable, match="does not exist"):
        plugin.check_library(str(missing))
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    with pytest.raises(BackendUnavailable) as info:
        plugin.check_library(str(junk))
    assert str(junk) in str(info.value) and "ctypes.CDLL" in str(info.value)


def test_check_library_names_each_missing_symbol(tmp_path: Path) -> None:
    half = _compile_so(tmp_path, "half", "#include <stddef.h>\nvoid *ag_pluggable_alloc(size_t s, int d, void *st) { return 0; }\n")
    with pytest.raises(BackendUnavailable) as info:
        plugin.check_library(str(half))
    assert plugin.FREE_SYMBOL in str(info.value) and plugin.ALLOC_SYMBOL + "," not in str(info.value)


def test_missing_control_functions_are_named(monkeypatch: pytest.MonkeyPatch, abi_so: Path) -> None:
    real = load_core()

    class Bare:
        ffi, lib, __file__ = real.ffi, real.lib, str(abi_so)

    monkeypatch.setattr(plugin, "load_core", lambda: Bare)
    if all(hasattr(real.lib, s) for s in plugin.CONTROL_SYMBOLS):
        pytest.skip("the core exports the control functions now")
    with pytest.raises(BackendUnavailable, match="ag_pluggable_install"):
        plugin.DeviceAllocator(upstream="host", devices=[0])


# -- settings ------------------------------------------------------------------------------------
def test_settings_from_environment_string_and_objects(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    a = make(devices=[0])
    assert a.settings.max_split_size == 64 * MIB and a.settings.device_kind == "cuda"
    b = make(settings="roundup_power2_divisions:4", devices=[1])
    assert b.settings.divisions() == (4,) * 16
    a.close()
    c = make(settings=EngineSettings(max_split_size=40 * MIB), devices=[0])
    assert c.settings.max_split_size == 40 * MIB and c.settings.device_kind == "cuda"
    with pytest.raises(ConfigError):
        make(settings=12, devices=[0])
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        make(settings="max_split_size_mb:abc", devices=[0])


def test_expandable_segments_are_turned_off_with_a_warning(fake_torch: FakeTorchCuda) -> None:
    with pytest.warns(RuntimeWarning, match="expandable_segments is ignored"):
        a = make(settings="expandable_segments:True", devices=[0])
    assert a.settings.expandable_segments is False


def test_hip_build_uses_hip_device_kind(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "7.0.51831-7c9236b16")
    a = make(devices=[0])
    assert a.kind == "hip" and a.settings.device_kind == "hip"
    assert a.engine(0).device_name == "HIP"


# -- binding, MemPool route ------------------------------------------------------------------------
def test_one_engine_per_device_bound_and_threadsafe(fake_torch: FakeTorchCuda) -> None:
    a = make()
    lib = fake_torch.core.lib  # type: ignore[attr-defined]
    assert a.devices == (0, 1) and set(lib.bound) == {0, 1}
    assert len(lib.threadsafe) == 2
    assert lib.bound[1] is a.engine(1).c_handle
    with pytest.raises(ConfigError, match="serves devices 0, 1"):
        a.engine(5)
    a.close()
    assert lib.bound == {} and ("uninstall", 0) in lib.calls


def test_failed_binding_unbinds_what_was_bound(fake_torch: FakeTorchCuda) -> None:
    lib = fake_torch.core.lib  # type: ignore[attr-defined]
    lib.bound[1] = object()  # device 1 already taken by someone else
    with pytest.raises(plugin.AllocatorStateError, match="cuda:1 is already served"):
        make()
    assert 0 not in lib.bound and ("uninstall", 0) in lib.calls


def test_no_devices_is_refused(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(BackendUnavailable, match="CUDA_VISIBLE_DEVICES"):
        make()


def test_mem_pool_passes_our_library_and_symbols_to_torch(fake_torch: FakeTorchCuda, abi_so: Path) -> None:
    a = make(devices=[0])
    pool = a.mem_pool(use_on_oom=True)
    assert isinstance(pool, FakeMemPool) and pool.use_on_oom
    made = FakePluggableAllocator.made[-1]
    assert made.args == (str(abi_so), "ag_pluggable_alloc", "ag_pluggable_free")
    assert all(made.addrs) and pool.allocator is made.handle
    assert a.mem_pool().allocator is made.handle  # one CUDAPluggableAllocator per DeviceAllocator
    with pytest.raises(ConfigError, match="does not accept"):
        a.mem_pool(bogus=1)
    assert fake_torch.swapped == []  # the MemPool route never swaps the process allocator


def test_mem_pool_on_torch_without_mempool(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.cuda, "MemPool")
    with pytest.raises(BackendUnavailable, match="no torch.cuda.MemPool"):
        make(devices=[0]).mem_pool()


def test_torch_without_pluggable_allocator(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.cuda.memory, "CUDAPluggableAllocator")
    with pytest.raises(BackendUnavailable, match="CUDA or ROCm build"):
        _ = make(devices=[0]).torch_allocator


# -- whole-process route -----------------------------------------------------------------------------
def test_swap_before_cuda_initialises(fake_torch: FakeTorchCuda) -> None:
    a = plugin.install_process_allocator(upstream="host", devices=[0])
    assert plugin.process_allocator() is a and fake_torch.swapped == [a.torch_allocator]
    assert plugin.install_process_allocator() is a  # idempotent
    with pytest.raises(plugin.AllocatorStateError, match="already the whole-process allocator"):
        plugin.install_process_allocator(make(devices=[1]))
    with pytest.raises(plugin.AllocatorStateError, match="lives until the process exits"):
        a.close()


def test_swap_after_cuda_initialised_is_refused_with_what_to_do(fake_torch: FakeTorchCuda) -> None:
    fake_torch.initialized = True
    with pytest.raises(plugin.AllocatorStateError) as info:
        plugin.install_process_allocator(upstream="host", devices=[0])
    msg = str(info.value)
    assert "already initialised" in msg and "mem_pool()" in msg and "first thing" in msg
    assert isinstance(info.value, accel_graph.AccelGraphError)
    assert plugin.process_allocator() is None and fake_torch.swapped == []


def test_swap_refused_by_torch_is_translated(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(allocator: object) -> None:
        raise RuntimeError("Can't swap an already initialized allocator")

    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", refuse)
    with pytest.raises(plugin.AllocatorStateError, match="torch refused the swap"):
        plugin.install_process_allocator(upstream="host", devices=[0])
    assert plugin.process_allocator() is None


def test_our_stats_and_traces_after_a_swap(fake_torch: FakeTorchCuda) -> None:
    a = plugin.install_process_allocator(upstream="host", devices=[0])
    a.enable_history()
    eng = a.engine(0)
    ptr = eng.malloc(3 * MIB)  # what ag_pluggable_alloc would do for torch
    eng.free(ptr)
    stats = plugin.memory_stats(0)
    assert stats["allocation.all.allocated"] == 1 and stats["segment.all.current"] == 1
    assert stats["accel.pluggable_errors"] == 0 and a.last_error(0) == ""
    snap = a.snapshot()
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed"]
    assert snap["segments"][0]["total_size"] == 20 * MIB
    assert all(set(e) >= {"addr", "size", "stream", "time_us", "frames"} for e in snap["device_traces"][0])
    a.empty_cache()
    assert plugin.memory_stats(0)["segment.all.current"] == 0


def test_memory_stats_falls_through_to_torch_without_a_swap(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"from": "torch"})
    assert plugin.memory_stats(0) == {"from": "torch"}


# -- capture under the swap ----------------------------------------------------------------------------
def test_capture_is_refused_under_the_swap_on_fake_cuda(fake_torch: FakeTorchCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaModule()
    fake.install_into_torch(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", fake.is_initialized)
    for name in ("cuda", "hip"):  # built-ins, fresh instances on the FAKE torch.cuda
        register_backend(registered_backends()[name])
    plugin.install_process_allocator(upstream="host", devices=[0])
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError) as info:
        with accel_graph.graph(g):
            pass
    msg = str(info.value)
    assert "C++-only" in msg and "mem_pool()" in msg and "cuda:0" in msg
    assert g.state == "empty" and fake.graphs == []  # refused before torch was touched
    assert not any(c[0] == "synchronize" for c in fake.calls)
    with pytest.raises(CaptureError, match="whole-process CUDA allocator"):
        g.capture_begin()
    assert g.state == "empty"


def test_capture_guard_ignores_other_devices(fake_torch: FakeTorchCuda) -> None:
    plugin.install_process_allocator(upstream="host", devices=[0])
    plugin.check_capture_allowed(torch.device("cpu"))
    plugin.check_capture_allowed("xpu:0")
    with pytest.raises(CaptureError):
        plugin.check_capture_allowed(torch.device("cuda", 0))
    g = accel_graph.Graph(device="cpu")  # the recorder is unaffected
    with accel_graph.graph(g):
        torch.ones(2).add_(1)
    g.replay()


def test_no_guard_without_a_swap(fake_torch: FakeTorchCuda) -> None:
    plugin.check_capture_allowed(torch.device("cuda", 0))  # raises only under a swap


def test_library_must_be_the_imported_core(fake_torch: FakeTorchCuda, abi_so: Path, tmp_path: Path) -> None:
    a = make(devices=[0], library=abi_so)  # the (FAKE) core's own file: accepted
    assert a.library == str(abi_so)
    a.close()
    other = _compile_so(tmp_path, "other", ABI_SOURCE)
    with pytest.raises(ConfigError, match="not the allocator core"):
        make(devices=[0], library=other)
    with pytest.raises(BackendUnavailable, match="does not exist"):
        make(devices=[0], library=tmp_path / "missing.so")
