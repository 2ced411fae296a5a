"""The C plug-in entry points (``ag_pluggable_*``) of the allocator core, called as torch would.

torch's ``CUDAPluggableAllocator`` loads the core with ``ctypes.CDLL`` and calls
``ag_pluggable_alloc(size_t, int, cudaStream_t)`` / ``ag_pluggable_free(void*, size_t, int,
cudaStream_t)`` from any thread; so do these tests (ctypes releases the GIL). The engines under
them are real, on the *device* upstream, over a stand-in CUDA runtime compiled with ``cc`` (host
malloc behind cudaMalloc, a per-thread current device and capture mode, and a switch that makes a
stream "capturing"). Nothing here runs on a GPU: real CUDA/HIP behaviour is tools/device_check.py's.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from accel_graph import AccelGraphError
from accel_graph.allocator.core import device_plugin as plugin
from accel_graph.allocator.core.engine import Engine
from accel_graph.allocator.core.loader import load_core
from accel_graph.allocator.core.settings import EngineSettings

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="needs a C compiler for the fake runtime"
)

# A stand-in libcudart: everything the device upstream and the plug-in resolve with dlsym.
_FAKE_RUNTIME = r"""
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static size_t used, total = 192u << 20;
static __thread int cur_dev, mode, sticky;
static void *capturing;
long n_malloc, n_free, n_free_capturing, n_set_device;
int malloc_dev = -1, malloc_mode = -1;

int cudaMalloc(void **p, size_t n) {
    pthread_mutex_lock(&mu);
    if (used + n > total) { pthread_mutex_unlock(&mu); sticky = 2; return 2; }
    used += n; n_malloc++; malloc_dev = cur_dev; malloc_mode = mode;
    pthread_mutex_unlock(&mu);
    size_t *h = malloc(n + 16);
    if (!h) return 2;
    h[0] = n;
    *p = (char *)h + 16;
    return 0;
}
int cudaFree(void *p) {
    size_t *h = (size_t *)((char *)p - 16);
    pthread_mutex_lock(&mu);
    used -= h[0]; n_free++; if (capturing) n_free_capturing++;
    pthread_mutex_unlock(&mu);
    free(h);
    return 0;
}
int cudaMemGetInfo(size_t *fr, size_t *tot) { *fr = total - used; *tot = total; return 0; }
int cudaGetDevice(int *d) { *d = cur_dev; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d > 7) return 101; cur_dev = d; n_set_device++; return 0; }
int cudaThreadExchangeStreamCaptureMode(int *m) { int old = mode; mode = *m; *m = old; return 0; }
int cudaStreamIsCapturing(void *s, int *status) { *status = (s && s == capturing) ? 1 : 0; return 0; }
int cudaGetLastError(void) { int r = sticky; sticky = 0; return r; }
/* test controls */
void fake_set_capturing(void *s) { capturing = s; }
int fake_mode(void) { return mode; }
int fake_sticky(void) { return sticky; }
size_t fake_used(void) { return used; }
"""


@pytest.fixture(scope="module")
def fake_rt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    d = tmp_path_factory.mktemp("fakecudart")
    src, lib = d / "fake.c", d / "libfakecudart.so"
    src.write_text(_FAKE_RUNTIME)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", str(src), "-o", str(lib), "-lpthread"],
        check=True,
        timeout=120,
    )
    rt = ctypes.CDLL(str(lib))  # the same copy the engine dlopens: one set of globals
    rt.fake_set_capturing.argtypes = [ctypes.c_void_p]
    rt.fake_used.restype = ctypes.c_size_t
    return str(lib), rt


def _counter(rt: ctypes.CDLL, name: str) -> int:
    return ctypes.c_long.in_dll(rt, name).value


def _int(rt: ctypes.CDLL, name: str) -> int:
    return ctypes.c_int.in_dll(rt, name).value


@pytest.fixture(scope="module")
def abi() -> ctypes.CDLL:
    """The core loaded exactly as torch loads it, with the ABI's argument types."""
    path = plugin.library_path()
    lib = ctypes.CDLL(path)
    lib.ag_pluggable_alloc.restype = ctypes.c_void_p
    lib.ag_pluggable_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.ag_pluggable_free.restype = None
    lib.ag_pluggable_free.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    return lib


