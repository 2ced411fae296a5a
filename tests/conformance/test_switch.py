"""``switch`` inside graphs (issue 24 item 8): torch 2.14.1's prototype
``torch._higher_order_ops.switch(index, branches, operands)``, captured by the recorder the way
``torch.cond`` is (N branches as sub-programs, the index read at replay), interpreted and
compiled; native backends refuse it at capture with the reason. Out of range: eager ``switch()``
clamps the index; the bare operator raises, and so does replay (ReplayError), never a wrong
branch. The whole module needs the operator: torch 2.13 has none (skipped with that reason)."""

from __future__ import annotations

import pytest
import torch

from accel_graph import CaptureError, ReplayError
from accel_graph.testing import assert_replay_matches, capture

from ._util import gen, randn

_switch_mod = pytest.importorskip(
    "torch._higher_order_ops.switch",
    reason=f"torch {torch.__version__} has no switch operator (torch._higher_order_ops.switch "
           f"first shipped in torch 2.14)")
switch = _switch_mod.switch
switch_op = torch.ops.higher_order.switch


def _needs_switch(backend) -> None:
    """Native backends refuse switch (no torch has switch-node capture): their refusal is
    test_native_refuses_switch_*; the capture tests run where the backend captures it."""
    support = getattr(backend, "control_flow_support", None)
    why = support().missing("switch") if support is not None else None
    if why:
        pytest.skip(f"{backend.name} cannot capture torch.switch here: {why}")


_BRANCHES = (
    lambda x, w: (x @ w).sin(),
    lambda x, w: (x - w.sum()).cos() * 3,
    lambda x, w: x * 2 + w,
    lambda x, w: -x,
)


