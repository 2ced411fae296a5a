"""``accel_graph.make_graphed_callables`` gives eager's forward and backward, with torch's
semantics: modules and functions, a tuple of callables sharing one pool in a training loop with
the optimizer step outside the graphs, the eval and no-grad paths, recurrent layers.

Every comparison is with the same computation run eagerly on the same values: bitwise under
interpreted replay, within the per-dtype tolerances under compiled replay (``+inductor``).
On native backends the call goes to torch's own ``make_graphed_callables``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel_graph
from accel_graph.testing import assert_replay_matches

from ._util import gen, randn
from .models import MLP, build


@pytest.fixture
def interpreted_only(accel_graph_compile):
    """Compiled replay is covered by the module and tuple-of-callables tests; every further
    compiled case costs Inductor about 10 s a graph (a forward and a backward per callable)."""
    if accel_graph_compile is not None:
        pytest.skip("compiled replay of graphed callables is covered by the module and tuple tests")


def _trainable(cls: type[nn.Module], device: torch.device, *args: object, **kw: object) -> nn.Module:
    return build(cls, device, *args, **kw).train().requires_grad_(True)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in m.parameters()]


def test_module_forward_backward_matches_eager(device):
    graphed, eager = _trainable(MLP, device), _trainable(MLP, device)
    out = accel_graph.make_graphed_callables(graphed, (_leaf(randn(gen(0), 4, 16, device=device)),))
    assert out is graphed, "a module comes back as itself, with its forward replaced"
    for r in range(1, 4):
        x = randn(gen(r), 4, 16, device=device)
        xg, xe = _leaf(x), _leaf(x)
        yg, ye = graphed(xg), eager(xe)
        assert yg.requires_grad and yg.grad_fn is not None
        grad = randn(gen(100 + r), *ye.shape, device=device)
        yg.backward(grad)
        ye.backward(grad)
        assert_replay_matches(yg.detach(), ye.detach(), msg=f"output {r}")
        assert_replay_matches(xg.grad, xe.grad, msg=f"input grad {r}")
        assert_replay_matches(_grads(graphed), _grads(eager), msg=f"parameter grads {r}")
        graphed.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def test_function_with_nested_args_and_outputs(device, interpreted_only):
    """A plain function: arguments and outputs are flattened (dicts, tuples), as in torch."""

    def fn(inputs, w):
        h = inputs["x"] @ w
        return {"act": torch.tanh(h), "pair": (h.sum(-1), inputs["y"] * 2)}

    x, w = randn(gen(0), 3, 5, device=device), randn(gen(1), 5, 4, device=device)
    y = randn(gen(2), 3, device=device)
    graphed = accel_graph.make_graphed_callables(fn, ({"x": _leaf(x), "y": y}, _leaf(w)))
    for r in range(1, 4):
        x, w = randn(gen(10 + r), 3, 5, device=device), randn(gen(20 + r), 5, 4, device=device)
        y = randn(gen(30 + r), 3, device=device)
        ins_g, ins_e = ({"x": _leaf(x), "y": y}, _leaf(w)), ({"x": _leaf(x), "y": y}, _leaf(w))
        og, oe = graphed(*ins_g), fn(*ins_e)
        assert not og["pair"][1].requires_grad, "an output of inputs without grad needs none"
        for o in (og, oe):
            (o["act"].square().sum() + o["pair"][0].sum()).backward()
        assert_replay_matches(og, oe, msg=f"outputs {r}")
        assert_replay_matches([ins_g[0]["x"].grad, ins_g[1].grad],
                              [ins_e[0]["x"].grad, ins_e[1].grad], msg=f"grads {r}")


class _Part1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(p=0.1))

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.net(inputs["x"])


class _Part2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 8), nn.Dropout(p=0.2))

    def forward(self, h: torch.Tensor) -> dict:
        return {"output": self.net(h)}


# aten's mse_loss.out (how the recorder replays mse_loss) warns that it resized its 0-dim
# output to the input's shape; its result is right (an aten quirk, not a wrong replay).
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_tuple_of_callables_trains_like_eager(device):
    """torch's test_graph_make_graphed_callables, restated: two modules (dropout included), a
    function and a loss graphed together into one pool, an unused input allowed, ten SGD
    steps with the step outside the graphs, equal to eager training; eval runs ungraphed."""
    graphed = nn.Sequential(_trainable(_Part1, device), _trainable(_Part2, device))
    control = copy.deepcopy(graphed)
    x = randn(gen(0), 4, 16, device=device)
    unused = _leaf(randn(gen(1), 4, 16, device=device))
    h, y_pred = _leaf(randn(gen(2), 4, 32, device=device)), _leaf(randn(gen(3), 4, 8, device=device))
    y = randn(gen(4), 4, 8, device=device)
    pool = accel_graph.graph_pool_handle(device)
    graphed[0], graphed[1], relu_g, loss_g = accel_graph.make_graphed_callables(
        (graphed[0], graphed[1], F.relu, F.mse_loss),
        (({"x": x, "unused": unused},), (h,), (y_pred,), (y_pred, y)),
        allow_unused_input=True,
        pool=pool,
    )
    data = [randn(gen(10 + i), 4, 16, device=device) for i in range(10)]
    targets = [randn(gen(30 + i), 4, 8, device=device) for i in range(10)]
    losses = {}
    for name, model, relu, loss_fn in (("graphed", graphed, relu_g, loss_g),
                                       ("control", control, F.relu, F.mse_loss)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # Same seed for both: dropout draws the same masks eagerly and at replay.
        torch.manual_seed(5)
        losses[name] = []
        for d, t in zip(data, targets, strict=True):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(relu(model({"x": d, "unused": unused})["output"]), t)
            loss.backward()
            opt.step()
            losses[name].append(loss.detach().clone())
    assert_replay_matches(losses["graphed"], losses["control"], msg="losses")
    assert_replay_matches(list(graphed.parameters()), list(control.parameters()), msg="weights")
    graphed.eval()
    control.eval()
    with torch.no_grad():
        assert_replay_matches(graphed({"x": data[0]}), control({"x": data[0]}), msg="eval")


def test_shared_pool_across_calls(device, backend, interpreted_only):
    """torch's test_graph_make_graphed_callables_same_pool: separate calls share one pool."""
    pool = accel_graph.graph_pool_handle(device)
    models = [_trainable(MLP, device, seed=s) for s in range(3)]
    graphed = []
    for m in models:
        g = copy.deepcopy(m)
        graphed.append(accel_graph.make_graphed_callables(g, (randn(gen(0), 4, 16, device=device),),
                                                          pool=pool))
    stats = backend.pool_stats(pool)
    if stats is not None:
        # A forward and a backward graph per model, all in the one pool.
        assert stats.graphs == 2 * len(models) and stats.reserved_bytes > 0
    for i, (m, g) in enumerate(zip(models, graphed, strict=True)):
        x = randn(gen(10 + i), 4, 16, device=device)
        ye, yg = m(x), g(x)
        ye.norm().backward()
        yg.norm().backward()
        assert_replay_matches(yg, ye, msg=f"model {i} output")
        for p, pg in zip(m.parameters(), g.parameters(), strict=True):
            assert_replay_matches(pg.grad, p.grad, msg=f"model {i} grads")
            assert p.grad.data_ptr() != pg.grad.data_ptr()


