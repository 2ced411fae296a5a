"""Bad input to ``accel_graph.make_graphed_callables`` and to the callables it returns: torch's
refusals in our words, naming the argument, and refusals where torch would fail late or give
a silently wrong gradient. Nothing graphed before is lost.

Refusals at ``make_graphed_callables`` run before routing, so they hold on every backend; the
graphed callables' own checks are ours (native backends return torch's callables), so those
tests run on the backends that serve the call themselves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel_graph
from accel_graph import CaptureError, ConfigError, ReplayError

from ._util import gen, randn
from .models import MLP, build

make = accel_graph.make_graphed_callables


@pytest.fixture(autouse=True)
def _interpreted(accel_graph_compile):
    # Refusals do not depend on the replay mode; each compiled case would only add Inductor runs.
    if accel_graph_compile is not None:
        pytest.skip("refusals are the same under compiled replay (covered interpreted)")


@pytest.fixture
def ours(backend):
    """Skip where the call goes to torch's own make_graphed_callables."""
    if backend.capabilities().native_graphs:
        pytest.skip("native backends return torch's graphed callables, with torch's errors")


def _leaf(device: torch.device, *shape: int, seed: int = 0) -> torch.Tensor:
    return randn(gen(seed), *shape, device=device).requires_grad_(True)


def _mlp(device: torch.device) -> nn.Module:
    return build(MLP, device).train().requires_grad_(True)


def test_non_tensor_output_refused(device, ours):
    with pytest.raises(TypeError, match=r"callables\[0\] returned a int as flattened output 1"):
        make(lambda x: (x * 2, 3), (_leaf(device, 4),))


def test_non_tensor_sample_arg_refused(device):
    with pytest.raises(TypeError, match=r"sample_args\[0\] holds a float as flattened argument 1"):
        make(lambda x, s: x * s, (_leaf(device, 4), 2.0))
    with pytest.raises(TypeError, match=r"sample_args\[0\] is a Tensor"):
        make(lambda x: x * 2, _leaf(device, 4))


def test_sample_args_count_must_match(device):
    with pytest.raises(ConfigError, match="2 callables were given but sample_args has 1"):
        make((torch.sin, torch.cos), ((_leaf(device, 4),),))


def test_module_with_hooks_refused(device):
    m = _mlp(device)
    m.register_forward_hook(lambda mod, args, out: None)
    with pytest.raises(ConfigError, match=r"callables\[0\] \(MLP\) has forward hooks"):
        make(m, (_leaf(device, 4, 16),))


def test_trainable_buffer_refused(device):
    m = _mlp(device)
    m.register_buffer("scale", torch.ones(1, device=device, requires_grad=True))
    with pytest.raises(ConfigError, match="buffer 'scale' of callables\\[0\\] \\(MLP\\) requires grad"):
        make(m, (_leaf(device, 4, 16),))


def test_bad_num_warmup_iters(device):
    with pytest.raises(ConfigError, match="num_warmup_iters=-1"):
        make(torch.sin, (_leaf(device, 4),), num_warmup_iters=-1)


def test_inputs_on_several_devices_refused(device):
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    with pytest.raises(ConfigError, match="several devices"):
        make(torch.add, (_leaf(device, 4), torch.ones(4, device="meta")))


def test_autocast_cache_refused(device):
    with torch.autocast(device.type, dtype=torch.bfloat16), pytest.raises(
        CaptureError, match="cache_enabled=False"
    ):
        make(torch.sin, (_leaf(device, 4),))


@pytest.mark.parametrize("warmup", [3, 0], ids=["warmup", "no-warmup"])
def test_unused_input_needs_allow_unused_input(device, ours, warmup):
    """Found in the warm-up, or (no warm-up) in the backward capture: the same error."""

    def fn(x, unused):
        return x * 2

    with pytest.raises(CaptureError, match="argument 1 of callables\\[0\\] require"):
        make(fn, (_leaf(device, 4), _leaf(device, 4)), num_warmup_iters=warmup)
    graphed = make(fn, (_leaf(device, 4), _leaf(device, 4)), num_warmup_iters=warmup,
                   allow_unused_input=True)
    x, u = _leaf(device, 4, seed=1), _leaf(device, 4, seed=2)
    graphed(x, u).sum().backward()
    assert u.grad is None
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), rtol=0, atol=0)


