"""Compiled control flow on the recorder (issue 18 item 2): under ``compile="inductor"`` every
branch, while predicate and body is an Inductor program of its own (debug_dump says so), a
sub-program Inductor fails on replays interpreted alone with the reason logged, and the values
equal interpreted replay. The conformance set (tests/conformance/test_control_flow.py) runs every
case compiled too; these check what only the recorder's compiled path has."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch._higher_order_ops import while_loop

import accel_graph
from accel_graph.backends.recorder.compiled import choice as compiled_choice
from accel_graph.models import Decoder, DecoderConfig


def _graph(fn, *args, compile=None):
    g = accel_graph.Graph(device="cpu", compile=compile)
    with accel_graph.graph(g):
        out = fn(*args)
    return g, out


def _compiled_info(g, tmp_path) -> dict:
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    return json.loads((tmp_path / "g.dot.json").read_text())["compiled"]


def _swap(a, b):
    def body(i, a, b):
        return i + 1, b.clone(), a.clone()

    return while_loop(lambda i, a, b: i < 3, body, (torch.zeros((), dtype=torch.int64), a, b))


def test_every_sub_program_is_compiled_and_listed(tmp_path):
    a, b = torch.randn(4), torch.arange(4.0)
    g, out = _graph(_swap, a, b, compile="inductor")
    g.replay()
    info = _compiled_info(g, tmp_path)
    [step] = info["control_flow"]
    assert step["op"] == "torch.while_loop"
    assert [s["role"] for s in step["subprograms"]] == ["predicate (cond_fn)", "body"]
    assert all(s["compiled"] and s["backend"] == "inductor" for s in step["subprograms"])
    # The body clones the carries it then overwrites: those reads come from snapshots (below).
    assert step["subprograms"][1]["snapshots"] == 2


def test_a_swap_of_carries_is_not_mixed_up_by_the_compiler():
    """Inductor elides a clone of an input overwritten later in the same program
    (``torch.compile`` of the swap gets it wrong in torch 2.13); snapshots keep it right."""
    a, b = torch.randn(4), torch.arange(4.0)
    g, out = _graph(_swap, a, b, compile="inductor")
    for _ in range(2):
        g.replay()
        assert int(out[0]) == 3
        assert torch.equal(out[1], b) and torch.equal(out[2], a)  # three swaps: swapped


@pytest.mark.parametrize("mode", [None, "inductor"])
def test_a_plain_graph_that_saves_then_overwrites_its_inputs_replays_right(mode):
    """The same compiler trap outside control flow: ``old = a.clone(); a.copy_(b); b.copy_(old)``
    compiled read ``a`` after it was overwritten (both came out equal to ``b``)."""
    def swap(a, b):
        old = a.clone()
        a.copy_(b)
        b.copy_(old)
        kept = torch.empty_like(b)
        kept.copy_(b)  # the other copying form, read before b is overwritten again
        b.mul_(2)
        return kept

    a, b = torch.zeros(4), torch.ones(4)
    g, kept = _graph(swap, a, b, compile=mode)
    for start in (3.0, -1.0):
        a.fill_(start)
        b.fill_(7.0)
        g.replay()
        assert a.tolist() == [7.0] * 4 and b.tolist() == [start * 2] * 4 and kept.tolist() == [start] * 4


def test_a_failing_sub_program_falls_back_alone_with_the_reason(monkeypatch, caplog, tmp_path):
    real = compiled_choice.compile_program

    def refuse_sin(steps, inputs, outputs, pool):
        # Every op of the true branch refused, naming none: its bisection finds no one op to
        # run interpreted (op_islands.py), so the branch falls back whole.
        if any(getattr(s.func, "__name__", "") in ("sin.default", "add.Tensor") for s in steps):
            raise RuntimeError("no sin today")
        return real(steps, inputs, outputs, pool)

    monkeypatch.setattr(compiled_choice, "compile_program", refuse_sin)

    def fn(p, x):
        return torch.cond(p, lambda x: x.sin() + 1, lambda x: x.cos() * 2, (x,)) - 1

    p, x = torch.tensor(True), torch.randn(5)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        g, out = _graph(fn, p, x, compile="inductor")
    assert "failed for the true branch of a torch.cond (RuntimeError: no sin today)" in caplog.text
    subs = _compiled_info(g, tmp_path)["control_flow"][0]["subprograms"]
    assert subs[0] == {"role": "true branch", "compiled": False, "fallback": "RuntimeError: no sin today"}
    assert subs[1]["compiled"] is True
    for flag in (True, False):
        p.fill_(flag)
        g.replay()
        torch.testing.assert_close(out, fn(p, x))


def test_nested_control_flow_is_compiled_at_every_level(tmp_path):
    def fn(x):
        def body(i, x):
            return i + 1, torch.cond(i % 2 == 0, lambda x: x + 1, lambda x: x * 3, (x,))

        return while_loop(lambda i, x: i < 5, body, (torch.tensor(0), x))

    x = torch.randn(3)
    g, out = _graph(fn, x, compile="inductor")
    g.replay()
    torch.testing.assert_close(out[1], fn(x)[1])
    body = _compiled_info(g, tmp_path)["control_flow"][0]["subprograms"][1]
    assert body["compiled"] and [s["compiled"] for s in body["control_flow"][0]["subprograms"]] == [True, True]


@pytest.mark.parametrize("batch,early", [(2, False), (1, True)])
def test_compiled_multi_step_decode_equals_interpreted(batch, early):
    model = Decoder(DecoderConfig(n_layers=1))
    tok, pos = torch.tensor([3, 5][:batch]), torch.zeros(batch, dtype=torch.int64)
    eos_id, stop = None, 4
    if early:  # the token produced at the second step is EOS: the loop stops after it
        with torch.no_grad():
            ref, _ = model.decode_steps(tok.clone(), pos.clone(), steps=4)
        model.reset_cache()
        eos_id = int(ref[0, 1])
        stop = int((ref[0] == eos_id).nonzero()[0]) + 1
        assert stop < 4
    results = []
    for mode in (None, "inductor"):
        with torch.no_grad():
            g, (out, count) = _graph(lambda t, p: model.decode_steps(t, p, steps=4, eos_id=eos_id),
                                     tok, pos, compile=mode)
        model.reset_cache()
        g.replay()
        results.append((out.clone(), int(count)))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] == stop


def _ops(steps) -> list[str]:
    out = []
    for s in steps:
        out.append(str(s.func))
        if s.kind in ("cond", "while"):
            for sub in s.extra[1:]:
                out += _ops(sub)
    return out


@pytest.mark.parametrize("grad", [False, True])
def test_a_loop_body_records_the_ops_the_outer_capture_records(grad):
    """torch's autograd rule runs while_loop with the autograd keys excluded; the body must
    still see composite ops decomposed (``mm``), as the outer capture does, not ``linear`` whole
    (whose ``.out`` kernel re-decomposes at every replay: a decode body ran ~2x slower)."""
    w, x = torch.randn(4, 4), torch.randn(2, 4)
    g = accel_graph.Graph(device="cpu")
    with torch.set_grad_enabled(grad), accel_graph.graph(g):
        outer = torch.nn.functional.linear(x, w).softmax(-1)
        out = while_loop(lambda i, y: i < 2,
                         lambda i, y: (i + 1, torch.nn.functional.linear(y, w).softmax(-1)),
                         (torch.tensor(0), outer))
    ops = _ops(g._impl._frozen_steps)  # the recorded program, sub-programs included
    assert ops.count("aten.mm.default") == 2 and ops.count("aten._softmax.default") == 2, ops
    assert "aten.linear.default" not in ops and "aten.softmax.int" not in ops, ops
    g.replay()
    y = outer
    for _ in range(2):
        y = torch.nn.functional.linear(y, w).softmax(-1)
    torch.testing.assert_close(out[1], y, rtol=0, atol=0)
