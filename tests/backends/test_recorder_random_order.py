"""Random ops keep eager's draws under compiled replay on every torch (random_order.py): chained
in program order where Inductor does not chain them itself (torch 2.11), refused where they
cannot be chained or where Inductor decomposes them into other draws (2.11's rrelu).

What the draws themselves are is checked end to end by tests/conformance/test_random.py,
test_rng_state.py and test_real_kernels.py (rrelu) in their recorder+inductor cases."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from accel_graph.backends.recorder.capture import Step
from accel_graph.backends.recorder.compiled import random_order
from accel_graph.backends.recorder.compiled.settings import inductor_settings

aten = torch.ops.aten


def _random_graph() -> tuple[fx.Graph, int]:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.randn.default, ([4],), {"device": torch.device("cpu")})
    b = g.call_function(aten.rand.default, ([4],), {"device": torch.device("cpu")})
    c = g.call_function(aten.add.Tensor, (a, x))
    d = g.call_function(aten.randn.default, ([4],), {"device": torch.device("cpu")})
    g.output((b, c, d))
    fx.GraphModule(torch.nn.Module(), g)  # the chaining adds subgraphs to the owning module
    return g, 3


def test_settings_chain_exactly_where_torch_does_not() -> None:
    settings = inductor_settings(False)
    passed = settings.get("post_grad_custom_post_pass")
    if random_order.torch_chains_random_ops():  # torch 2.13+: Inductor's own pass
        assert passed is None
    else:  # torch 2.11: ours, where torch has the means
        assert isinstance(passed, random_order._pass_class()) or random_order.refusal([]) is None
        assert settings["fallback_random"] is True


@pytest.mark.skipif(random_order._preserve_node_ordering() is None,
                    reason="this torch has no preserve_node_ordering (the chaining's means)")
def test_chaining_makes_each_random_op_depend_on_the_one_before() -> None:
    g, n = _random_graph()
    random_order.chain_random_ops(g)
    g.lint()
    chained = [node for node in g.nodes if "control_deps" in str(node.target)]
    assert len(chained) == n - 1  # all but the first wait for the one before


def test_the_pass_composes_with_a_pass_set_before() -> None:
    seen: list[fx.Graph] = []
    user = lambda graph: seen.append(graph)  # noqa: E731
    p = random_order._pass_class()(user)
    g, _ = _random_graph()
    if random_order._preserve_node_ordering() is not None:
        p(g)
        assert seen == [g]
    assert p.uuid()[0] == "accel_graph.chain_random_ops"


def _rrelu_step(training: bool) -> Step:
    x, noise = torch.randn(4), torch.empty(4)
    return Step(aten.rrelu_with_noise.default, "mutate", (x, noise, 0.125, 1 / 3, training), {})


def _randn_step() -> Step:
    return Step(aten.randn.default, "functional", ([4],), {})


def test_rrelu_refused_only_where_inductor_decomposes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random_order, "decomposed_with_other_draws",
                        lambda: frozenset({"rrelu_with_noise_functional"}))
    why = random_order.refusal([_rrelu_step(True)])
    assert why is not None and "rrelu_with_noise_functional" in why and torch.__version__ in why
    assert random_order.refusal([_rrelu_step(False)]) is None  # eval: a leaky ReLU, no draws
    monkeypatch.setattr(random_order, "decomposed_with_other_draws", lambda: frozenset())
    assert random_order.refusal([_rrelu_step(True)]) is None


def test_decomposition_detection_reads_inductor_table() -> None:
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(fallback_random=True):
        decomposed = aten.rrelu_with_noise_functional.default in select_decomp_table()
    assert ("rrelu_with_noise_functional" in random_order.decomposed_with_other_draws()) == decomposed


def test_two_random_ops_refused_where_nothing_can_chain_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random_order, "torch_chains_random_ops", lambda: False)
    monkeypatch.setattr(random_order, "_we_can_chain", lambda: False)
    assert random_order.ordering_settings() == {}
    assert random_order.refusal([_randn_step()]) is None  # one draw: no order to keep
    why = random_order.refusal([_randn_step(), _randn_step()])
    assert why is not None and "2 random ops" in why
