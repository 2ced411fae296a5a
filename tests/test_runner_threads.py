"""GraphRunner shared by threads (issue 29, item 2): never a silent wrong result, never a raw
exception. Calls are serialised; with copy_outputs=True threads share the runner and each gets
its own copy; with copy_outputs=False a second thread is refused with AccelGraphError."""

from __future__ import annotations

import threading

import pytest
import torch

import accel_graph as ag
from accel_graph.errors import AccelGraphError


def _fn(w: torch.Tensor):
    return lambda x: (x @ w).relu() + 1


def _hammer(runner, fn, threads: int = 4, calls: int = 60) -> tuple[int, list[str], int]:
    """(wrong results, raw exceptions, refusals) of ``threads`` threads calling ``runner``."""
    wrong, raw, refused = [], [], []
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        gen = torch.Generator().manual_seed(k)
        start.wait()
        for i in range(calls):
            x = torch.randn(1 + (i + k) % 4, 8, generator=gen)
            try:
                out = runner(x)
            except AccelGraphError:
                refused.append(1)
                continue
            except Exception as exc:  # noqa: BLE001 - what the test is about
                raw.append(repr(exc))
                continue
            if not torch.allclose(out, fn(x), atol=1e-6):
                wrong.append(1)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    return len(wrong), raw, len(refused)


@pytest.mark.parametrize("capture", ["eager", "lazy"])
def test_threads_share_a_copying_runner_without_wrong_results(capture: str) -> None:
    torch.manual_seed(0)
    fn = _fn(torch.randn(8, 8))
    r = ag.GraphRunner(fn, (torch.randn(4, 8),), max_batch=4, device="cpu", copy_outputs=True,
                       capture=capture, verify=False)
    if capture == "eager":
        r.capture()
    wrong, raw, refused = _hammer(r, fn)
    assert (wrong, raw, refused) == (0, [], 0)


@pytest.mark.parametrize("capture", ["eager", "lazy"])
def test_view_returning_runner_refuses_a_second_thread(capture: str) -> None:
    torch.manual_seed(0)
    fn = _fn(torch.randn(8, 8))
    r = ag.GraphRunner(fn, (torch.randn(4, 8),), max_batch=4, device="cpu", capture=capture,
                       verify=False)
    if capture == "eager":
        r.capture()
    x = torch.randn(2, 8)
    assert torch.allclose(r(x), fn(x))  # the main thread is the one it serves now
    wrong, raw, refused = _hammer(r, fn)
    assert (wrong, raw) == (0, [])
    assert refused == 4 * 60
    with pytest.raises(AccelGraphError, match="copy_outputs=True"):
        t_err: list[BaseException] = []
        t = threading.Thread(target=lambda: _catch(t_err, r, x))
        t.start()
        t.join()
        raise t_err[0]
    r.copy_outputs = True  # the way out the message names
    assert _hammer(r, fn, calls=10) == (0, [], 0)


def test_a_dead_thread_hands_the_runner_on() -> None:
    fn = _fn(torch.randn(8, 8))
    r = ag.GraphRunner(fn, (torch.randn(4, 8),), max_batch=4, device="cpu", verify=False).capture()
    x = torch.randn(3, 8)
    out: list = []
    t = threading.Thread(target=lambda: out.append(r(x).clone()))
    t.start()
    t.join()
    assert torch.allclose(out[0], fn(x))
    assert torch.allclose(r(x), fn(x))  # that thread is gone: this one may serve now


def test_a_runner_called_from_its_own_fn_raises_instead_of_deadlocking() -> None:
    holder: list = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if holder:
            holder[0](x)
        return x + 1

    r = ag.GraphRunner(fn, (torch.randn(4, 8),), max_batch=4, device="cpu", verify=False)
    holder.append(r)
    with pytest.raises(AccelGraphError, match="inside a call of the same runner"):
        r(torch.randn(8, 8))  # above the largest bucket: fn runs eagerly, and calls r


def _catch(box: list, r, x) -> None:
    try:
        r(x)
    except BaseException as exc:  # noqa: BLE001
        box.append(exc)


def test_a_reused_thread_ident_does_not_let_two_threads_share_views() -> None:
    """The OS reuses a dead thread's ident for the next thread it starts. The served thread is
    tracked by Thread object: a new thread with the dead one's ident is a new thread (found by
    the state-machine fuzz test: two threads were served at once, one read the other's outputs)."""
    fn = _fn(torch.randn(8, 8))
    r = ag.GraphRunner(fn, (torch.randn(4, 8),), max_batch=4, device="cpu", verify=False).capture()
    a_may_call, b_done, a_done = threading.Event(), threading.Event(), threading.Event()
    errors: list = []

    def a() -> None:
        ghost = threading.Thread(target=lambda: None)  # never started: not alive
        ghost._ident = threading.get_ident()  # a dead thread that had this thread's ident
        r._guard._bound = ghost
        r(torch.randn(2, 8))  # served: it takes over from the dead thread
        a_may_call.set()
        b_done.wait(timeout=30)
        a_done.set()

    def b() -> None:
        a_may_call.wait(timeout=30)
        _catch(errors, r, torch.randn(2, 8))  # a is alive and holds views: refused
        b_done.set()

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert a_done.is_set()
    assert len(errors) == 1 and isinstance(errors[0], AccelGraphError), errors
