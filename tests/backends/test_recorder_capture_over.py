"""A recorder capture that is over never leaves its thread recording (issue 14, items 1-3).

- An illegal op invalidates the capture at the op, as on CUDA: later ops on that thread run
  eagerly with real values, ``capture_end()`` raises ``CaptureError`` naming the op, and the
  graph is empty and reusable.
- A ``Graph`` garbage-collected mid-capture ends its capture.
- ``capture_end()``/``reset()`` from another thread are refused with ``GraphStateError``
  naming the capturing thread; both threads work afterwards.
- Two threads capturing into one shared pool: the second is refused up front with
  ``PoolError``; the pool's books never go negative.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import accel_graph as ag
from accel_graph import CaptureError, GraphStateError, PoolError
from accel_graph.backends import get_backend
from accel_graph.testing import assert_bitwise_equal

CPU = torch.device("cpu")


def _graph(**kwargs) -> ag.Graph:
    return ag.Graph(device="cpu", **kwargs)


def _assert_eager_works(msg: str) -> None:
    """An eager op on this thread gives its real value (a recording thread gives pool memory)."""
    a = torch.arange(6, dtype=torch.float32)
    b = a * 2 + 1
    assert torch.equal(b, torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0, 11.0])), f"{msg}: {b}"
    assert not ag.is_current_stream_capturing("cpu"), f"{msg}: the thread is still capturing"


def _illegal(x: torch.Tensor) -> float:
    return (x * 2).sum().item()


def _run_in_thread(fn) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run, name="accel-graph-test-worker")
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the worker thread hung"
    if errors:
        raise errors[0]


# -- item 1: an illegal op ends the capture -----------------------------------------------------
def test_illegal_op_on_the_raw_api_invalidates_the_capture():
    x = torch.randn(6)
    g = _graph()
    g.capture_begin()
    try:
        with pytest.raises(CaptureError):
            _illegal(x)
        # The helper's caller swallowed the error and goes on: eager values, not pool memory.
        y = x + 1
        assert_bitwise_equal(y, torch.add(x.clone(), 1), msg="an op after the invalidating op")
        _assert_eager_works("after the illegal op, before capture_end")
        with pytest.raises(CaptureError, match=r"invalidated.*_local_scalar_dense"):
            g.capture_end()
    finally:
        if g.state == "capturing":
            g.reset()
    assert g.state == "empty"
    _assert_eager_works("after capture_end")
    assert torch._C._len_torch_dispatch_stack() == 0, "the recording mode was left on the stack"

    # Empty and reusable.
    g.capture_begin()
    out = (x * 3).relu()
    g.capture_end()
    fresh = torch.randn(6)
    x.copy_(fresh)
    g.replay()
    assert_bitwise_equal(out, (fresh * 3).relu(), msg="replay after the invalidated capture")


def test_another_graph_can_capture_after_an_invalidated_capture_that_was_never_ended():
    x = torch.randn(6)
    g = _graph()
    g.capture_begin()
    with pytest.raises(CaptureError):
        _illegal(x)
    h = _graph()
    h.capture_begin()  # refused today: "a capture is already underway on this thread"
    out = x.exp()
    h.capture_end()
    h.replay()
    assert_bitwise_equal(out, x.exp())
    _assert_eager_works("after the second graph's capture")
    with pytest.raises(CaptureError, match="invalidated"):
        g.capture_end()
    assert g.state == "empty"
    assert torch._C._len_torch_dispatch_stack() == 0


def test_reset_after_an_invalidating_op_frees_the_pool_and_the_thread():
    x = torch.randn(6)
    g = _graph()
    g.capture_begin()
    with pytest.raises(CaptureError):
        _illegal(x)
    g.reset()
    assert g.state == "empty"
    _assert_eager_works("after reset")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_context_manager_still_reports_the_original_error():
    x = torch.randn(6)
    g = _graph()
    with pytest.raises(CaptureError, match="_local_scalar_dense") as info:
        with ag.graph(g):
            _illegal(x)
    assert "invalidated" not in str(info.value), "the original error, not capture_end's"
    assert g.state == "empty"
    _assert_eager_works("after the with block")


def test_context_manager_whose_body_swallows_the_error_fails_at_the_end():
    x = torch.randn(6)
    g = _graph()
    with pytest.raises(CaptureError, match="invalidated"):
        with ag.graph(g):
            try:
                _illegal(x)
            except CaptureError:
                pass
            (x + 1).relu()
    assert g.state == "empty"
    _assert_eager_works("after the with block")


def test_pool_is_not_left_capturing_after_an_invalidated_capture():
    pool = ag.graph_pool_handle("cpu")
    x = torch.randn(6)
    g = _graph(pool=pool)
    g.capture_begin()
    (x * 2).relu()
    with pytest.raises(CaptureError):
        _illegal(x)
    p = get_backend("recorder").pool_for(pool)
    assert p.capturing == 0, "the invalidated capture still listens on the pool"
    with pytest.raises(CaptureError):
        g.capture_end()
    assert p.capturing == 0 and p.graphs == 0


def test_graph_collected_mid_capture_ends_its_capture():
    x = torch.randn(6)
    g = _graph()
    g.capture_begin()
    (x * 2).relu()
    del g
    gc.collect()
    _assert_eager_works("after the capturing Graph was collected")
    assert torch._C._len_torch_dispatch_stack() == 0
    h = _graph()
    h.capture_begin()  # refused today: the thread is still recording
    out = x.cos()
    h.capture_end()
    h.replay()
    assert_bitwise_equal(out, x.cos())


# -- item 2: capture_end()/reset() from another thread -------------------------------------------
@pytest.mark.parametrize("call", ["capture_end", "reset"])
def test_ending_a_capture_from_another_thread_is_refused(call):
    x = torch.randn(6)
    g = _graph()
    g.capture_begin()
    try:
        seen: dict[str, BaseException] = {}

        def other() -> None:
            with pytest.raises(GraphStateError, match=threading.current_thread().name) as info:
                getattr(g, call)()
            seen["error"] = info.value
            # This thread's eager ops are untouched.
            _assert_eager_works("the other thread")

        me = threading.current_thread().name
        _run_in_thread(other)
        assert me in str(seen["error"]), "the message should name the capturing thread"
        assert g.state == "capturing"
        # The capturing thread still records and ends its capture normally.
        out = (x * 2).relu()
        g.capture_end()
    finally:
        if g.state == "capturing":
            g.reset()
    _assert_eager_works("the capturing thread after capture_end")
    fresh = torch.randn(6)
    x.copy_(fresh)
    g.replay()
    assert_bitwise_equal(out, (fresh * 2).relu(), msg="replay of the capture ended normally")


def test_graph_collected_on_another_thread_mid_capture_leaves_the_capturing_thread_eager():
    """Cyclic garbage is collected by whichever thread runs the collector."""
    x = torch.randn(6)
    box: dict[str, object] = {}

    class Cycle:
        pass

    holder = Cycle()
    holder.self = holder  # type: ignore[attr-defined]
    holder.graph = _graph()  # type: ignore[attr-defined]
    holder.graph.capture_begin()  # type: ignore[attr-defined]
    box["ref"] = holder
    del holder
    gc.disable()
    try:
        box.clear()

        def collect() -> None:
            gc.collect()

        _run_in_thread(collect)
    finally:
        gc.enable()
    _assert_eager_works("the capturing thread after its Graph was collected elsewhere")
    assert_bitwise_equal(x + 1, torch.add(x.clone(), 1))
    h = _graph()
    h.capture_begin()
    out = x.sin()
    h.capture_end()
    h.replay()
    assert_bitwise_equal(out, x.sin())
    assert torch._C._len_torch_dispatch_stack() == 0


# -- item 3: two threads capturing into one shared pool ------------------------------------------
def test_two_threads_capturing_into_one_pool_second_is_refused():
    pool = ag.graph_pool_handle("cpu")
    x = torch.randn(6)
    g = _graph(pool=pool)
    g.capture_begin()
    try:
        a = (x * 2).relu()

        def second() -> None:
            h = _graph(pool=pool)
            with pytest.raises(PoolError, match="one at a time"):
                h.capture_begin()
            assert h.state == "empty"
            _assert_eager_works("the refused thread")

        _run_in_thread(second)
        g.capture_end()
    finally:
        if g.state == "capturing":
            g.reset()
    p = get_backend("recorder").pool_for(pool)
    assert p.capturing == 0 and p.graphs == 1
    g.replay()
    assert_bitwise_equal(a, (x * 2).relu())

    # Once the first capture is over another thread captures into the pool.
    results: dict[str, object] = {}

    def third() -> None:
        h = _graph(pool=pool)
        h.capture_begin()
        results["out"] = x.exp()
        h.capture_end()
        results["g"] = h

    _run_in_thread(third)
    results["g"].replay()  # type: ignore[attr-defined]
    assert_bitwise_equal(results["out"], x.exp())
    assert p.capturing == 0 and p.graphs == 2


def test_end_capture_removes_its_own_log_by_identity():
    from accel_graph.backends.recorder.pool import make_pool

    p = make_pool(CPU)
    first: list = []
    p.begin_capture(first)
    p.end_capture(first)
    second: list = []
    p.begin_capture(second)
    p.end_capture([])  # an equal but foreign log: not this pool's capture
    assert p.capturing == 1
    p.end_capture(second)
    p.end_capture(second)  # ending twice is harmless
    assert p.capturing == 0
