"""A capture records only its own thread: other threads keep running eagerly, untouched."""

from __future__ import annotations

import threading

import torch

import accel_graph
from accel_graph.testing import assert_bitwise_equal, assert_replay_matches

from ._util import gen, randn


def _new_stream(device: torch.device) -> object | None:
    """A fresh stream on accelerators (None on the CPU): each thread's work, eager or captured,
    must stay off other threads' capturing streams and off the legacy default stream."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).Stream(device=device)


def test_other_thread_runs_eagerly_during_capture(make_graph, backend, device):
    x = randn(gen(0), 6, device=device)
    u, v = randn(gen(1), 4, 5, device=device), randn(gen(2), 5, 3, device=device)
    expected_b = (u @ v).relu()
    counter = torch.zeros(1, device=device)
    started, finished = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_b() -> None:
        try:
            started.wait(timeout=30)
            with backend.stream_context(_new_stream(device)):
                seen["capturing"] = accel_graph.is_current_stream_capturing(device)
                z = (u @ v).relu()
                counter.add_(1)
                # Real values, right now: these reads would be illegal inside a capture.
                seen["z_equal"] = torch.equal(z, expected_b)
                seen["counter"] = counter.item()
                seen["z"] = z
        except BaseException as exc:  # re-raised in the main thread
            seen["error"] = exc
        finally:
            finished.set()

    (x * 2 + 1).tanh()
    worker = threading.Thread(target=thread_b)
    worker.start()
    g = make_graph()
    with accel_graph.graph(g, capture_error_mode="thread_local"):
        y = x * 2
        started.set()
        assert finished.wait(timeout=60), "thread B did not finish"
        assert accel_graph.is_current_stream_capturing(device)
        out = (y + 1).tanh()
    worker.join(timeout=30)
    if "error" in seen:
        raise seen["error"]  # type: ignore[misc]
    assert seen["capturing"] is False, "is_current_stream_capturing was True in the other thread"
    assert seen["z_equal"] is True and seen["counter"] == 1.0
    assert_bitwise_equal(seen["z"], expected_b, msg="thread B's result after the capture")

    for r in range(1, 3):
        fresh = randn(gen(10 + r), 6, device=device)
        x.copy_(fresh)
        g.replay()
        assert_replay_matches(out, (fresh * 2 + 1).tanh(), msg=f"replay {r}")
    assert counter.item() == 1.0, "thread B's in-place op was recorded into the graph"


def test_capture_in_a_worker_thread(make_graph, backend, device):
    """The capturing thread need not be the main thread; the main thread stays eager."""
    x = randn(gen(0), 6, device=device)
    result: dict[str, object] = {}
    in_capture, main_done = threading.Event(), threading.Event()

    def capture_thread() -> None:
        try:
            g = make_graph()
            (x - 1).exp()
            with accel_graph.graph(g, capture_error_mode="thread_local"):
                out = (x - 1).exp()
                in_capture.set()
                main_done.wait(timeout=60)
            result["g"], result["out"] = g, out
        except BaseException as exc:
            result["error"] = exc
        finally:
            in_capture.set()

    worker = threading.Thread(target=capture_thread)
    worker.start()
    assert in_capture.wait(timeout=60)
    with backend.stream_context(_new_stream(device)):
        assert not accel_graph.is_current_stream_capturing(device)
        eager = (x + 5).sum()
        assert eager.item() == float((x + 5).sum())
    main_done.set()
    worker.join(timeout=60)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    g, out = result["g"], result["out"]
    fresh = randn(gen(3), 6, device=device)
    x.copy_(fresh)
    g.replay()  # type: ignore[attr-defined]
    assert_replay_matches(out, (fresh - 1).exp())


def test_replay_from_another_thread(make_graph, backend, device):
    """Servers capture at start-up and replay from worker threads."""
    x = randn(gen(0), 6, device=device)
    (x * x).sin()
    g = make_graph()
    with accel_graph.graph(g):
        out = (x * x).sin()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with backend.stream_context(_new_stream(device)):
                for r in range(1, 4):
                    fresh = randn(gen(r), 6, device=device)
                    x.copy_(fresh)
                    g.replay()
                    assert_replay_matches(out, (fresh * fresh).sin(), msg=f"replay {r} in a worker")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=60)
    if errors:
        raise errors[0]


def test_two_threads_capture_at_once(make_graph, device):
    """Each capture records only its own thread, even when two run at the same time."""
    fns = {"a": lambda x: (x * 3).cos(), "b": lambda x: (x - 2).abs().sqrt()}
    inputs = {k: randn(gen(i), 6, device=device) for i, k in enumerate(fns)}
    barrier = threading.Barrier(2, timeout=60)
    results: dict[str, object] = {}

    def run(key: str) -> None:
        try:
            fn, x = fns[key], inputs[key]
            fn(x)
            g = make_graph()
            stream = _new_stream(device)  # concurrent captures need a stream each
            with accel_graph.graph(g, stream=stream, capture_error_mode="thread_local"):
                barrier.wait()  # both captures are underway
                out = fn(x)
                barrier.wait()
            results[key] = (g, out)
        except BaseException as exc:
            results[key + "_error"] = exc
            barrier.abort()

    workers = [threading.Thread(target=run, args=(k,)) for k in fns]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    for key in fns:
        if key + "_error" in results:
            raise results[key + "_error"]  # type: ignore[misc]
    for r, key in enumerate(fns, start=1):
        g, out = results[key]  # type: ignore[misc]
        fresh = randn(gen(10 + r), 6, device=device)
        inputs[key].copy_(fresh)
        g.replay()
        assert_replay_matches(out, fns[key](fresh), msg=f"graph {key}")
