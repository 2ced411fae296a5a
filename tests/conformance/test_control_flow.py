"""Control flow inside graphs (issue 18): ``torch.cond`` and ``torch.while_loop`` captured as
sub-programs whose predicate is read at replay, so a replay with other data takes the other
branch or runs another number of iterations, exactly as eager does."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops import while_loop

from accel_graph import CaptureError
from accel_graph.testing import assert_replay_matches, capture

from ._util import gen, randn

# Compiled replay (the recorder+inductor cases) compiles every branch, predicate and body as a
# program of its own, the loop and branch choice on the host: no fallback is expected here.


def _needs(backend, op: str) -> None:
    """Native backends capture what torch's node capture gives them (docs/backends.md "Control
    flow inside native graphs"): skip, naming what is missing, where it gives none for ``op``;
    test_native_refusal_* checks the refusal itself."""
    support = getattr(backend, "control_flow_support", None)
    why = support().missing(op) if support is not None else None
    if why:
        pytest.skip(f"{backend.name} cannot capture torch.{op} here: {why}")


def _cond_step(p: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.cond(p, lambda x, w: (x @ w).sin(), lambda x, w: (x - w.sum()).cos() * 3, (x, w))
    return y + 1


def test_cond_takes_the_branch_the_predicate_says_at_replay(make_graph, device, backend):
    _needs(backend, "cond")
    p = torch.tensor(True, device=device)
    x, w = randn(gen(0), 4, 4, device=device), randn(gen(1), 4, 4, device=device)
    g = make_graph()
    out = capture(g, _cond_step, p, x, w)
    for flag in (True, False, False, True):
        p.fill_(flag)
        x.copy_(randn(gen(int(flag) + 7), 4, 4, device=device))
        g.replay()
        assert_replay_matches(out, _cond_step(p, x, w))


def test_cond_with_a_predicate_computed_in_the_graph(make_graph, device, backend):
    _needs(backend, "cond")
    def fn(x):
        return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x.abs() + 100, (x,))

    x = randn(gen(2), 8, device=device)
    g = make_graph()
    out = capture(g, fn, x)
    for sign in (1.0, -1.0, 1.0):
        x.copy_(x.abs() * sign)
        g.replay()
        assert_replay_matches(out, fn(x))


def test_cond_with_several_outputs(make_graph, device, backend):
    _needs(backend, "cond")
    # (torch.cond refuses branches that return an operand itself: "Higher order ops do not
    # support aliasing"; a view or clone is fine.)
    def fn(p, a, b):
        return torch.cond(p, lambda a, b: (a.clone(), b + 1), lambda a, b: (b * 1, a * 2), (a, b))

    p = torch.tensor(False, device=device)
    a, b = randn(gen(3), 3, device=device), randn(gen(4), 3, device=device)
    g = make_graph()
    out = capture(g, fn, p, a, b)
    for flag in (False, True):
        p.fill_(flag)
        g.replay()
        for o, e in zip(out, fn(p, a, b)):
            assert_replay_matches(o, e)
    assert out[0].data_ptr() != a.data_ptr()  # outputs are graph memory, not the operand


def _count_to(limit: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return while_loop(lambda i, x: i < limit, lambda i, x: (i + 1, x * 2 + i), (torch.zeros_like(limit), x))


@pytest.mark.parametrize("iterations", [0, 1, 7])
def test_while_loop_runs_as_many_iterations_as_the_data_says(make_graph, device, iterations, backend):
    _needs(backend, "while_loop")
    limit = torch.tensor(3, device=device)
    x = randn(gen(5), 5, device=device)
    g = make_graph()
    i_out, x_out = capture(g, _count_to, limit, x)
    limit.fill_(iterations)
    g.replay()
    i_e, x_e = _count_to(limit, x)
    assert int(i_out) == iterations == int(i_e)
    assert_replay_matches(x_out, x_e)


def test_while_loop_carries_several_dtypes_and_swaps_carries(make_graph, device, backend):
    _needs(backend, "while_loop")
    def fn(a, b, n):
        def body(i, a, b, n):
            return i + 1, b.clone(), a.clone(), n.logical_not()  # a swap (torch refuses returning a carry itself)

        return while_loop(lambda i, a, b, n: i < 3, body, (torch.zeros((), dtype=torch.int64, device=device), a, b, n))

    a = randn(gen(6), 4, device=device)
    b = torch.arange(4, device=device).float()
    n = torch.tensor([True, False], device=device)
    g = make_graph()
    out = capture(g, fn, a, b, n)
    g.replay()
    for o, e in zip(out, fn(a, b, n)):
        assert_replay_matches(o, e)
    assert out[3].dtype == torch.bool


def test_while_loop_body_writes_a_captured_input_and_exits_early(make_graph, device, backend):
    """torch's eager while_loop refuses a body that mutates a captured tensor (its compile
    path forbids input mutation); the recorder records the write like any in-place op, so the
    reference here is the same loop in Python."""
    _needs(backend, "while_loop")
    acc = torch.zeros(4, device=device)
    stop = torch.tensor(100.0, device=device)

    def body(i, x):
        acc.add_(x)  # a captured input, written every iteration
        return i + 1, x * 2

    def cond(i, x):
        return (i < 10) & (x.sum() < stop)

    def reference(x):
        i = torch.tensor(0, device=device)
        while bool(cond(i, x)):
            i, x = body(i, x)
        return i, x

    x = torch.ones(4, device=device)
    g = make_graph()
    out = capture(g, lambda x: while_loop(cond, body, (torch.tensor(0, device=device), x)), x, warmup=0)
    for threshold in (100.0, 10.0, 1e9):
        stop.fill_(threshold)
        acc.zero_()
        g.replay()
        got_acc = acc.clone()
        acc.zero_()
        expected = reference(x)
        assert_replay_matches(got_acc, acc)
        assert_replay_matches(out[1], expected[1])
        assert int(out[0]) == int(expected[0])
    assert int(out[0]) == 10  # threshold 1e9: the bound, not the data, stopped it


def test_nested_cond_inside_while_loop(make_graph, device, backend):
    _needs(backend, "while_loop")
    def fn(x):
        def body(i, x):
            x = torch.cond(i % 2 == 0, lambda x: x + 1, lambda x: x * 3, (x,))
            return i + 1, x

        return while_loop(lambda i, x: i < 5, body, (torch.tensor(0, device=device), x))

    x = randn(gen(7), 3, device=device)
    g = make_graph()
    out = capture(g, fn, x)
    g.replay()
    assert_replay_matches(out[1], fn(x)[1])


def test_bad_predicates_and_branches_are_refused(make_graph, device, backend):
    _needs(backend, "cond")
    x = randn(gen(8), 4, device=device)
    cases = [
        # torch checks the predicate itself before the capture sees it (its error, its type).
        (lambda x: torch.cond(x > 0, lambda x: x * 1, lambda x: -x, (x,)), "single-element tensor"),
        (lambda x: torch.cond(x.sum() > 0, lambda x: x * 1, lambda x: x[:2] * 1, (x,)), "same shape"),
        # On native backends eager torch.cond's TorchDynamo pass checks dtypes first (torch's words).
        (lambda x: torch.cond(x.sum() > 0, lambda x: x * 1, lambda x: x.double(), (x,)),
         "same shape, dtype|expected same dtype"),
    ]
    if not (getattr(backend, "control_flow_support", None) and backend.control_flow_support().while_loop):
        cases.append((lambda x: while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x[:2]),
                                           (torch.tensor(0, device=device), x)), "same shape|aliasing"))
    for fn, match in cases:
        g = make_graph()
        with pytest.raises((CaptureError, RuntimeError), match=match):
            capture(g, fn, x, warmup=0)
    # A graph captured before keeps working.
    m = randn(gen(10), 4, 4, device=device)
    g = make_graph()
    out = capture(g, _cond_step, torch.tensor(True, device=device), m, m)
    g.replay()
    assert_replay_matches(out, _cond_step(torch.tensor(True, device=device), m, m))


def test_python_branch_on_a_tensor_points_at_torch_cond(make_graph, device):
    def fn(x):
        return x * 2 if x.sum() > 0 else x

    g = make_graph()
    with pytest.raises(CaptureError, match="torch.cond"):
        capture(g, fn, randn(gen(9), 4, device=device), warmup=0)


def test_native_refusal_names_what_is_missing_and_graphs_survive(make_graph, device, backend):
    """Where a native backend cannot capture torch.while_loop (torch 2.13 CUDA, ROCm, XPU), the
    capture raises CaptureError naming what is missing and pointing at the recorder; the
    graphs captured before keep replaying and the next capture works."""
    support = getattr(backend, "control_flow_support", None)
    if support is None or not support().while_loop:
        pytest.skip(f"{backend.name} captures torch.while_loop")
    x = randn(gen(11), 5, device=device)
    before = make_graph()
    doubled = capture(before, lambda x: x * 2, x)
    g = make_graph()
    with pytest.raises(CaptureError, match=r"torch\.while_loop cannot be captured into .*device='cpu'"):
        capture(g, _count_to, torch.tensor(3, device=device), x, warmup=0)
    x.copy_(randn(gen(12), 5, device=device))
    before.replay()
    torch.testing.assert_close(doubled, x * 2, rtol=0, atol=0)
    out = capture(g, lambda x: x + 1, x)
    g.replay()
    torch.testing.assert_close(out, x + 1, rtol=0, atol=0)