def _step(i: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return switch(i, _BRANCHES, (x, w)) + 1


def test_switch_takes_the_branch_the_index_says_at_replay(make_graph, device, backend):
    _needs_switch(backend)
    i = torch.tensor(2, device=device)
    x, w = randn(gen(0), 4, 4, device=device), randn(gen(1), 4, 4, device=device)
    g = make_graph()
    out = capture(g, _step, i, x, w)
    seen = set()
    for k in (0, 1, 2, 3, 3, 1, 0):
        i.fill_(k)
        x.copy_(randn(gen(k + 7), 4, 4, device=device))
        g.replay()
        expected = _step(i, x, w)
        assert_replay_matches(out, expected)
        seen.add(round(float(out.sum()), 3))
    assert len(seen) == 4  # four branches, four different results: not one branch replayed


@pytest.mark.parametrize("index", [7, -3])
def test_out_of_range_index_is_clamped_as_eager_switch_clamps_it(make_graph, device, backend, index):
    _needs_switch(backend)
    i = torch.tensor(1, device=device)
    x, w = randn(gen(2), 4, 4, device=device), randn(gen(3), 4, 4, device=device)
    g = make_graph()
    out = capture(g, _step, i, x, w)
    i.fill_(index)
    g.replay()
    expected = _step(i, x, w)  # eager clamps: the last branch for 7, the first for -3
    assert_replay_matches(out, expected)
    assert_replay_matches(out, _BRANCHES[3 if index > 0 else 0](x, w) + 1)


def test_bare_operator_out_of_range_raises_at_replay(make_graph, device, backend):
    _needs_switch(backend)
    branches = (lambda x: x + 1, lambda x: x * 2, lambda x: x - 3)
    i = torch.tensor(1, device=device)
    x = randn(gen(4), 5, device=device)
    with pytest.raises(AssertionError, match="out of range"):  # eager's operator
        switch_op(torch.tensor(3, device=device), branches, (x,))
    g = make_graph()
    out = capture(g, lambda i, x: switch_op(i, branches, (x,)), i, x)
    i.fill_(2)
    g.replay()
    assert_replay_matches(out, x - 3)
    for bad in (3, -1):
        i.fill_(bad)
        with pytest.raises(ReplayError, match=rf"index is {bad} at replay, out of range for its 3 branches"):
            g.replay()
    i.fill_(0)
    g.replay()  # the graph still works
    assert_replay_matches(out, x + 1)


def test_switch_with_an_index_computed_in_the_graph_and_several_outputs(make_graph, device, backend):
    _needs_switch(backend)

    def fn(x):
        k = (x.sum() > 0).long() + (x.sum() > 10).long()
        return switch(k, (lambda x: (x.clone(), x.sum()), lambda x: (x * 2, x.amax()),
                          lambda x: (x.abs() + 100, x.amin())), (x,))

    x = randn(gen(5), 8, device=device)
    g = make_graph()
    out = capture(g, fn, x)
    for scale in (-1.0, 0.01, 100.0, -1.0):
        x.copy_(x.abs() * scale + (0.01 if scale > 0 else 0))
        g.replay()
        for o, e in zip(out, fn(x)):
            assert_replay_matches(o, e)
    assert out[0].data_ptr() != x.data_ptr()  # outputs are graph memory, not the operand


def test_python_int_index_picks_the_branch_at_capture(make_graph, device, backend):
    _needs_switch(backend)
    x = randn(gen(6), 6, device=device)
    g = make_graph()
    out = capture(g, lambda x: switch(1, (lambda x: x + 1, lambda x: x * 3), (x,)), x)
    x.copy_(randn(gen(7), 6, device=device))
    g.replay()
    assert_replay_matches(out, x * 3)


def test_switch_nested_in_cond(make_graph, device, backend):
    _needs_switch(backend)

    def fn(p, i, x):
        def inner(i, x):
            return switch(i, (lambda x: x + 1, lambda x: x * 5), (x,))

        return torch.cond(p, inner, lambda i, x: x - 7, (i, x))

    p, i = torch.tensor(True, device=device), torch.tensor(0, device=device)
    x = randn(gen(8), 3, device=device)
    g = make_graph()
    out = capture(g, fn, p, i, x)
    for flag, k in ((True, 1), (False, 0), (True, 0), (False, 1)):
        p.fill_(flag)
        i.fill_(k)
        g.replay()
        assert_replay_matches(out, fn(p, i, x))


def test_bad_indices_and_branches_are_refused(make_graph, device, backend):
    _needs_switch(backend)
    x = randn(gen(9), 4, device=device)
    with pytest.raises(CaptureError, match="one-element integer tensor"):
        capture(make_graph(), lambda x: switch_op(torch.tensor(1.0, device=device),
                                                  (lambda x: x + 1, lambda x: x * 2), (x,)), x, warmup=0)
    with pytest.raises(CaptureError, match="switch's branches"):
        capture(make_graph(), lambda x: switch_op(torch.tensor(1, device=device),
                                                  (lambda x: x + 1, lambda x: x[:2] * 2), (x,)), x, warmup=0)
    with pytest.raises(CaptureError, match="index 5 is out of range for 2 branches"):
        capture(make_graph(), lambda x: switch_op(5, (lambda x: x + 1, lambda x: x * 2), (x,)), x, warmup=0)


def test_native_refuses_switch_with_the_reason_and_graphs_survive(make_graph, device, backend):
    support = getattr(backend, "control_flow_support", None)
    if support is None or not support().switch:
        pytest.skip(f"{backend.name} captures torch.switch")
    x = randn(gen(11), 5, device=device)
    before = make_graph()
    doubled = capture(before, lambda x: x * 2, x)
    g = make_graph()
    with pytest.raises(CaptureError, match=r"torch\.switch cannot be captured into .*device='cpu'"):
        capture(g, _step, torch.tensor(1, device=device), x.reshape(5, 1), x.reshape(1, 5), warmup=0)
    before.replay()
    torch.testing.assert_close(doubled, x * 2, rtol=0, atol=0)