def test_closure_tensor_requiring_grad_refused(device, ours):
    """torch would drop its gradient silently: the backward graph only computes gradients of
    the sample arguments and parameters."""
    w = _leaf(device, 4, seed=3)
    with pytest.raises(CaptureError, match="require grad, but none of its sample arguments"):
        make(lambda x: x * w, (randn(gen(0), 4, device=device),))
    with pytest.raises(CaptureError, match="neither its sample arguments nor its parameters"):
        make(lambda x: x * w, (_leaf(device, 4),))


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_other_shape_or_dtype_refused_and_graph_kept(device, ours, change):
    model, eager = _mlp(device), _mlp(device)
    make(model, (_leaf(device, 4, 16),))
    bad = randn(gen(1), 5, 16, device=device) if change == "shape" else \
        randn(gen(1), 4, 16, device=device).double()
    with pytest.raises(ReplayError, match=r"argument 0 of the graphed callables\[0\] has"):
        model(bad)
    # Nothing captured is lost: the graph still serves the captured shape, equal to eager.
    x = randn(gen(2), 4, 16, device=device)
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)


def test_other_structure_refused(device, ours):
    graphed = make(lambda a, b: a + b, (_leaf(device, 4), _leaf(device, 4)))
    with pytest.raises(ReplayError, match="same order and format"):
        graphed(_leaf(device, 4))
    with pytest.raises(ReplayError, match="argument 1 .* is a int"):
        graphed(_leaf(device, 4), 3)


def test_input_requiring_grad_where_sample_did_not(device, ours):
    graphed = make(lambda a, b: a * b, (_leaf(device, 4), randn(gen(1), 4, device=device)))
    out = graphed(_leaf(device, 4), _leaf(device, 4, seed=5))  # forward runs, as in torch
    with pytest.raises(ReplayError, match="argument 1 of the graphed callables\\[0\\] requires grad"):
        out.sum().backward()  # the gradient the graph cannot give is refused, not left None
    with torch.no_grad():  # no gradient wanted: fine
        graphed(_leaf(device, 4), _leaf(device, 4, seed=5))


def test_graphed_with_autograd_off_then_called_with_it(device, ours):
    model = _mlp(device)
    with torch.no_grad():
        make(model, (randn(gen(0), 4, 16, device=device),))
    with pytest.raises(ReplayError, match="ran with autograd disabled"):
        model(randn(gen(1), 4, 16, device=device))
    with torch.no_grad():
        model(randn(gen(1), 4, 16, device=device))


def test_replaced_parameter_refused(device, ours):
    model = _mlp(device)
    make(model, (_leaf(device, 4, 16),))
    model.fc1.weight = nn.Parameter(model.fc1.weight.detach().clone())
    with pytest.raises(ReplayError, match="added, removed or replaced"):
        model(randn(gen(1), 4, 16, device=device))


def test_keyword_arguments_refused(device, ours):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale=None):
            return self.fc(x)

    net = build(Net, device).train().requires_grad_(True)
    make(net, (_leaf(device, 2, 4),))
    with pytest.raises(ReplayError, match=r"keyword arguments \['scale'\]"):
        net(_leaf(device, 2, 4), scale=None)


def test_failed_call_loses_nothing(device, ours):
    """A refused make_graphed_callables leaves earlier graphed callables working."""
    model, eager = _mlp(device), _mlp(device)
    make(model, (_leaf(device, 4, 16),))
    with pytest.raises(TypeError):
        make(lambda x: {"y": x * 2, "n": None, "s": "text"}, (_leaf(device, 4),))
    x = randn(gen(3), 4, 16, device=device)
    torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)
