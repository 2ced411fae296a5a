"""Recorder pools: CUDA's private-pool semantics, lifetime safety and memory accounting."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import accel_graph as ag
from accel_graph.backends import get_backend
from accel_graph.backends.base import DeviceSpec, PoolHandle

MiB = 1 << 20


def chain(x: torch.Tensor) -> torch.Tensor:
    """Three same-sized intermediates, each dead before the next but one is made."""
    a = x * 2
    b = a + 1
    del a
    c = b * 3
    del b
    return c.sum(0)


def recorder_stats(handle):
    return get_backend("recorder").pool_stats(handle)


def test_memory_of_a_dead_tensor_is_reused_within_the_capture():
    x = torch.randn(2048, 1024)  # 8 MiB per intermediate

    def keep_all(x):
        a = x * 2
        b = a + 1
        c = b * 3
        return c.sum(0), a, b

    g = ag.Graph(device="cpu")
    with ag.graph(g):
        y = chain(x)
    g_keep = ag.Graph(device="cpu")
    with ag.graph(g_keep):
        kept = keep_all(x)
    # With reuse, c lands in a's memory: two 8 MiB blocks share one 20 MiB segment. Keeping all
    # three alive needs a second segment.
    assert g.memory_bytes() < g_keep.memory_bytes()
    assert g.memory_bytes() == g.standalone_bytes()
    g.replay()
    assert torch.equal(y, chain(x))
    del kept


def test_graphs_sharing_a_pool_reuse_memory_largest_first():
    h = ag.graph_pool_handle("cpu")
    graphs, pairs = [], []
    for rows in (2048, 1024, 768):  # intermediates above 1 MiB: all in the large pool
        g = ag.Graph(device="cpu")
        x = torch.randn(rows, 512)
        with ag.graph(g, pool=h):
            pairs.append((x, chain(x)))
        graphs.append(g)
    incremental = [g.memory_bytes() for g in graphs]
    standalone = [g.standalone_bytes() for g in graphs]
    assert incremental[0] == standalone[0] > 0
    assert incremental[1:] == [0, 0], "smaller graphs should fit in the memory the largest freed"
    assert all(s > 0 for s in standalone)
    stats = recorder_stats(h)
    # Two independent counts: the graphs' own growth, and the pool's segments.
    assert sum(incremental) == stats.reserved_bytes == stats.extra["segment_bytes"]
    assert stats.graphs == 3
    for g in graphs:
        g.replay()
    for x, y in pairs:
        assert torch.equal(y, chain(x))


def test_sum_of_incremental_bytes_matches_pool_when_graphs_grow_it():
    h = ag.graph_pool_handle("cpu")
    graphs, keep = [], []
    for rows in (64, 256, 1024):  # smallest first: each capture grows the pool
        g = ag.Graph(device="cpu")
        x = torch.randn(rows, 1024)
        with ag.graph(g, pool=h):
            keep.append(x * 2)  # held outputs are never reused
        graphs.append(g)
    stats = recorder_stats(h)
    assert sum(g.memory_bytes() for g in graphs) == stats.reserved_bytes
    assert stats.reserved_bytes == sum(s for s in [stats.extra["segment_bytes"]])
    assert graphs[2].memory_bytes() > 0


@pytest.mark.parametrize("how", ["reset", "del", "reset+del+collect"])
def test_outputs_outlive_reset_and_delete(how):
    x = torch.randn(256, 256)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        out = torch.tanh(x) * 3
        view = out[10:20]
    g.replay()
    expected = torch.tanh(x) * 3
    if "reset" in how:
        g.reset()
    if "del" in how:
        del g
    if "collect" in how:
        gc.collect()
    # Churn: new captures (into fresh pools) and eager allocations must not land on our memory.
    for _ in range(5):
        g2 = ag.Graph(device="cpu")
        with ag.graph(g2):
            junk = torch.ones(256, 256) * 7
        g2.replay()
        del junk, g2
    _ = [torch.full((256, 256), 9.0) for _ in range(10)]
    assert torch.equal(out, expected)
    assert torch.equal(view, expected[10:20])


def test_shared_pool_never_hands_out_memory_a_user_still_holds():
    h = ag.graph_pool_handle("cpu")
    x = torch.randn(512, 512)
    g1 = ag.Graph(device="cpu")
    with ag.graph(g1, pool=h):
        held = x * 2
    g1.replay()
    g1.reset()
    del g1
    gc.collect()
    g2 = ag.Graph(device="cpu")
    with ag.graph(g2, pool=h):
        other = x * 5
    g2.replay()
    assert held.data_ptr() != other.data_ptr()
    assert torch.equal(held, x * 2)
    assert torch.equal(other, x * 5)


def test_capture_into_a_pool_whose_graphs_were_all_reset():
    h = ag.graph_pool_handle("cpu")
    x = torch.randn(64, 64)
    g = ag.Graph(device="cpu")
    with ag.graph(g, pool=h):
        y = x + 1
    g.reset()
    del y
    with ag.graph(g, pool=h):
        z = x - 1
    g.replay()
    assert torch.equal(z, x - 1)


def test_memory_returns_when_no_graph_and_no_tensor_uses_it():
    h = ag.graph_pool_handle("cpu")
    x = torch.randn(1024, 1024)
    g = ag.Graph(device="cpu")
    with ag.graph(g, pool=h):
        y = x * 2
    assert recorder_stats(h).reserved_bytes >= 4 * MiB
    g.reset()
    assert recorder_stats(h).reserved_bytes >= 4 * MiB, "y still points into the pool"
    del y
    gc.collect()
    stats = recorder_stats(h)
    assert stats is None or stats.reserved_bytes == 0


def test_pool_limit_gives_oom_and_leaves_the_graph_reusable(monkeypatch):
    monkeypatch.setenv("ACCEL_GRAPH_POOL_LIMIT", "3M")
    x = torch.randn(1024, 1024)  # 4 MiB per output
    g = ag.Graph(device="cpu")
    with pytest.raises(ag.OutOfMemoryError, match="out of memory") as info:
        with ag.graph(g):
            x * 2
    assert isinstance(info.value, torch.OutOfMemoryError) and isinstance(info.value, MemoryError)
    assert g.state == "empty"
    monkeypatch.delenv("ACCEL_GRAPH_POOL_LIMIT")
    with ag.graph(g):
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)


def test_bad_pool_limit_is_a_config_error(monkeypatch):
    monkeypatch.setenv("ACCEL_GRAPH_POOL_LIMIT", "lots")
    with pytest.raises(ag.ConfigError, match="ACCEL_GRAPH_POOL_LIMIT"):
        with ag.graph(ag.Graph(device="cpu")):
            pass


def test_pool_handles_of_other_devices_and_backends_are_refused():
    g = ag.Graph(device="cpu")
    foreign_device = PoolHandle("recorder", DeviceSpec("recorder", "cuda", 0), (0, 999_999))
    with pytest.raises(ag.PoolError, match="cuda"):
        g.capture_begin(pool=foreign_device)
    foreign_backend = PoolHandle("cuda", DeviceSpec("cuda", "cuda", 0), (0, 1))
    with pytest.raises(ag.PoolError, match="cuda backend"):
        g.capture_begin(pool=foreign_backend)
    with pytest.raises(ag.PoolError, match="belongs to no pool"):
        g.capture_begin(pool=PoolHandle("recorder", g.device_spec, (0, 987_654_321)))
    assert g.state == "empty"


def test_debug_dump_writes_dot_and_json_without_debug_mode(tmp_path):
    x = torch.randn(8, 8)
    w = torch.randn(8, 8)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        y = torch.softmax(x @ w, -1)
        # The fused CPU attention kernel has no .out overload: it allocates at replay.
        z = torch.nn.functional.scaled_dot_product_attention(y[None, None], y[None, None], y[None, None])
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    assert path.read_text().startswith("digraph")
    desc = json.loads((tmp_path / "g.dot.json").read_text())
    assert desc["num_ops"] == len(desc["ops"]) > 0
    assert [i["shape"] for i in desc["inputs"]] == [[8, 8], [8, 8]]
    assert sorted(tuple(o["shape"]) for o in desc["outputs"]) == [(1, 1, 8, 8), (8, 8)]
    allocating = [op for op in desc["ops"] if op["allocates_at_replay"]]
    assert allocating and all("no .out" in op["why"] for op in allocating)
    assert desc["pool"]["reserved_bytes"] == desc["memory_bytes"] > 0
    del y, z


def test_debug_mode_poisons_outputs_until_first_replay():
    x = torch.randn(4, 4)
    g = ag.Graph(device="cpu")
    g.enable_debug_mode()
    with ag.graph(g):
        y = x * 2
        n = torch.arange(4) + 1
    assert torch.isnan(y).all()
    assert (n == -0x5A5A5A5A).all()
    g.replay()
    assert torch.equal(y, x * 2) and torch.equal(n, torch.arange(4) + 1)


def test_capture_holds_no_strong_reference_to_pool_tensors():
    x = torch.randn(256, 256)
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        for _ in range(50):
            x = x * 1.0001  # each intermediate dies at once
        y = x
    # 50 live intermediates would need 50 x 256 KiB; with reuse two blocks suffice.
    assert g.memory_bytes() <= 2 * MiB
    g.replay()
    del y


# -- EnginePool's DLPack blocks: the books follow the deaths exactly ----------------------


def _engine_pool():
    from accel_graph.backends.recorder.engine_pool import EnginePool

    pool = EnginePool(torch.device("cpu"))
    if pool._blocks is None:
        pytest.skip("the _dlpack extension is not built")
    return pool


def test_engine_pool_capture_log_keeps_the_order_of_deaths():
    pool = _engine_pool()
    cpu = torch.device("cpu")
    log: list = []
    pool.begin_capture(log)
    a = pool.allocate((256,), (1,), torch.float32, cpu)
    b = pool.allocate((8, 8), (1, 8), torch.float64, cpu)
    del a
    c = pool.allocate((256,), (1,), torch.float32, cpu)
    del b, c
    pool.end_capture(log)
    assert log == [
        ("alloc", 0, 1024),
        ("alloc", 1, 512),
        ("free", 0, 0),
        ("alloc", 2, 1024),
        ("free", 1, 0),
        ("free", 2, 0),
    ]
    assert pool.stats().allocated_bytes == 0 and pool.stats().reserved_bytes == 0


def test_engine_pool_owns_survives_storage_id_reuse():
    pool = _engine_pool()
    pool.add_graph()  # not idle: deaths are booked in batches
    cpu = torch.device("cpu")
    for _ in range(200):
        t = pool.allocate((64,), (1,), torch.float32, cpu)
        assert pool.owns(t) and pool.ref(t).byte_offset == t.data_ptr()
        assert pool.owns(t[1:])
        del t
    assert not pool.owns(torch.empty(64))
    assert pool.stats().allocated_bytes == 0
    assert not pool._storages and not pool._key_storage and not pool._storage_key


def test_engine_pool_idle_pool_releases_at_the_death():
    pool = _engine_pool()
    t = pool.allocate((1 << 20,), (1,), torch.float32, torch.device("cpu"))
    assert pool.engine.memory_stats()["reserved_bytes.all.current"] >= 4 * MiB
    del t  # the engine itself sees it, before the pool books it
    assert pool.engine.memory_stats()["reserved_bytes.all.current"] == 0


def test_engine_pool_numpy_path_still_works(monkeypatch):
    from accel_graph.backends.recorder import engine_pool

    pool = _engine_pool()
    monkeypatch.setitem(engine_pool._DL_CODES, torch.float32, None)
    log: list = []
    pool.begin_capture(log)
    a = pool.allocate((16,), (1,), torch.float32, torch.device("cpu"))
    b = pool.allocate((16,), (1,), torch.int32, torch.device("cpu"))  # DLPack
    assert pool.owns(a) and pool.owns(b)
    del a, b
    gc.collect()
    pool.end_capture(log)
    assert [e[0] for e in log] == ["alloc", "alloc", "free", "free"]
    assert pool.stats().allocated_bytes == 0
