"""Random ops replay too: after ``torch.manual_seed(s)`` a replay draws exactly what eager draws
after the same seed, and every replay draws new numbers, as on CUDA."""

from __future__ import annotations

import pytest
import torch

from accel_graph.testing import assert_bitwise_equal, assert_replay_matches, capture

from ._util import gen, randn

SEED = 1234


def _draws(x):
    dev = x.device
    return (
        torch.randn(4, 8, device=dev),
        torch.rand(16, device=dev),
        torch.randn_like(x),
        torch.empty(8, device=dev).normal_(2.0, 0.5),
        torch.empty(8, device=dev).uniform_(-3.0, 3.0),
        torch.randint(0, 1000, (16,), device=dev),
        x + 0.1 * torch.randn_like(x),  # noise on a static input
    )


def _captured(make_graph, device):
    x = randn(gen(0), 3, 5, device=device)
    g = make_graph()
    return g, capture(g, _draws, x), x


def test_seeded_replay_draws_what_eager_draws(make_graph, device):
    g, out, x = _captured(make_graph, device)
    torch.manual_seed(SEED)
    expected = _draws(x)
    torch.manual_seed(SEED)
    g.replay()
    # The draws themselves are exact in both replay modes: compiled replay calls aten's random
    # kernels (Inductor's fallback_random), so it consumes the generator as eager does.
    assert_bitwise_equal(out[:-1], expected[:-1], msg="draws")
    assert_replay_matches(out[-1], expected[-1], msg="arithmetic on a draw")


def test_consecutive_replays_follow_the_eager_sequence(make_graph, device):
    g, out, x = _captured(make_graph, device)
    torch.manual_seed(SEED)
    first, second = _draws(x), _draws(x)
    torch.manual_seed(SEED)
    g.replay()
    assert_replay_matches(out, first, msg="first replay")
    g.replay()
    assert_replay_matches(out, second, msg="second replay")


def test_consecutive_replays_differ(make_graph, device):
    g, out, x = _captured(make_graph, device)
    g.replay()
    before = [t.clone() for t in out]
    g.replay()
    for i, (a, b) in enumerate(zip(out, before, strict=True)):
        assert not torch.equal(a, b), f"random output {i} drew the same numbers on two replays"


def test_capture_consumes_no_random_numbers(make_graph, backend, device):
    if backend.capabilities().native_graphs:
        pytest.skip("native capture may reserve generator offsets")
    x = randn(gen(0), 3, 5, device=device)
    _draws(x)
    torch.manual_seed(SEED)
    g = make_graph()
    capture(g, _draws, x, warmup=0)
    after_capture = torch.randn(32, device=device)
    torch.manual_seed(SEED)
    assert_bitwise_equal(after_capture, torch.randn(32, device=device))
