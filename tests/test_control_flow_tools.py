"""Control flow outside the conformance suite: check_capturable accepts torch.cond and
torch.while_loop, the bundled decoder's multi-step decode captures and stops on EOS, and eager
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
