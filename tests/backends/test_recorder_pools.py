"""The recorder's pools against their contract (GraphPool), and the device pool on the CPU.

The device pool serves every device but the CPU, so CPU CI would never run it: here it is
constructed on the CPU device directly (its segments are then CPU tensors), and the backend is
made to use it for whole captures.
"""

from __future__ import annotations

import gc

import pytest
import torch

import accel_graph as ag
from accel_graph.backends import get_backend
from accel_graph.backends.recorder import backend as recorder_backend
from accel_graph.backends.recorder.device_pool import DevicePool
from accel_graph.backends.recorder.engine_pool import EnginePool
from accel_graph.backends.recorder.pool import make_pool
from accel_graph.backends.recorder.pool_protocol import GraphPool, standalone_peak

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture
def device_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures on the CPU get a DevicePool instead of the CPU's EnginePool."""
    monkeypatch.setattr(recorder_backend, "make_pool", lambda device, limit=None: DevicePool(device, limit))


def test_make_pool_picks_the_engine_pool_for_the_cpu_and_the_device_pool_elsewhere():
    assert isinstance(make_pool(CPU), EnginePool)
    other = make_pool(torch.device("meta"))  # nothing is allocated before the first block
    assert isinstance(other, DevicePool) and isinstance(other, GraphPool)


@pytest.mark.parametrize("pool_type", [EnginePool, DevicePool])
def test_allocate_logs_its_key_last_and_refs_round_trip(pool_type: type[GraphPool]):
    pool = pool_type(CPU)
    log: list = []
    pool.begin_capture(log)
    t = pool.allocate((4, 6), (6, 1), torch.float32, CPU)
    assert log[-1][0] == "alloc" and log[-1][2] == 4 * 6 * 4
    u = pool.allocate((3,), (1,), torch.int64, CPU)
    assert log[-1][1] != log[-2][1]  # keys are unique
    assert pool.owns(t) and pool.owns(t[1:]) and pool.owns(u)
    assert not pool.owns(torch.empty(3))
    ref = pool.ref(t[1:, 2:])
    view = pool.materialize(ref)
    assert view.data_ptr() == t[1:, 2:].data_ptr()
    assert view.shape == t[1:, 2:].shape and view.stride() == t[1:, 2:].stride()
    view.fill_(3.0)
    assert (t[1:, 2:] == 3.0).all()
    pool.add_graph()
    pool.end_capture(log)
    assert pool.stats().graphs == 1 and pool.reserved_bytes() > 0
    del t, u, view
    pool.remove_graph()


def test_device_pool_capture_and_replay_match_eager(device_pools: None):
    x = torch.randn(64, 32)
    w = torch.randn(32, 16)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        y = torch.relu(x @ w) * 2 + 1
        v = y[:8]
    x.copy_(torch.randn(64, 32))
    g.replay()
    assert torch.equal(y, torch.relu(x @ w) * 2 + 1)
    assert torch.equal(v, y[:8])
    assert g.memory_bytes() == g.standalone_bytes() > 0


def test_device_pool_never_recycles_and_forgets_its_books_when_unused(device_pools: None):
    h = ag.graph_pool_handle("cpu")
    x = torch.randn(512, 512)  # 1 MiB per intermediate: the small pool's 2 MiB segments
    g = ag.Graph(device="cpu")
    with ag.graph(g, pool=h):
        a = x * 2
        b = a + 1
        del a  # invisible to the device pool: its block stays taken
        out = b * 3
    stats = get_backend("recorder").pool_stats(h)
    assert stats.allocated_bytes == 3 * MiB
    assert stats.reserved_bytes == g.memory_bytes() == stats.extra["segment_bytes"]
    g.replay()
    expected = (x * 2 + 1) * 3
    assert torch.equal(out, expected)
    g.reset()
    gc.collect()
    stats = get_backend("recorder").pool_stats(h)
    assert stats is None or stats.reserved_bytes == 0
    # The pool forgot its books; the tensor still held keeps its memory and its values.
    g2 = ag.Graph(device="cpu")
    with ag.graph(g2, pool=h):
        other = torch.full((512, 512), 5.0)
    g2.replay()
    assert torch.equal(out, expected) and (other == 5.0).all()
    assert not g2.backend.pool_for(h).owns(out)


def test_device_pool_limit_gives_oom_and_leaves_the_graph_reusable(
    device_pools: None, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("ACCEL_GRAPH_POOL_LIMIT", "3M")
    x = torch.randn(1024, 1024)  # 4 MiB per output
    g = ag.Graph(device="cpu")
    with pytest.raises(ag.OutOfMemoryError, match="out of memory"):
        with ag.graph(g):
            x * 2
    assert g.state == "empty"
    monkeypatch.delenv("ACCEL_GRAPH_POOL_LIMIT")
    with ag.graph(g):
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)


def test_device_pool_backs_each_engine_segment_with_one_tensor():
    pool = DevicePool(CPU)
    pool.add_graph()  # not idle: the books stay
    blocks = [pool.allocate((256,), (1,), torch.float32, CPU) for _ in range(4)]
    big = pool.allocate((3 * MiB // 4,), (1,), torch.float32, CPU)  # a large-pool segment
    layout = pool.engine.layout()
    assert len(layout) == 2
    # Blocks of one engine segment share one storage; a ref names the segment and the offset.
    assert len({b.untyped_storage().data_ptr() for b in blocks}) == 1
    refs = [pool.ref(b) for b in blocks + [big]]
    assert {r.segment for r in refs} == {seg["address"] for seg in layout}
    assert all(r.byte_offset % 512 == 0 for r in refs)
    pool.remove_graph()


def test_standalone_peak_follows_the_native_policy():
    events = [("alloc", 0, 4 * MiB), ("alloc", 1, 4 * MiB), ("free", 0, 0), ("alloc", 2, 4 * MiB)]
    # 4 MiB requests share one 20 MiB large segment; the third reuses the first's block.
    assert standalone_peak(events) == 20 * MiB
    assert standalone_peak([("alloc", 0, 100)]) == 2 * MiB
    assert standalone_peak([]) == 0
