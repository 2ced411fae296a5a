"""Two tensor objects over the same elements, one written in place and the other read after the
write: replay (interpreted and compiled) reads the written value, as eager does.

Compiled replay once made them two Inductor placeholders and read the stale value
([3, 6, 9, 12] where eager gives [1, 4, 7, 10]).
"""

from __future__ import annotations

import torch

from accel_graph.testing import assert_replay_matches, capture


def _step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = b * 2
    a.add_(1)
    return c + b


def test_two_equal_views_written_and_read(make_graph, device) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Inductor's single-thread code is where the stale read showed
    try:
        _check(make_graph, device)
    finally:
        torch.set_num_threads(threads)


def _check(make_graph, device) -> None:
    z = torch.zeros(8, device=device)
    a, b = z[:4], z[:4]  # two view objects kept alive, both captured by reference
    g = make_graph()
    out = capture(g, _step, a, b, warmup=0)
    for r in range(3):
        z[:4].copy_(torch.arange(4.0, device=device) + r)
        g.replay()
        ref = torch.zeros(8, device=device)
        ref[:4].copy_(torch.arange(4.0, device=device) + r)
        want = _step(ref[:4], ref[:4])
        assert_replay_matches(out, want, msg=f"replay {r}")
        assert_replay_matches(z, ref, msg=f"replay {r}: the written input")
