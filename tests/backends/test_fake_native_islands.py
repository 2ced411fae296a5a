"""Eager islands on the native backends against a FAKE torch.cuda / torch.xpu: PLUMBING ONLY.

Nothing here runs on a GPU or captures a real graph. The fakes (tests/backends/fakes.py) imitate
what matters for pieces: ``fake.launch(fn)`` during a capture records ``fn`` into the capturing
FAKE graph and runs it only at that graph's replays (stream capture runs no kernels), so a test
sees whether the backend replayed the piece before the island (the island's real values), in
which order pieces and islands replay, which pool each piece captured into and when island
buffers were routed into it. The tensors are CPU tensors: the backend's ``island_device`` hook
is patched to the CPU for these tests. Results are compared with the same code run eagerly,
bitwise. Hardware: tools/device_check.py's "islands" row.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import accel_graph
from accel_graph.backends import get_backend
from accel_graph.backends.capture_common import islands as island_marks
from accel_graph.backends.native.backend import NativeGraphBackend
from accel_graph.errors import CaptureError, ReplayError

from .fakes import FakeCudaModule, FakeXpuModule, install_conditional_nodes, install_pool_routing

HERE = "test_fake_native_islands.py:"


@pytest.fixture
def cuda(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> FakeCudaModule:
    """FAKE CUDA whose graphs take CPU tensors (islands' device check: the CPU)."""
    monkeypatch.setattr(NativeGraphBackend, "island_device", lambda self, spec: torch.device("cpu"))
    return fake_cuda


@pytest.fixture
def routed(cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """FAKE allocate-to-pool routing (torch 2.13's ``_cuda_beginAllocateCurrentThreadToPool``)."""
    return install_pool_routing(cuda, monkeypatch)


class Model:
    """piece 0: h = x * 2; island: data-dependent routing on h (reads values on the host);
    piece 1: y = r + 1. ``log`` records what ran, in order, with the values the island saw."""

    def __init__(self, fake: FakeCudaModule | FakeXpuModule) -> None:
        self.fake = fake
        self.x = torch.arange(4, dtype=torch.float32)
        self.h = torch.zeros(4)
        self.y = torch.zeros(4)
        self.seen: list[torch.Tensor] = []

        @accel_graph.eager_island
        def route(h: torch.Tensor) -> torch.Tensor:
            self.seen.append(h.clone())
            fake.log.append(("island", h.sum().item()))
            k = int(h.sum().item()) % 3  # a host read: refused by any capture
            return h[torch.nonzero(h >= 0).flatten()] * (k + 1)

        self.route = route

    def step(self) -> None:
        """The program: launched as FAKE kernels (captured) plus the island (eager)."""
        x, h, y = self.x, self.h, self.y
        self.fake.launch(lambda: h.copy_(x * 2))
        r = self.route(h)
        self.fake.launch(lambda: y.copy_(r + 1))

    def eager(self) -> torch.Tensor:
        h = self.x * 2
        k = int(h.sum().item()) % 3
        return h[torch.nonzero(h >= 0).flatten()] * (k + 1) + 1


def capture(g: accel_graph.Graph, m: Model, **kw: Any) -> None:
    with accel_graph.graph(g, **kw):
        m.step()


def events(fake: FakeCudaModule, start: int = 0) -> list[Any]:
    graphs = {id(g): i for i, g in enumerate(fake.graphs)}
    return [(e, graphs[id(a)] if e in ("replay", "captured") else a) for e, a in fake.log[start:]]


def test_fake_pieces_replay_in_order_and_equal_eager(cuda: FakeCudaModule, routed: list) -> None:
    m = Model(cuda)
    g = accel_graph.Graph(device="cuda:0")
    capture(g, m)
    # Capture: piece 0 recorded, ended and replayed once, then the island saw its values.
    assert torch.equal(m.seen[0], m.x * 2)
    assert len(cuda.graphs) == 2 and all(fg.ended for fg in cuda.graphs)
    for i in range(5):
        m.x.copy_(torch.arange(4, dtype=torch.float32) * (i + 1) + i)
        start = len(cuda.log)
        g.replay()
        # piece 0, then the island on piece 0's fresh values, then piece 1
        assert events(cuda, start) == [("replay", 0), ("island", float((m.x * 2).sum())),
                                       ("replay", 1)], i
        assert torch.equal(m.seen[-1], m.x * 2)
        assert torch.equal(m.y, m.eager()), i


def test_fake_island_outputs_are_pool_buffers_of_any_pytree(cuda: FakeCudaModule, routed: list) -> None:
    made: list[Any] = []

    @accel_graph.eager_island
    def split(x: torch.Tensor) -> dict[str, Any]:
        out = {"a": x + 1, "b": (None, x.sum().reshape(1))}
        made.append(out)
        return out

    x = torch.ones(3)
    got: dict[str, Any] = {}
    a_copy, b_copy = torch.zeros(3), torch.zeros(1)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        got = split(x)
        cuda.launch(lambda: (a_copy.copy_(got["a"]), b_copy.copy_(got["b"][1])))
    assert got["b"][0] is None and set(got) == {"a", "b"}
    # The caller holds static buffers, not the island's eager outputs.
    assert got["a"].data_ptr() != made[0]["a"].data_ptr()
    assert torch.equal(got["a"], made[0]["a"]) and torch.equal(got["b"][1], made[0]["b"][1])
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    g.replay()
    assert torch.equal(got["a"], x + 1) and torch.equal(got["b"][1], x.sum().reshape(1))
    assert torch.equal(a_copy, x + 1) and torch.equal(b_copy, torch.tensor([6.0]))


def test_fake_island_writes_in_place_into_a_tensor_captured_by_reference(cuda: FakeCudaModule) -> None:
    cache = torch.zeros(6)
    pos = torch.zeros((), dtype=torch.long)

    @accel_graph.eager_island
    def append(h: torch.Tensor) -> None:
        cache[int(pos.item())] = h.sum()  # a KV-cache write at a host-read position
        pos.add_(1)

    x = torch.ones(2)
    h = torch.zeros(2)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        cuda.launch(lambda: h.copy_(x * 3))
        append(h)
    # Capture ran the island once on real values (the warm-up): position 0 written.
    assert cache.tolist() == [6, 0, 0, 0, 0, 0] and int(pos) == 1
    expected = cache.clone()
    for i in range(1, 4):
        x.fill_(i)
        g.replay()
        expected[i] = 2 * 3 * i
        assert torch.equal(cache, expected)


def test_fake_bad_island_output_at_replay_raises_and_the_next_replay_works(cuda: FakeCudaModule) -> None:
    n = torch.tensor(4)

    @accel_graph.eager_island
    def pick(x: torch.Tensor) -> torch.Tensor:
        return x[: int(n.item())].clone()

    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros(4)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        r = pick(x)
        cuda.launch(lambda: y.copy_(r * 2))
    n.fill_(3)
    start = len(cuda.log)
    with pytest.raises(ReplayError, match=r"eager island .*pick \(.*" + re.escape(HERE)) as info:
        g.replay()
    assert "shape (4,)" in str(info.value) and "Nothing after the island ran" in str(info.value)
    assert [e for e, _ in events(cuda, start)] == ["replay"]  # piece 1 did not replay
    assert torch.equal(y, torch.zeros(4))
    n.fill_(4)
    x.add_(1)
    g.replay()
    assert torch.equal(y, x[:4] * 2)


def test_fake_island_error_at_capture_aborts_every_piece(cuda: FakeCudaModule) -> None:
    @accel_graph.eager_island
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("router broke")

    @accel_graph.eager_island
    def ok(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    backend = get_backend("cuda")
    g = accel_graph.Graph(device="cuda:0")
    x = torch.ones(2)
    with pytest.raises(ValueError, match="router broke"):
        with accel_graph.graph(g):
            cuda.launch(lambda: x.add_(1))
            r = ok(x)
            cuda.launch(lambda: r.add_(1))
            fail(r)
    assert g.state == "empty" and cuda.capturing is None
    assert len(cuda.graphs) == 2 and all(not fg.ended and fg.work == [] for fg in cuda.graphs)
    assert backend.pools.held() == {} and all(v == 0 for v in cuda.pool_use.values())
    # An error in a later piece (after an island) aborts the same way.
    with pytest.raises(RuntimeError, match="later piece"):
        with accel_graph.graph(g):
            r = ok(x)
            raise RuntimeError("later piece")
    assert g.state == "empty" and backend.pools.held() == {}
    m = Model(cuda)
    capture(g, m)
    g.replay()
    assert torch.equal(m.y, m.eager())


def test_fake_island_error_caught_inside_the_capture_invalidates_it(cuda: FakeCudaModule) -> None:
    @accel_graph.eager_island
    def scalar(x: torch.Tensor) -> float:
        return x.sum().item()

    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=r"invalid: eager island .*scalar"):
        with accel_graph.graph(g):
            with pytest.raises(CaptureError, match=r"returned .*\(a float\) as output 0"):
                scalar(torch.ones(2))
            cuda.launch(lambda: None)
    assert g.state == "empty" and get_backend("cuda").pools.held() == {}


def test_fake_reset_drops_every_piece_and_recaptures(cuda: FakeCudaModule, routed: list) -> None:
    m = Model(cuda)
    g = accel_graph.Graph(device="cuda:0")
    capture(g, m)
    pieces = list(cuda.graphs)
    g.reset()
    assert g.state == "empty" and all(not p.ended for p in pieces)
    assert get_backend("cuda").pools.held() == {}
    capture(g, m)
    m.x.fill_(3)
    g.replay()
    assert torch.equal(m.y, m.eager())


def test_fake_debug_dump_names_pieces_and_islands(cuda: FakeCudaModule, tmp_path: Any) -> None:
    m = Model(cuda)
    g = accel_graph.Graph(device="cuda:0")
    g.enable_debug_mode()
    capture(g, m)
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    text = path.read_text()
    assert "2 pieces, 1 eager islands" in text
    assert re.search(r"eager island 0: .*route.*defined at .*" + re.escape(HERE), text)
    assert text.index("piece 0:") < text.index("eager island 0") < text.index("piece 1:")
    assert (tmp_path / "g.dot.piece0.dot").read_text() == "digraph fake {}\n"
    assert (tmp_path / "g.dot.piece1.dot").exists()
    assert [c for fg in cuda.graphs for c in fg.calls if c[0] == "enable_debug_mode"] == [
        ("enable_debug_mode", None)] * 2
    h = accel_graph.Graph(device="cuda:0")  # debug mode off: placeholders, a warning
    capture(h, Model(cuda))
    with pytest.warns(UserWarning, match="enable_debug_mode"):
        h.debug_dump(str(tmp_path / "h.dot"))
    assert "debug mode was off" in (tmp_path / "h.dot.piece1.dot").read_text()
    assert "eager island 0" in (tmp_path / "h.dot").read_text()


def test_fake_pieces_share_one_pool_and_buffers_are_routed_into_it(
        cuda: FakeCudaModule, routed: list) -> None:
    @accel_graph.eager_island
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(2)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g, capture_error_mode="thread_local"):
        cuda.allocate(100)
        r = twice(x)
        cuda.allocate(30)
        r2 = twice(r)
        cuda.allocate(20)
        cuda.launch(lambda: r2.add_(0))
    pools = [fg._pool for fg in cuda.graphs]
    # Bookkeeping: one Graph holds the pool once; its memory is every piece's.
    assert g.memory_bytes() == 150
    backend = get_backend("cuda")
    assert list(backend.pools.held().values()) == [1]
    stats = backend.pool_stats(g.pool())
    assert stats is not None and stats.graphs == 1 and stats.reserved_bytes == 150
    assert len(pools) == 3 and len(set(pools)) == 1
    assert [c[1]["mode"] for fg in cuda.graphs for c in fg.calls if c[0] == "capture_begin"] == [
        "thread_local"] * 3
    assert g.pool().id != pools[0]  # our handle maps onto the torch id the pieces share
    assert routed == [("begin", (0, pools[0])), ("end", (0, pools[0])), ("release", (0, pools[0]))] * 2
    # Routing happened between a piece's end and the next one's begin, outside capture.
    kinds = [e for e, _ in cuda.log]
    assert kinds == ["replay", "begin_allocate_to_pool", "replay", "begin_allocate_to_pool", "captured"]
    assert cuda.pool_use[pools[0]] == 3  # the three pieces hold it; routing gave its use back
    assert g._impl._pieces.allocation == "routed"
    g.reset()
    assert backend.pools.held() == {} and cuda.pool_use[pools[0]] == 0


def test_fake_without_routing_buffers_are_allocated_in_the_next_capture(cuda: FakeCudaModule) -> None:
    # No FAKE routing: the CPU build's stand-ins raise, as on a torch without the API.
    m = Model(cuda)
    g = accel_graph.Graph(device="cuda:0")

    seen: list[torch.Tensor] = []

    @accel_graph.eager_island
    def again(r: torch.Tensor) -> torch.Tensor:
        seen.append(r.clone())
        return r - 1

    with accel_graph.graph(g):
        x, h = m.x, m.h
        cuda.launch(lambda: h.copy_(x * 2))
        r = m.route(h)
        r2 = again(r)  # sees the first island's output: copied in before piece 1's warm-up
        cuda.launch(lambda: m.y.copy_(r2 + 1))
    assert g._impl._pieces.allocation == "in capture"
    assert torch.equal(seen[0], m.eager() - 1)
    for i in range(3):
        m.x.fill_(i)
        g.replay()
        assert torch.equal(m.y, m.eager() - 1)  # y = (route(h) - 1) + 1
        assert torch.equal(seen[-1], m.eager() - 1)


def test_fake_hooks_fire_once_per_graph_not_per_piece(cuda: FakeCudaModule) -> None:
    counts: dict[str, int] = {}
    handles = [getattr(accel_graph, f"register_graph_{e}_hook")(
        lambda g, e=e: counts.__setitem__(e, counts.get(e, 0) + 1))
        for e in ("capture_start", "capture_end", "instantiate", "replay_start", "replay_end")]
    try:
        m = Model(cuda)
        g = accel_graph.Graph(device="cuda:0")
        with accel_graph.graph(g):
            m.step()
            m.route(m.h)
        assert len(cuda.graphs) == 3
        g.replay()
    finally:
        for hd in handles:
            hd.remove()
    assert counts == dict.fromkeys(("capture_start", "capture_end", "instantiate", "replay_start",
                                    "replay_end"), 1)


def test_fake_keep_graph_instantiates_the_last_piece_on_request(cuda: FakeCudaModule) -> None:
    m = Model(cuda)
    g = accel_graph.Graph(keep_graph=True, device="cuda:0")
    capture(g, m)
    first, last = cuda.graphs
    assert first.instantiated and not last.instantiated  # the warm-up replay needed piece 0
    g.instantiate()
    assert last.instantiated
    m.x.fill_(2)
    g.replay()
    assert torch.equal(m.y, m.eager())


def test_fake_island_runs_in_the_captured_grad_and_inference_modes(cuda: FakeCudaModule) -> None:
    modes: list[tuple[bool, bool]] = []

    @accel_graph.eager_island
    def probe(x: torch.Tensor) -> torch.Tensor:
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return x + 1

    x = torch.ones(2)
    for capture_mode, want in ((torch.no_grad, (False, False)), (torch.inference_mode, (False, True))):
        g = accel_graph.Graph(device="cuda:0")
        with capture_mode(), accel_graph.graph(g):
            probe(x)
        modes.clear()
        with torch.enable_grad():
            g.replay()
        assert modes == [want]
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_fake_no_island_keeps_the_zero_overhead_replay(cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        cuda.allocate(8)
    bound = g._impl.__dict__["replay"]
    assert bound.__self__ is cuda.graphs[-1] and bound.__func__ is type(cuda.graphs[-1]).replay


def test_fake_island_plain_outside_capture_and_nested(cuda: FakeCudaModule) -> None:
    inner_calls: list[bool] = []

    @accel_graph.eager_island
    def inner(x: torch.Tensor) -> torch.Tensor:
        inner_calls.append(island_marks.running())
        return x * 3

    @accel_graph.eager_island
    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) + 1

    assert torch.equal(outer(torch.ones(1)), torch.tensor([4.0])) and inner_calls == [False]
    x = torch.ones(1)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        r = outer(x)
    assert len(cuda.graphs) == 2 and inner_calls[1:] == [True]  # one boundary: nested is plain
    x.fill_(2)
    g.replay()
    assert torch.equal(r, torch.tensor([7.0]))


def test_fake_island_refused_where_replay_cannot_run_it(cuda: FakeCudaModule,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    @accel_graph.eager_island
    def isl(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="cannot take islands: graphed callables"):
        with accel_graph.graph(g), island_marks.refused("graphed callables"):
            isl(torch.ones(1))
    assert g.state == "empty"
    install_conditional_nodes(cuda, monkeypatch)
    with pytest.raises(CaptureError, match=r"torch.cond branch .*native capture"):
        with accel_graph.graph(g):
            torch.ops.higher_order.cond(torch.tensor(True), lambda t: isl(t), lambda t: t - 1,
                                        (torch.ones(2),))
    assert g.state == "empty" and cuda.capturing is None
    with pytest.raises(CaptureError, match=r"tensor on meta"):
        with accel_graph.graph(g):
            isl(torch.ones(1, device="meta"))
    assert g.state == "empty"


@pytest.mark.parametrize("kw", [{}, {"xpu_graph": False, "accelerator_graph": "registered"}],
                         ids=["XPUGraph", "accelerator.Graph"])
def test_fake_xpu_pieces(monkeypatch: pytest.MonkeyPatch, native_registry: None, kw: dict) -> None:
    fake = FakeXpuModule(**kw)
    fake.install_into_torch(monkeypatch)
    monkeypatch.setattr(NativeGraphBackend, "island_device", lambda self, spec: torch.device("cpu"))
    routed = install_pool_routing(fake, monkeypatch, prefix="xpu")
    m = Model(fake)
    g = accel_graph.Graph(device="xpu:0")
    capture(g, m)
    pieces = [fg for fg in fake.graphs if fg.ended]  # the backend's probe may make one more
    assert len(pieces) == 2 and len({fg._pool for fg in pieces}) == 1
    assert all(type(fg).__name__ == ("FakeAcceleratorGraph" if kw else "FakeXPUGraph") for fg in pieces)
    assert [r[0] for r in routed] == ["begin", "end", "release"]
    for i in range(3):
        m.x.fill_(i + 1)
        g.replay()
        assert torch.equal(m.y, m.eager())


def test_fake_empty_pieces_do_not_warn_but_an_empty_graph_does(cuda: FakeCudaModule) -> None:
    import warnings

    @accel_graph.eager_island
    def plus(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    cuda.warn_empty = True
    x = torch.ones(1)
    g = accel_graph.Graph(device="cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with accel_graph.graph(g):  # island first and last: both pieces are empty
            plus(x)
    g.replay()
    h = accel_graph.Graph(device="cuda:0")
    with pytest.warns(UserWarning, match="Graph is empty"):
        with accel_graph.graph(h):  # no island: torch's warning stays
            pass


@pytest.mark.filterwarnings("ignore:hip.*side stream:UserWarning")  # hip's advice, not ours
def test_fake_hip_pieces(fake_rocm: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NativeGraphBackend, "island_device", lambda self, spec: torch.device("cpu"))
    m = Model(fake_rocm)
    g = accel_graph.Graph(device="cuda:0")
    assert g.backend.name == "hip"
    capture(g, m)
    assert len(fake_rocm.graphs) == 2
    for i in range(3):
        m.x.fill_(i)
        g.replay()
        assert torch.equal(m.y, m.eager())
    g.reset()  # hip synchronizes once before dropping the executables
    assert [c for fg in fake_rocm.graphs for c in fg.calls if c[0] == "reset"] == [("reset", True), ("reset", False)]


def test_fake_island_returning_a_static_tensor_of_the_graph_is_refused(cuda: FakeCudaModule) -> None:
    """An output in the graph pool's memory (as torch's snapshot reports its segments) is a
    static tensor of the graph: the caller would get a copy, and writes would miss it."""
    static = torch.ones(4)
    # Behind an object, not in the closure: the held-tensor check would refuse it first.
    holder = type("Holder", (), {"t": static})()

    @accel_graph.eager_island
    def leak(x: torch.Tensor) -> torch.Tensor:
        return holder.t

    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=r"leak.* sharing memory .*static tensor of the graph"):
        with accel_graph.graph(g):
            # FAKE: the tensor made in piece 0 lives in the graph's pool
            cuda.segments.append({"device": 0, "address": static.untyped_storage().data_ptr(),
                                  "total_size": static.untyped_storage().nbytes(),
                                  "allocated_size": 16, "segment_pool_id": cuda.capturing._pool,
                                  "blocks": []})
            leak(torch.zeros(1))
    assert g.state == "empty"
    with accel_graph.graph(g):  # a fresh tensor is fine
        r = accel_graph.eager_island(lambda x: x + 1)(torch.zeros(1))
    assert torch.equal(r, torch.ones(1))
