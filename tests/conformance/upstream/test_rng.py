"""Upstream RNG tests (``test/test_cuda.py``): random ops inside a capture draw from the
generator at every replay, in sequence with eager draws; generator state inside a capture
(graph-safe states, activation checkpointing's preserved RNG state, ``manual_seed``).

``torch.cuda.manual_seed`` becomes ``torch.manual_seed`` (it seeds every device). Exact
comparisons use :func:`accel_graph.testing.assert_replay_matches`: bitwise under interpreted
replay; under compiled replay the draws are still aten's (Inductor's ``fallback_random``) and
only the arithmetic on them is compared within tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import accel_graph
from accel_graph.testing import assert_replay_matches, capture_stream

from ._common import COMPILED, NEEDS_RNG_STATE, NEEDS_RRELU, seed

_FUNCTIONAL = [
    pytest.param(F.dropout, {"p": 0.1}, id="dropout", marks=COMPILED),
    pytest.param(F.rrelu, {"training": True}, id="rrelu", marks=NEEDS_RRELU),
]


@pytest.mark.parametrize("op,kwargs", _FUNCTIONAL)
def test_graph_rng_functional(make_graph, device, op, kwargs):
    size = 10000
    a = torch.randn((size,), device=device, dtype=torch.float)

    # Control: six applications after one seed.
    seed(5)
    eager_out = a
    for _ in range(6):
        eager_out = op(eager_out, **kwargs)

    graph_in = a.clone()
    g = make_graph()
    with capture_stream(g):
        seed(5)
        g.capture_begin()
        graph_out = graph_in
        for _ in range(2):
            graph_out = op(graph_out, **kwargs)
        g.capture_end()

    # graphed -> eager -> graphed: six applications in all, drawing in the control's order.
    g.replay()
    out = op(graph_out, **kwargs)
    out = op(out, **kwargs)
    graph_in.copy_(out)
    g.replay()
    assert_replay_matches(graph_out, eager_out, msg=f"{op.__name__}: replay follows the seed")

    for s in (6, 128, 9999):
        seed(s)
        graph_in.copy_(a)
        for _ in range(3):
            g.replay()
        # Had replay ignored the new seed it would repeat the previous draws.
        assert not torch.equal(eager_out, graph_out), f"{op.__name__}: seed {s} ignored"

        seed(s)
        for _ in range(3):
            eager_out.copy_(a)
            eager_out = op(eager_out, **kwargs)
            eager_out = op(eager_out, **kwargs)
        assert_replay_matches(graph_out, eager_out, msg=f"{op.__name__}: seed {s}")


def _distribution_cases(size: int, device: torch.device):
    inp = torch.rand((size,), device=device, dtype=torch.float)
    torch_ops = [
        ("bernoulli", (inp.clone(),), {}),
        ("normal", (inp.clone() + 1, 1.0), {}),
        ("poisson", (inp.clone(),), {}),
        ("rand", (size,), {"device": device, "dtype": torch.float}),
        ("randint", (0, 3, (size,)), {"device": device, "dtype": torch.float}),
        ("randn", (size,), {"device": device, "dtype": torch.float}),
    ]
    methods = [
        ("bernoulli_", (inp.clone(),)),
        ("cauchy_", ()),
        ("exponential_", ()),
        ("geometric_", (0.3,)),
        ("log_normal_", ()),
        ("normal_", ()),
        ("random_", ()),
        ("uniform_", ()),
    ]
    return torch_ops, methods


_DISTRIBUTIONS = [f"torch.{n}" for n in ("bernoulli", "normal", "poisson", "rand", "randint", "randn")] + [
    f"Tensor.{n}" for n in ("bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_",
                            "normal_", "random_", "uniform_")
]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=COMPILED) if n == "torch.randn" else n for n in _DISTRIBUTIONS])
def test_graph_rng_distributions(make_graph, device, name):
    size = 10000
    torch_ops, methods = _distribution_cases(size, device)
    alloc = torch.empty((size,), device=device, dtype=torch.float)
    module, op = name.split(".")
    if module == "torch":
        args, kwargs = next((a, k) for n, a, k in torch_ops if n == op)
    else:
        args, kwargs = next(a for n, a in methods if n == op), {}

    def draw(t: torch.Tensor | None = None) -> torch.Tensor:
        """``torch.<op>(...)`` (a new tensor), or ``t.<op>(...)`` in place."""
        if module == "torch":
            return getattr(torch, op)(*args, **kwargs)
        assert t is not None
        getattr(t, op)(*args)
        return t

    seed(5)
    # Each path draws a dummy first, to move the state a bit before the controls.
    if module == "torch":
        dummy, control1, control2 = draw(), draw(), draw()
    else:
        dummy, control1, control2 = alloc.clone(), alloc.clone(), alloc.clone()
        draw(dummy), draw(control1), draw(control2)

    g = make_graph()
    with capture_stream(g):
        seed(5)
        if module == "torch":
            g.capture_begin()
            t1, t2 = draw(), draw()
            g.capture_end()
        else:
            t1, t2 = alloc.clone(), alloc.clone()
            g.capture_begin()
            draw(t1), draw(t2)
            g.capture_end()

    # Capture ran nothing: the outputs do not hold the controls' draws.
    assert not torch.equal(control1, t1) and not torch.equal(control2, t2)

    for s in (6, 314, 271):
        seed(s)
        if module == "torch":
            dummy, control1, control2 = draw(), draw(), draw()
        else:
            draw(dummy), draw(control1), draw(control2)
        seed(s)
        draw(dummy)  # replay must pick up the state after this eager draw
        t1.copy_(alloc)
        t2.copy_(alloc)
        g.replay()
        assert_replay_matches(t1, control1, msg=f"{name} seed {s}: first draw")
        assert_replay_matches(t2, control2, msg=f"{name} seed {s}: second draw")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    mod = getattr(torch, device.type)
    return mod.default_generators[device.index if device.index is not None else mod.current_device()]


@NEEDS_RNG_STATE
def test_graphsafe_set_get_rng_state(make_graph, device):
    def create_states(generator):
        torch.rand(1, device=device)  # the generator exists
        generator.manual_seed(0)
        old_state = generator.graphsafe_get_state()
        new_state = generator.clone_state()
        return generator, old_state, new_state

    def register_states_to_graph(generator_state, graph):
        _, old_state, new_state = generator_state
        graph.register_generator_state(old_state)
        graph.register_generator_state(new_state)

    def perform_random_generation_steps(generator_state):
        generator, old_state, new_state = generator_state
        values = []
        generator.graphsafe_set_state(new_state)
        values.append(torch.rand(5, device=device, generator=generator))
        generator.graphsafe_set_state(old_state)
        values.extend([torch.rand(5, device=device, generator=generator) for _ in range(2)])
        return values

    def final_offsets(generator_state):
        _, old_state, new_state = generator_state
        return old_state.get_offset(), new_state.get_offset()

    generator = torch.Generator(device=device)
    try:
        generator.graphsafe_get_state()
    except NotImplementedError as exc:  # the CPU generator: torch refuses in eager too
        pytest.skip(f"torch's {device.type} generator has no graph-safe state ({exc})")
    generator_state = create_states(generator)

    g = make_graph()
    default_state = create_states(_default_generator(device))
    register_states_to_graph(default_state, g)
    with capture_stream(g):
        g.capture_begin()
        graphed_values = perform_random_generation_steps(default_state)
        g.capture_end()

    for _ in range(3):
        values = perform_random_generation_steps(generator_state)
        g.replay()
        assert final_offsets(generator_state) == final_offsets(default_state)
        for got, want in zip(graphed_values, values, strict=True):
            assert_replay_matches(got, want)


@COMPILED
@NEEDS_RNG_STATE
def test_graph_checkpoint_preserve_rng_state(make_graph, device):
    seed(42)

    def fn(x):
        return x * torch.sigmoid(torch.randn(1, device=device))

    fn(torch.ones(1, device=device))

    seed(42)
    eager_in = torch.ones(1, device=device, requires_grad=True)
    eager_out = checkpoint(fn, eager_in, use_reentrant=False, preserve_rng_state=True)
    (eager_in_grad,) = torch.autograd.grad(eager_out, eager_in)

    g = make_graph()
    with accel_graph.graph(g):
        graph_in = torch.ones(1, device=device, requires_grad=True)
        graph_out = checkpoint(fn, graph_in, use_reentrant=False, preserve_rng_state=True)
        (graph_in_grad,) = torch.autograd.grad(graph_out, graph_in)

    seed(42)
    g.replay()
    assert_replay_matches(graph_in_grad, eager_in_grad, msg="recomputed forward's draw")


@NEEDS_RNG_STATE
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")  # manual_seed only
def test_graph_manual_seed_mismatch_raises(make_graph, device):
    seed(0)
    g = make_graph()
    with pytest.raises(RuntimeError, match=r"seed"):
        with accel_graph.graph(g):
            torch.manual_seed(1)
    assert g.state == "empty"
