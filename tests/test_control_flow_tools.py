"""Control flow outside the conformance suite: check_capturable accepts torch.cond,
torch.while_loop and switch (torch 2.14), GraphRunner verifies a step with switch, the bundled decoder's multi-step decode captures and stops on EOS, and eager
torch.cond keeps working after a capture used it (pytorch#163013 work-around)."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops import while_loop

import accel_graph
from accel_graph.models import Decoder, DecoderConfig


def test_check_capturable_accepts_cond_and_while_loop_and_flags_inside_them() -> None:
    def fn(x):
        y = torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))
        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y + 1), (torch.tensor(0), y))

    assert accel_graph.check_capturable(fn, torch.ones(3)).ok

    def bad(x):
        return torch.cond(x.sum() > 0, lambda x: x * x.max().item(), lambda x: x, (x,))

    rep = accel_graph.check_capturable(bad, torch.ones(3))
    assert [f.op for f in rep.findings] == ["aten.item.default"]  # flagged inside the branch


def test_python_if_on_a_tensor_is_still_refused_and_points_at_torch_cond() -> None:
    rep = accel_graph.check_capturable(lambda x: x * 2 if x.sum() > 0 else x, torch.ones(3))
    assert not rep.ok and "torch.cond" in rep.findings[0].reason


def test_eager_cond_works_after_a_capture_used_it() -> None:
    def fn(p, x):
        return torch.cond(p, lambda x: x.sin(), lambda x: x.cos(), (x,))

    x, p = torch.randn(3), torch.tensor(True)
    g = accel_graph.Graph(device="cpu")
    with accel_graph.graph(g):
        out = fn(p, x)
    p.fill_(False)
    g.replay()
    torch.testing.assert_close(out, fn(p, x))  # eager again: compiles as torch intends


@pytest.mark.parametrize("batch", [1, 3])
def test_multi_step_decode_in_one_replay_equals_eager_and_stops_on_eos(batch: int) -> None:
    model = Decoder(DecoderConfig())
    tok = torch.arange(3, 3 + batch)
    pos = torch.zeros(batch, dtype=torch.long)
    with torch.no_grad():
        model.reset_cache()
        want, n_want = model.decode_steps(tok, pos, steps=6)
        g = accel_graph.Graph(device="cpu")
        model.reset_cache()
        with accel_graph.graph(g):
            got, n = model.decode_steps(tok, pos, steps=6)
        model.reset_cache()
        g.replay()
    assert torch.equal(got, want) and int(n) == int(n_want) == 6
    # EOS: every row's first token; the loop stops after one step, at replay, on the device.
    eos = int(want[0, 0])
    if batch == 1:
        with torch.no_grad():
            g2 = accel_graph.Graph(device="cpu")
            with accel_graph.graph(g2):
                got2, n2 = model.decode_steps(tok, pos, steps=6, eos_id=eos)
            model.reset_cache()
            g2.replay()
        assert int(n2) == 1 and int(got2[0, 0]) == eos and (got2[0, 1:] == -1).all()
    with pytest.raises(ValueError, match="positive int"):
        model.decode_steps(tok, pos, steps=0)


# -- switch (torch 2.14's prototype; issue 24 item 8) -------------------------------------------
def _switch_or_skip():
    mod = pytest.importorskip(
        "torch._higher_order_ops.switch",
        reason=f"torch {torch.__version__} has no switch operator (first shipped in torch 2.14)")
    return mod.switch


def test_check_capturable_understands_switch_as_it_does_cond() -> None:
    switch = _switch_or_skip()

    def fn(i, x):
        return switch(i, (lambda x: x * 2, lambda x: x * x.max().item(), lambda x: x - 1), (x,))

    assert accel_graph.check_capturable(fn, torch.tensor(0), torch.ones(3)).ok
    rep = accel_graph.check_capturable(fn, torch.tensor(1), torch.ones(3))
    assert [f.op for f in rep.findings] == ["aten.item.default"]  # flagged inside the branch taken
    # For a CUDA target the recorder captures switch, a CUDA graph cannot: said as a finding.
    rep = accel_graph.check_capturable(fn, torch.tensor(0), torch.ones(3), target="cuda")
    assert any(f.op == "switch" and "switch_node" in f.reason for f in rep.findings)


def test_check_capturable_flags_an_out_of_range_bare_switch_index() -> None:
    _switch_or_skip()
    op = torch.ops.higher_order.switch

    def fn(x):
        return op(torch.tensor(4), (lambda x: x + 1, lambda x: x * 2), (x,))

    with pytest.raises(AssertionError, match="out of range"):  # as eager
        accel_graph.check_capturable(fn, torch.ones(3))


def test_eager_switch_works_after_a_capture_used_it() -> None:
    switch = _switch_or_skip()
    branches = (lambda x: x.sin(), lambda x: x.cos(), lambda x: x.tan())
    x, i = torch.randn(3), torch.tensor(2)
    g = accel_graph.Graph(device="cpu")
    with accel_graph.graph(g):
        out = switch(i, branches, (x,))
    i.fill_(1)
    g.replay()
    torch.testing.assert_close(out, switch(i, branches, (x,)))  # eager again
    torch.testing.assert_close(out, x.cos())


def test_graph_runner_verifies_and_serves_a_step_with_switch() -> None:
    switch = _switch_or_skip()
    w = torch.randn(4, 4)

    def step(x, mode):
        return switch(mode[0], (lambda x: x @ w, lambda x: (x @ w).relu(), lambda x: x * 0 + 1), (x,))

    mode = torch.tensor([1])
    runner = accel_graph.GraphRunner(step, (torch.randn(2, 4), mode), buckets=[2, 4],
                                     batch_dim=(0, None), strict=True).capture()
    for k in (1, 0, 2, 1):
        x = torch.randn(3, 4)
        m = torch.tensor([k])
        torch.testing.assert_close(runner(x, m), step(x, m))
    [b4] = [b for b in runner.stats()["buckets"] if b["bucket"] == 4]
    assert b4["status"] == "captured" and b4["verified"] and b4["replays"] == 4