@pytest.fixture
def clib() -> Any:
    return load_core().lib


def _device_engine(lib_path: str, **kw: Any) -> Engine:
    return Engine(upstream="device", settings=EngineSettings(device_libs=(lib_path,), **kw))


@pytest.fixture
def installed(fake_rt: tuple[str, ctypes.CDLL], clib: Any) -> Iterator[Engine]:
    """A device-upstream engine installed on device 0; unbound and closed afterwards."""
    eng = _device_engine(fake_rt[0])
    assert clib.ag_engine_set_threadsafe(eng.c_handle, 1) == 0
    assert clib.ag_pluggable_install(0, eng.c_handle) == 0
    yield eng
    fake_rt[1].fake_set_capturing(None)
    clib.ag_pluggable_uninstall(0)  # may refuse after a failed test; close() unbinds anyway
    eng.close()


def _last_error(clib: Any, device: int) -> str:
    ffi = load_core().ffi
    p = clib.ag_pluggable_last_error(device)
    return "" if p == ffi.NULL else ffi.string(p).decode()


def _stream(i: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(0x7000 + 0x10 * i)  # distinct fake cudaStream_t values


# -- the exported ABI ----------------------------------------------------------------------------
def test_core_exports_the_abi_and_control_symbols() -> None:
    path = plugin.library_path()
    lib = ctypes.CDLL(path)
    assert hasattr(lib, plugin.ALLOC_SYMBOL) and hasattr(lib, plugin.FREE_SYMBOL)
    assert plugin.check_library(path) == path
    core = load_core()
    assert all(hasattr(core.lib, s) for s in plugin.CONTROL_SYMBOLS)
    assert plugin.control_functions(core) is core.lib


def test_doctor_reports_the_plugin_symbols_present() -> None:
    from accel_graph.cli import doctor_sections

    st = doctor_sections.plugin_status()
    assert st["core_built"] and st["abi_symbols"] and st["control_symbols"]
    assert st["missing_symbols"] == []


# -- alloc / free --------------------------------------------------------------------------------
def test_alloc_free_roundtrip_null_stream_and_size_zero(
    installed: Engine, abi: ctypes.CDLL, clib: Any, check_engine: Any
) -> None:
    p = abi.ag_pluggable_alloc(4096, 0, None)
    assert p
    ctypes.memset(p, 7, 4096)  # real memory behind the fake cudaMalloc
    assert installed.block_size(p) >= 4096
    [seg] = installed.layout()
    assert seg["blocks"][0]["stream"] == 0  # NULL stream -> engine stream 0
    abi.ag_pluggable_free(p, 4096, 0, None)
    assert installed.memory_stats()["allocation.all.current"] == 0
    assert abi.ag_pluggable_alloc(0, 0, None) is None  # 0 bytes: NULL, not an error
    abi.ag_pluggable_free(None, 0, 0, None)  # no-op
    assert clib.ag_pluggable_errors(0) == 0
    assert _last_error(clib, 0) == ""
    check_engine(installed)


def test_each_stream_gets_its_own_id_and_cache(
    installed: Engine, abi: ctypes.CDLL, clib: Any
) -> None:
    a, b = _stream(1), _stream(2)
    pa = abi.ag_pluggable_alloc(1000, 0, a)
    pb = abi.ag_pluggable_alloc(1000, 0, b)
    p0 = abi.ag_pluggable_alloc(1000, 0, None)
    streams = {blk["address"]: blk["stream"] for seg in installed.layout() for blk in seg["blocks"]}
    assert (streams[pa], streams[pb], streams[p0]) == (1, 2, 0)
    assert installed.num_streams == 3
    abi.ag_pluggable_free(pa, 1000, 0, a)
    # the same stream value maps to the same id: the cached block comes back
    assert abi.ag_pluggable_alloc(1000, 0, a) == pa
    for p in (pa, pb, p0):
        abi.ag_pluggable_free(p, 1000, 0, None)  # free ignores size and stream
    assert clib.ag_pluggable_errors(0) == 0
    assert installed.num_streams == 3


def test_past_64_streams_alloc_fails_and_is_counted(
    installed: Engine, abi: ctypes.CDLL, clib: Any
) -> None:
    ptrs = [abi.ag_pluggable_alloc(512, 0, _stream(i)) for i in range(1, 64)]  # 63 + stream 0
    assert all(ptrs) and installed.num_streams == 64
    assert abi.ag_pluggable_alloc(512, 0, _stream(64)) is None
    assert clib.ag_pluggable_errors(0) == 1
    assert "at most 64 streams" in _last_error(clib, 0)
    again = abi.ag_pluggable_alloc(512, 0, _stream(5))  # known streams still work
    assert again
    for p in [*ptrs, again]:
        abi.ag_pluggable_free(p, 512, 0, None)
    assert clib.ag_pluggable_errors(0) == 1


def test_unknown_and_double_frees_are_counted_not_fatal(
    installed: Engine, abi: ctypes.CDLL, clib: Any
) -> None:
    p = abi.ag_pluggable_alloc(2048, 0, None)
    abi.ag_pluggable_free(0xDEAD000, 2048, 0, None)
    assert clib.ag_pluggable_errors(0) == 1
    assert "not an allocated block" in _last_error(clib, 0)
    abi.ag_pluggable_free(p, 2048, 0, None)
    abi.ag_pluggable_free(p, 2048, 0, None)  # double free
    assert clib.ag_pluggable_errors(0) == 2
    abi.ag_pluggable_free(p, 2048, 5, None)  # a device with no engine
    assert clib.ag_pluggable_errors(5) == 1
    assert "no engine is installed for device 5" in _last_error(clib, 5)
    assert abi.ag_pluggable_alloc(64, 5, None) is None
    assert clib.ag_pluggable_errors(5) == 2
    assert installed.memory_stats()["allocation.all.current"] == 0


def test_oom_returns_null_and_clears_the_sticky_runtime_error(
    installed: Engine, abi: ctypes.CDLL, clib: Any, fake_rt: Any
) -> None:
    rt = fake_rt[1]
    assert abi.ag_pluggable_alloc(300 * MIB, 0, None) is None  # the fake device has 192 MiB
    assert clib.ag_pluggable_errors(0) == 1
    assert "out of memory" in _last_error(clib, 0)
    assert rt.fake_sticky() == 0  # cudaGetLastError was called, as torch does
    p = abi.ag_pluggable_alloc(MIB, 0, None)  # still usable
    assert p
    abi.ag_pluggable_free(p, MIB, 0, None)


def test_current_device_and_capture_mode_around_cudamalloc(
    fake_rt: Any, abi: ctypes.CDLL, clib: Any
) -> None:
    path, rt = fake_rt
    eng = _device_engine(path)
    try:
        assert clib.ag_pluggable_install(3, eng.c_handle) == 0
        assert rt.cudaSetDevice(1) == 0  # this thread's current device is 1
        before = _counter(rt, "n_set_device")
        p = abi.ag_pluggable_alloc(4096, 3, None)
        assert p
        assert _int(rt, "malloc_dev") == 3  # cudaMalloc ran on device 3
        assert _int(rt, "malloc_mode") == 2  # in relaxed capture mode
        dev = ctypes.c_int(-1)
        rt.cudaGetDevice(ctypes.byref(dev))
        assert dev.value == 1 and rt.fake_mode() == 0  # both restored
        assert _counter(rt, "n_set_device") == before + 2
        rt.cudaSetDevice(3)  # already current: no switching at all
        before = _counter(rt, "n_set_device")
        q = abi.ag_pluggable_alloc(30 * MIB, 3, None)
        assert q and _counter(rt, "n_set_device") == before
        abi.ag_pluggable_free(p, 0, 3, None)
        abi.ag_pluggable_free(q, 0, 3, None)
        rt.cudaSetDevice(0)
        assert clib.ag_pluggable_errors(3) == 0
        assert clib.ag_pluggable_uninstall(3) == 0
    finally:
        eng.close()


def test_no_cudafree_while_the_stream_captures(
    installed: Engine, abi: ctypes.CDLL, clib: Any, fake_rt: Any
) -> None:
    rt = fake_rt[1]
    s1, s2 = _stream(1), _stream(2)
    p = abi.ag_pluggable_alloc(100 * MIB, 0, s1)
    abi.ag_pluggable_free(p, 0, 0, s1)  # cached on s1: 100 of the 192 MiB stay reserved
    frees = _counter(rt, "n_free")
    rt.fake_set_capturing(s2)
    # s2 cannot use s1's block; cudaMalloc fails; the release-and-retry step is skipped
    assert abi.ag_pluggable_alloc(100 * MIB, 0, s2) is None
    assert _counter(rt, "n_free") == frees and _counter(rt, "n_free_capturing") == 0
    assert clib.ag_pluggable_errors(0) == 1
    small = abi.ag_pluggable_alloc(MIB, 0, s2)  # what fits still works during capture
    assert small
    rt.fake_set_capturing(None)
    q = abi.ag_pluggable_alloc(100 * MIB, 0, s2)  # not capturing: cache released, retried
    assert q and _counter(rt, "n_free") == frees + 1
    abi.ag_pluggable_free(q, 0, 0, None)
    abi.ag_pluggable_free(small, 0, 0, None)


# -- install / uninstall -------------------------------------------------------------------------
def test_install_rules(installed: Engine, fake_rt: Any, clib: Any, abi: ctypes.CDLL) -> None:
    other = _device_engine(fake_rt[0])
    host = Engine(upstream="host")
    try:
        assert clib.ag_pluggable_install(0, installed.c_handle) == 0  # same engine again: fine
        assert clib.ag_pluggable_install(0, other.c_handle) == clib.AG_ERR_STATE
        assert "already served" in _last_error_of(other)
        assert clib.ag_pluggable_install(1, installed.c_handle) == clib.AG_ERR_STATE  # one device each
        assert clib.ag_pluggable_install(-1, other.c_handle) == clib.AG_ERR_INVALID
        assert clib.ag_pluggable_install(64, other.c_handle) == clib.AG_ERR_INVALID
        assert clib.ag_pluggable_install(1, host.c_handle) == clib.AG_ERR_INVALID
        assert "device upstream" in _last_error_of(host)
        assert clib.ag_pluggable_uninstall(99) == clib.AG_ERR_INVALID
        assert clib.ag_pluggable_uninstall(1) == 0  # nothing bound: nothing to do
        assert clib.ag_pluggable_errors(-1) == clib.AG_ERR_INVALID
        assert clib.ag_pluggable_last_error(64) == load_core().ffi.NULL
        assert clib.ag_engine_set_threadsafe(load_core().ffi.NULL, 1) == clib.AG_ERR_INVALID
        assert clib.ag_engine_set_threadsafe(other.c_handle, 0) == 0
    finally:
        other.close()
        host.close()


def _last_error_of(eng: Engine) -> str:
    return eng.last_error()


def test_uninstall_refused_while_blocks_live(
    installed: Engine, abi: ctypes.CDLL, clib: Any
) -> None:
    p = abi.ag_pluggable_alloc(8192, 0, _stream(3))
    assert clib.ag_pluggable_uninstall(0) == clib.AG_ERR_STATE
    assert "still allocated" in installed.last_error()
    assert abi.ag_pluggable_alloc(64, 0, None)  # still bound and serving
    abi.ag_pluggable_free(p, 0, 0, None)
    assert clib.ag_pluggable_uninstall(0) == clib.AG_ERR_STATE  # the 64-byte block
    installed.empty_cache()
    [blk] = [b for s in installed.layout() for b in s["blocks"] if b["state"] == "active_allocated"]
    abi.ag_pluggable_free(blk["address"], 0, 0, None)
    assert clib.ag_pluggable_uninstall(0) == 0
    assert abi.ag_pluggable_alloc(64, 0, None) is None  # unbound: refused and counted
    assert "no engine is installed" in _last_error(clib, 0)
    # a fresh install resets the device's counters
    assert clib.ag_pluggable_install(0, installed.c_handle) == 0
    assert clib.ag_pluggable_errors(0) == 0 and _last_error(clib, 0) == ""


def test_closing_a_bound_engine_unbinds_it(fake_rt: Any, abi: ctypes.CDLL, clib: Any) -> None:
    eng = _device_engine(fake_rt[0])
    assert clib.ag_pluggable_install(2, eng.c_handle) == 0
    p = abi.ag_pluggable_alloc(4096, 2, None)
    assert p
    eng.close()  # destroys the engine (its segments go back) and clears the binding
    abi.ag_pluggable_free(p, 0, 2, None)  # counted, never touches freed metadata
    assert clib.ag_pluggable_errors(2) == 1
    fresh = _device_engine(fake_rt[0])
    try:
        assert clib.ag_pluggable_install(2, fresh.c_handle) == 0
        assert clib.ag_pluggable_uninstall(2) == 0
    finally:
        fresh.close()


# -- threads ---------------------------------------------------------------------------------------
def test_threads_alloc_and_free_concurrently(
    installed: Engine, abi: ctypes.CDLL, clib: Any, check_engine: Any
) -> None:
    """ctypes drops the GIL, so these calls really overlap; the C locks serialise them."""
    failures: list[str] = []
    start = threading.Barrier(6)

    def worker(k: int) -> None:
        stream = None if k == 0 else _stream(10 + k % 3)  # streams shared between threads too
        live: list[int] = []
        start.wait()
        for i in range(1500):
            p = abi.ag_pluggable_alloc(512 * (1 + (i * 7 + k) % 13), 0, stream)
            if not p:
                failures.append(f"thread {k}: alloc {i} failed")
                return
            live.append(p)
            if len(live) > 4:
                abi.ag_pluggable_free(live.pop(0), 0, 0, stream)
        for p in live:
            abi.ag_pluggable_free(p, 0, 0, stream)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    assert failures == []
    assert clib.ag_pluggable_errors(0) == 0
    assert installed.num_streams == 4  # stream 0 + three distinct stream values, never shared
    assert installed.memory_stats()["allocation.all.current"] == 0
    check_engine(installed)


# -- through plugin.DeviceAllocator, with the real control functions -----------------------------
def test_device_allocator_binds_through_the_real_core(fake_rt: Any, abi: ctypes.CDLL) -> None:
    a = plugin.DeviceAllocator(EngineSettings(device_libs=(fake_rt[0],)), devices=[0])
    try:
        p = abi.ag_pluggable_alloc(4096, 0, None)
        assert p and a.engine(0).block_size(p) >= 4096
        abi.ag_pluggable_free(0x1234000, 0, 0, None)
        assert a.memory_stats(0)["accel.pluggable_errors"] == 1
        assert "not an allocated block" in a.last_error(0)
        with pytest.raises(plugin.AllocatorStateError):
            plugin.DeviceAllocator(EngineSettings(device_libs=(fake_rt[0],)), devices=[0])
        with pytest.raises(AccelGraphError, match="still allocated"):
            a.close()
        abi.ag_pluggable_free(p, 0, 0, None)
    finally:
        a.close()
    assert a not in plugin._live and not a.engines