def test_gradient_accumulation_over_micro_batches(device, interpreted_only):
    """Backward twice without zero_grad: each parameter's .grad must be the sum of both
    gradients. (A .grad that aliased the static gradient buffer would be overwritten by the
    second replay and doubled.)"""
    graphed, eager = _trainable(MLP, device), _trainable(MLP, device)
    accel_graph.make_graphed_callables(graphed, (randn(gen(0), 4, 16, device=device),))
    for r in range(1, 4):
        x = randn(gen(r), 4, 16, device=device)
        graphed(x).sum().backward()
        eager(x).sum().backward()
    assert_replay_matches(_grads(graphed), _grads(eager), msg="accumulated grads")


@pytest.mark.parametrize("captured_training", [True, False], ids=["train", "eval"])
def test_other_mode_runs_the_original_forward(device, captured_training, interpreted_only):
    """The graphs hold the train-or-eval behaviour of capture time; the other mode runs eagerly."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(p=0.5)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1  # Python side effect: runs at capture and on eager calls only
            return self.drop(self.fc(x))

    graphed = build(Net, device).train(captured_training).requires_grad_(True)
    eager = build(Net, device).train(not captured_training).requires_grad_(True)
    accel_graph.make_graphed_callables(graphed, (randn(gen(0), 4, 16, device=device),))
    graphed.train(not captured_training)
    before = graphed.calls
    x = randn(gen(1), 4, 16, device=device)
    torch.manual_seed(3)
    yg = graphed(x)
    torch.manual_seed(3)
    ye = eager(x)
    assert graphed.calls == before + 1, "the original forward ran"
    torch.testing.assert_close(yg, ye, rtol=0, atol=0)
    graphed.train(captured_training)
    graphed(x)
    assert graphed.calls == before + 1, "in the captured mode the graph replays"


def test_no_grad_and_inference_paths(device, interpreted_only):
    graphed, eager = _trainable(MLP, device), _trainable(MLP, device)
    accel_graph.make_graphed_callables(graphed, (_leaf(randn(gen(0), 4, 16, device=device)),))
    x = _leaf(randn(gen(1), 4, 16, device=device))
    with torch.no_grad():
        y = graphed(x)
    assert not y.requires_grad
    assert_replay_matches(y, eager(x).detach(), msg="no_grad")
    assert all(g is None for g in _grads(graphed)), "no backward ran"
    # Graphed without any gradient at all: a forward-only graph.
    fn = accel_graph.make_graphed_callables(lambda a, b: (a * b).softmax(-1),
                                            (randn(gen(2), 3, 7, device=device),
                                             randn(gen(3), 3, 7, device=device)))
    a, b = randn(gen(4), 3, 7, device=device), randn(gen(5), 3, 7, device=device)
    out = fn(a, b)
    assert not out.requires_grad
    assert_replay_matches(out, (a * b).softmax(-1), msg="forward only")


def test_batchnorm_training_matches_eager_state(device, interpreted_only):
    """Convolution, batch norm in training mode (running statistics updated in place by the
    forward graph) and a linear head, four SGD steps: weights and buffers equal to eager. No
    warm-up, because warm-up runs the module for real and would move the running statistics."""

    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 6 * 6, 2))

    graphed, eager = _trainable(net, device), _trainable(net, device)
    accel_graph.make_graphed_callables(graphed, (randn(gen(0), 2, 3, 8, 8, device=device),),
                                       num_warmup_iters=0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (graphed, eager)]
    for r in range(1, 5):
        x = randn(gen(r), 2, 3, 8, 8, device=device)
        for m, opt in zip((graphed, eager), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
    assert_replay_matches(list(graphed.state_dict().values()), list(eager.state_dict().values()),
                          msg="weights and running statistics")


class _Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "LSTMCell":
            self.cell = nn.LSTMCell(6, 8)
        else:
            self.rnn = getattr(nn, kind)(6, 8, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "LSTMCell":
            return self.rnn(x)[0]
        h = c = x.new_zeros(x.shape[0], 8)
        outs = []
        for t in range(x.shape[1]):  # an LSTM built from its cell, step by step
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1)


@pytest.mark.parametrize(
    "kind",
    [
        "LSTM",
        "GRU",
        "RNN",
        "LSTMCell",
    ],
)
def test_recurrent_forward_backward_matches_eager(device, kind, interpreted_only):
    graphed, eager = _trainable(_Recurrent, device, kind), _trainable(_Recurrent, device, kind)
    accel_graph.make_graphed_callables(graphed, (_leaf(randn(gen(0), 2, 5, 6, device=device)),))
    for r in range(1, 3):
        x = randn(gen(r), 2, 5, 6, device=device)
        xg, xe = _leaf(x), _leaf(x)
        yg, ye = graphed(xg), eager(xe)
        grad = randn(gen(50 + r), *ye.shape, device=device)
        yg.backward(grad)
        ye.backward(grad)
        assert_replay_matches(yg.detach(), ye.detach(), msg=f"{kind} output {r}")
        assert_replay_matches(xg.grad, xe.grad, msg=f"{kind} input grad {r}")
        assert_replay_matches(_grads(graphed), _grads(eager), msg=f"{kind} parameter grads {r}")
        graphed.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def test_exported_lazily():
    assert "make_graphed_callables" in accel_graph.__all__
    from accel_graph.graphs.graphed_callables import make_graphed_callables

    assert accel_graph.make_graphed_callables is make_graphed_callables
