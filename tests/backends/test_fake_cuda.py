"""cuda and hip backends against a FAKE torch.cuda: routing and argument plumbing only.

Nothing here runs on a GPU or verifies GPU behaviour; the fakes (tests/backends/fakes.py) only
record which torch APIs the backends call and with what. Hardware checks live in
tools/device_check.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import accel_graph
from accel_graph import BackendUnavailable, CaptureError, PoolError
from accel_graph.backends import (
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
    unregister_backend,
)
from accel_graph.backends.base import DeviceSpec, PoolHandle
from accel_graph.backends.cuda import CudaBackend
from accel_graph.backends.hip import HipBackend

from .fakes import FakeCudaModule


def capture(g: accel_graph.Graph, fake: FakeCudaModule, *sizes: int, **kw: object) -> None:
    """Capture through the front end; each size is a pretend allocation inside the capture."""
    with accel_graph.graph(g, **kw):
        for n in sizes:
            fake.allocate(n)


def last_graph(fake: FakeCudaModule):  # noqa: ANN201
    return fake.graphs[-1]


# -- probes and routing -----------------------------------------------------------------------
def test_fake_cuda_build_with_no_device_routes_to_the_cpu_recorder(fake_cuda: FakeCudaModule) -> None:
    # FAKE: pip's CUDA build on a GPU-less host (the real one is in test_real_modules.py).
    fake_cuda.count, fake_cuda.available = 0, False
    assert CudaBackend.probe() == (
        "torch.cuda.is_available() is False (no NVIDIA driver or no visible device)"
    )
    backend, dev = select_backend(None)
    assert (backend.name, dev) == ("recorder", torch.device("cpu"))
    for explicit in ("cuda", "cuda:0", 0):
        with pytest.raises(BackendUnavailable, match=r"0 cuda devices \(build has CUDA 12.8.*Pass device='cpu'"):
            accel_graph.Graph(device=explicit)
    assert not fake_cuda.initialized  # counting initialised nothing


def test_fake_available_but_zero_devices_is_a_probe_reason(fake_cuda: FakeCudaModule) -> None:
    fake_cuda.count = 0  # is_available() True but nothing to count: the probe says so
    assert CudaBackend.probe() == (
        "torch.cuda.device_count() is 0 (no NVIDIA driver or no visible device)"
    )


def test_fake_default_route_uses_the_current_device_index(fake_cuda: FakeCudaModule) -> None:
    with fake_cuda.device(1):
        backend, dev = select_backend(None)
    assert backend.name == "cuda" and dev == torch.device("cuda", 1)


def test_fake_cuda_probe_passes_without_initialising(fake_cuda: FakeCudaModule) -> None:
    assert CudaBackend.probe() is None
    assert HipBackend.probe() == "torch.version.hip is None: this is not a ROCm build of torch"
    assert not fake_cuda.initialized and fake_cuda.calls == []


def test_fake_cuda_probe_unavailable(fake_cuda: FakeCudaModule) -> None:
    fake_cuda.available = False
    assert CudaBackend.probe() == (
        "torch.cuda.is_available() is False (no NVIDIA driver or no visible device)"
    )
    with pytest.raises(BackendUnavailable, match="0 cuda devices"):
        select_backend("cuda:0")  # is_available() False: no usable device, whatever the count


def test_fake_cuda_without_graph_class_leaves_the_device_to_the_recorder(
    fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.cuda, "CUDAGraph")
    assert CudaBackend.probe() == "torch.cuda.CUDAGraph is missing from this torch build"
    backend, dev = select_backend("cuda:0")
    assert backend.name == "recorder" and dev == torch.device("cuda:0")
    backend, dev = select_backend(None)  # the device exists: the recorder serves it there
    assert backend.name == "recorder" and dev == torch.device("cuda", 0)


def test_fake_rocm_build_routes_cuda_devices_to_hip(fake_rocm: FakeCudaModule) -> None:
    assert CudaBackend.probe() == (
        "this is a ROCm build (torch.version.hip='7.0.51831-7c9236b16'): use the hip backend"
    )
    assert HipBackend.probe() is None
    backend, dev = select_backend("cuda:1")
    assert backend.name == "hip" and dev == torch.device("cuda", 1)
    assert get_backend("rocm") is backend  # alias


def test_fake_routing_default_and_forced(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, dev = select_backend(None)
    assert backend.name == "cuda" and dev.type == "cuda"
    monkeypatch.setenv("ACCEL_GRAPH_BACKEND", "hip")
    with pytest.raises(BackendUnavailable, match="torch.version.hip is None"):
        select_backend("cuda:0")


def test_fake_missing_device_names_what_exists(fake_cuda: FakeCudaModule) -> None:
    with pytest.raises(BackendUnavailable, match=r"cuda:5 does not exist.*2 cuda device\(s\) \(cuda:0, cuda:1\)"):
        accel_graph.Graph(device="cuda:5")


# -- capture plumbing -------------------------------------------------------------------------
def test_fake_graph_context_prepares_and_uses_side_stream(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:1")
    assert g.backend.name == "cuda" and g.device.index == 1 and g.device_spec.arch == "sm_90"
    capture(g, fake_cuda, 1024)
    tg = last_graph(fake_cuda)
    begin = dict(tg.calls)["capture_begin"]
    assert begin["mode"] == "global"  # "default" -> torch.cuda's own default
    assert begin["pool"][0] == 0 and begin["pool"][1] > 0  # a torch user id, not ours
    assert tg._stream.device_index == 1 and tg._stream != fake_cuda.default_stream(1)
    names = [c[0] for c in fake_cuda.calls]
    assert names.index("synchronize") < names.index("empty_cache")
    assert g.state == "instantiated" and tg.instantiated
    g.replay()
    g.replay()
    assert fake_cuda.replays == 2
    assert g._impl.replay == tg.replay  # torch's bound method: no extra Python frame


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_fake_capture_modes_pass_through(fake_cuda: FakeCudaModule, mode: str) -> None:
    g = accel_graph.Graph(device="cuda:0", capture_error_mode=mode)
    capture(g, fake_cuda)
    assert dict(last_graph(fake_cuda).calls)["capture_begin"]["mode"] == mode


def test_fake_capture_on_default_stream_is_a_capture_error(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="non-default stream") as info:
        g.capture_begin()
    assert isinstance(info.value, RuntimeError)
    assert g.state == "empty" and get_backend("cuda").pools.held() == {}  # nothing leaked
    capture(g, fake_cuda)  # still usable
    assert g.state == "instantiated"


def test_fake_capture_on_the_wrong_current_device(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:1")
    with pytest.raises(CaptureError, match="current device is cuda:0"):
        g.capture_begin()


def test_fake_body_error_aborts_and_leaves_graph_reusable(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(ZeroDivisionError), accel_graph.graph(g):
        fake_cuda.allocate(10)
        1 / 0  # noqa: B018
    assert g.state == "empty" and fake_cuda.capturing is None
    assert "reset" in [c[0] for c in last_graph(fake_cuda).calls]
    capture(g, fake_cuda)
    assert g.state == "instantiated"


def test_fake_capture_end_failure_is_a_capture_error(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    fake_cuda.fail_next_capture_end = True
    with pytest.raises(CaptureError, match="previous error during capture"):
        capture(g, fake_cuda)
    assert g.state == "empty" and fake_cuda.capturing is None


def test_fake_keep_graph_instantiates_on_demand(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(keep_graph=True, device="cuda:0")
    capture(g, fake_cuda)
    tg = last_graph(fake_cuda)
    assert g.state == "captured" and not tg.instantiated
    g.replay()
    assert tg.instantiated and fake_cuda.replays == 1


def test_fake_reset_on_cuda_does_not_sync_but_hip_does(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    capture(g, fake_cuda)
    fake_cuda.synced_since_last_reset = False
    g.reset()
    assert last_graph(fake_cuda).calls[-1] == ("reset", False)


def test_fake_hip_reset_synchronizes_first(fake_rocm: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    assert g.backend.name == "hip" and g.device_spec.arch == "gfx942"
    with fake_rocm.stream(fake_rocm.Stream(device=0)):
        capture(g, fake_rocm)
    fake_rocm.synced_since_last_reset = False
    g.reset()
    assert last_graph(fake_rocm).calls[-1] == ("reset", True)  # quirk lazy-graph-exec-destroy


def test_fake_hip_captures_on_the_current_side_stream(fake_rocm: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    side = fake_rocm.Stream(device=0)
    with fake_rocm.stream(side):  # warm-up would run here; capture must use the same stream
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            capture(g, fake_rocm)
    assert last_graph(fake_rocm)._stream == side


def test_fake_hip_default_stream_warns_once(fake_rocm: FakeCudaModule) -> None:
    backend = get_backend("hip")
    with pytest.warns(UserWarning, match="warm-up on the same stream"):
        capture(accel_graph.Graph(device="cuda:0"), fake_rocm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(accel_graph.Graph(device="cuda:0"), fake_rocm)
    spec = backend.device_spec(torch.device("cuda:0"))
    assert last_graph(fake_rocm)._stream == backend.capture_stream(spec)
    assert {q.id for q in backend.quirks(spec)} >= {"warmup-same-stream", "replay-corruption-mi300x"}
    assert "expandable-segments-rocm7" not in {q.id for q in backend.quirks(spec)}  # ROCm 7.0


def test_fake_is_current_stream_capturing(fake_cuda: FakeCudaModule) -> None:
    spec = DeviceSpec("cuda", "cuda", 0, "sm_90")
    assert get_backend("cuda").is_current_stream_capturing(spec) is False
    assert not fake_cuda.initialized  # the backend answers without starting the runtime
    assert accel_graph.is_current_stream_capturing("cuda:0") is False
    g = accel_graph.Graph(device="cuda:0")
    seen = []
    with accel_graph.graph(g):
        seen.append(accel_graph.is_current_stream_capturing("cuda:0"))
    assert seen == [True] and accel_graph.is_current_stream_capturing("cuda:0") is False


def test_fake_debug_dump(fake_cuda: FakeCudaModule, tmp_path) -> None:  # noqa: ANN001
    g = accel_graph.Graph(device="cuda:0")
    g.enable_debug_mode()
    capture(g, fake_cuda)
    g.debug_dump(str(tmp_path / "g.dot"))
    assert ("enable_debug_mode", None) in last_graph(fake_cuda).calls
    assert (tmp_path / "g.dot").read_text().startswith("digraph fake")
    h = accel_graph.Graph(device="cuda:0")
    capture(h, fake_cuda)
    with pytest.warns(UserWarning, match="enable_debug_mode"):
        h.debug_dump(str(tmp_path / "h.dot"))
    assert "debug mode was off" in (tmp_path / "h.dot").read_text()


def test_fake_compile_option_is_ignored_with_warning(fake_cuda: FakeCudaModule) -> None:
    with pytest.warns(UserWarning, match="compile='inductor' is ignored on the cuda backend"):
        accel_graph.Graph(device="cuda:0", compile="inductor")


def test_fake_describe_never_raises(fake_cuda: FakeCudaModule) -> None:
    facts = dict(get_backend("cuda").describe())
    assert facts["arch_list"] == "sm_80 sm_90 compute_90"


# -- architecture verdicts --------------------------------------------------------------------
def test_fake_unsupported_arch_refuses_capture(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeCudaModule(capability=(12, 0), arch_list=("sm_80", "sm_90"))
    fake.install_into_torch(monkeypatch)
    with pytest.raises(BackendUnavailable, match=r"compute capability 12\.0 .* is not supported"):
        accel_graph.Graph(device="cuda:0")


def test_fake_ptx_only_arch_warns_once(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeCudaModule(capability=(12, 0), arch_list=("sm_80", "sm_90", "compute_90"))
    fake.install_into_torch(monkeypatch)
    with pytest.warns(RuntimeWarning, match="JIT-compile the compute_90 PTX"):
        accel_graph.Graph(device="cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel_graph.Graph(device="cuda:0")


def test_fake_sm107_binary_compatible_without_warning(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeCudaModule(capability=(10, 7), arch_list=("sm_90", "sm_100", "sm_120"))
    fake.install_into_torch(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = accel_graph.Graph(device="cuda:0")
    verdict = g.backend.arch_verdict(0)
    assert verdict.kind == "binary_compatible" and verdict.target == "sm_100" and verdict.assumed


# -- pools ------------------------------------------------------------------------------------
def test_fake_shared_pool_via_graph_pool(fake_cuda: FakeCudaModule) -> None:
    g1 = accel_graph.Graph(device="cuda:0")
    capture(g1, fake_cuda)
    p1 = last_graph(fake_cuda)._pool
    g2 = accel_graph.Graph(device="cuda:0", pool=g1.pool())
    capture(g2, fake_cuda)
    assert last_graph(fake_cuda)._pool == p1
    assert g2.pool() == g1.pool() and min(g1.pool().id) < 0  # our ids are negative


def test_fake_user_handle_shared_and_distinct_from_private(fake_cuda: FakeCudaModule) -> None:
    h = accel_graph.graph_pool_handle("cuda:0")
    assert isinstance(h, PoolHandle) and h.id[0] == 0 and h.id[1] < 0
    a, b, c = (accel_graph.Graph(device="cuda:0") for _ in range(3))
    capture(a, fake_cuda, pool=h)
    capture(b, fake_cuda, pool=h)
    capture(c, fake_cuda)
    pa, pb, pc = (g._pool for g in fake_cuda.graphs[-3:])
    assert pa == pb != pc


def test_fake_torch_ids_and_mempool_pass_through(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0", pool=(0, 77))
    capture(g, fake_cuda)
    assert last_graph(fake_cuda)._pool == (0, 77)

    class MemPoolLike:  # torch.cuda.MemPool exposes its id as .id
        id = (0, 78)

    capture(accel_graph.Graph(device="cuda:0"), fake_cuda, pool=MemPoolLike())
    assert last_graph(fake_cuda)._pool == (0, 78)
    torch_graph_pool = last_graph(fake_cuda).pool()
    capture(accel_graph.Graph(device="cuda:0", pool=list(torch_graph_pool)), fake_cuda)
    assert last_graph(fake_cuda)._pool == (0, 78)


def test_fake_pool_from_another_device_names_both(fake_cuda: FakeCudaModule) -> None:
    h0 = accel_graph.graph_pool_handle("cuda:0")
    with pytest.raises(PoolError, match="lives on cuda:0, but this graph is on cuda:1"):
        accel_graph.Graph(device="cuda:1", pool=h0)
    capture(accel_graph.Graph(device="cuda:0", pool=(0, 90)), fake_cuda)
    with pytest.raises(PoolError, match="lives on cuda:0, but this graph is on cuda:1"):
        accel_graph.Graph(device="cuda:1", pool=(0, 90))


def test_fake_pool_from_another_backend(fake_cuda: FakeCudaModule) -> None:
    foreign = PoolHandle("recorder", get_backend("cuda").device_spec(torch.device("cuda:0")), (0, 1))
    with pytest.raises(PoolError, match="belongs to the recorder backend"):
        accel_graph.Graph(device="cuda:0", pool=foreign)


@pytest.mark.parametrize("bad", [(1, 1), (0, 0), "pool", (0, 1.5), (0, -999_999), (True, 0)])
def test_fake_bad_pool_values(fake_cuda: FakeCudaModule, bad: object) -> None:
    with pytest.raises(PoolError):
        accel_graph.Graph(device="cuda:0", pool=bad)


def test_fake_recapture_into_released_pool_gets_fresh_torch_pool(fake_cuda: FakeCudaModule) -> None:
    h = accel_graph.graph_pool_handle("cuda:0")
    g = accel_graph.Graph(device="cuda:0", pool=h)
    capture(g, fake_cuda, 4096)  # the pretend output tensor keeps its segment alive
    first = last_graph(fake_cuda)._pool
    g.reset()
    capture(g, fake_cuda, 4096)  # the fake asserts like torch if the same pool id were reused
    assert last_graph(fake_cuda)._pool != first


def test_fake_memory_bytes_is_pool_growth(fake_cuda: FakeCudaModule) -> None:
    h = accel_graph.graph_pool_handle("cuda:0")
    g1 = accel_graph.Graph(device="cuda:0", pool=h)
    capture(g1, fake_cuda, 1 << 20, 1 << 20)
    g2 = accel_graph.Graph(device="cuda:0", pool=h)
    capture(g2, fake_cuda, 1 << 19)
    fake_cuda.allocate(1 << 30)  # outside any capture: not in the pool
    assert g1.memory_bytes() == 2 << 20 and g2.memory_bytes() == 1 << 19
    assert g1.standalone_bytes() is None
    stats = get_backend("cuda").pool_stats(h)
    assert stats is not None and stats.reserved_bytes == (2 << 20) + (1 << 19)
    assert stats.segments == 3 and stats.graphs == 2
    assert ("memory_snapshot", (stats.extra["torch_pool_id"], False)) in fake_cuda.calls


def test_fake_memory_bytes_with_legacy_snapshot(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeCudaModule(legacy_snapshot=True)
    fake.install_into_torch(monkeypatch)
    fake.allocate(1 << 30)
    g = accel_graph.Graph(device="cuda:0")
    capture(g, fake, 3000, 5000)
    assert g.memory_bytes() == 8000


def test_fake_memory_bytes_only_counts_its_device(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0", pool=(0, 55))
    with accel_graph.graph(g):
        fake_cuda.allocate(100)
        fake_cuda.allocate(999, device=1)  # same pool id, other device's allocator
    assert g.memory_bytes() == 100


def test_fake_pool_bookkeeping_does_not_grow(fake_cuda: FakeCudaModule) -> None:
    import gc

    backend = get_backend("cuda")
    h = accel_graph.graph_pool_handle("cuda:0")
    for _ in range(20):
        g = accel_graph.Graph(device="cuda:0")
        capture(g, fake_cuda, 64)
        g.reset()
        shared = accel_graph.Graph(device="cuda:0", pool=h)
        capture(shared, fake_cuda, 64)
        del shared  # freed without reset() (refcount): __del__ releases our bookkeeping
    gc.collect()
    assert backend.pools.held() == {}


def test_fake_without_graph_pool_handle_learns_torch_pool(
    fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.cuda, "graph_pool_handle")  # a stack without it: torch picks ids
    g1 = accel_graph.Graph(device="cuda:0")
    capture(g1, fake_cuda, 300)
    private = last_graph(fake_cuda)._pool
    assert private[0] > 0 and private[1] == 0  # torch's own private-pool id
    assert g1.memory_bytes() == 300
    g2 = accel_graph.Graph(device="cuda:0", pool=g1.pool())
    capture(g2, fake_cuda, 200)
    assert last_graph(fake_cuda)._pool == private and g2.memory_bytes() == 200


def test_fake_hip_describe_lists_quirks(fake_rocm: FakeCudaModule) -> None:
    facts = dict(get_backend("hip").describe())
    assert facts["torch.version.hip"] == "7.0.51831-7c9236b16"
    assert "quirk lazy-graph-exec-destroy" in facts and "quirk expandable-segments-rocm7" not in facts


def test_fake_nested_capture_is_refused_before_touching_the_device(fake_cuda: FakeCudaModule) -> None:
    outer, inner = accel_graph.Graph(device="cuda:0"), accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="already underway"):
        with accel_graph.graph(outer):
            fake_cuda.allocate(8)
            with accel_graph.graph(inner):  # its synchronize would break the outer capture
                pass
    assert outer.state == "empty" and inner.state == "empty" and fake_cuda.capturing is None
    for g in (outer, inner):
        capture(g, fake_cuda)
        g.replay()


def test_fake_nested_manual_capture_begin_is_refused(fake_cuda: FakeCudaModule) -> None:
    outer, inner = accel_graph.Graph(device="cuda:0"), accel_graph.Graph(device="cuda:0")
    backend = get_backend("cuda")
    with fake_cuda.stream(backend.capture_stream(outer.device_spec)):
        outer.capture_begin()
        with fake_cuda.stream(fake_cuda.Stream(device=0)):  # another stream, same thread
            with pytest.raises(CaptureError, match="a graph on cuda:0"):
                inner.capture_begin()
        outer.capture_end()
    assert outer.state == "instantiated" and inner.state == "empty"
    with fake_cuda.stream(backend.capture_stream(inner.device_spec)):
        inner.capture_begin()
        inner.capture_end()
    assert backend._capturing == {}


def test_fake_hip_arch_missing_from_build_warns_once(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeCudaModule(arch_list=("gfx90a", "gfx1100"), gcn_arch="gfx950:sramecc+:xnack-")
    fake.install_into_torch(monkeypatch, hip="7.1.0")
    with pytest.warns(RuntimeWarning, match="no code objects for gfx950"):
        accel_graph.Graph(device="cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel_graph.Graph(device="cuda:0")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["private", "shared", "torch", "reset", "drop"]),
                          st.integers(0, 3)), max_size=25))
def test_fake_pool_bookkeeping_random_sequences(ops: list[tuple[str, int]]) -> None:
    """Random capture/reset/drop sequences: our counts match the graphs alive, nothing leaks,
    and the fake allocator never sees a capture join a released pool (torch's assert)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ACCEL_GRAPH_BACKEND", raising=False)
        before = registered_backends()
        register_backend(CudaBackend)
        try:
            fake = FakeCudaModule()
            fake.install_into_torch(mp)
            backend = get_backend("cuda")
            shared = accel_graph.graph_pool_handle("cuda:0")
            slots: list[accel_graph.Graph | None] = [None] * 4
            for op, i in ops:
                g = slots[i]
                if op == "reset" and g is not None:
                    g.reset()
                elif op == "drop":
                    slots[i] = None
                elif op in ("private", "shared", "torch"):
                    if g is None or g.state != "empty":
                        slots[i] = g = accel_graph.Graph(device="cuda:0")
                    pool = {"private": None, "shared": shared, "torch": (0, 4242)}[op]
                    try:
                        capture(g, fake, 128, pool=pool)
                    except CaptureError as exc:  # torch's own id, released: torch's assert
                        assert op == "torch" and "cannot rejoin" in str(exc)
                        assert g.state == "empty"
                g = None  # a dropped graph must be freed by refcount alone
                holding = [s for s in slots if s is not None and s.state != "empty"]
                ours = [s.pool().id for s in holding if min(s.pool().id) < 0]
                assert backend.pools.held() == {
                    k: ours.count(k) for k in set(ours)
                }
        finally:
            for name in registered_backends():
                if name not in before:
                    unregister_backend(name)
            for cls in before.values():
                register_backend(cls)


def test_fake_rejoining_a_released_torch_pool_explains(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0", pool=(0, 31))
    capture(g, fake_cuda, 512)  # the pretend output keeps the pool's memory held
    g.reset()
    with pytest.raises(CaptureError, match="torch cannot rejoin it"):
        capture(g, fake_cuda, 512)
    assert g.state == "empty"
