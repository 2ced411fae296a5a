"""Generator state inside a capture behaves as in eager (issue 13, item 7).

``torch.get_rng_state`` / ``set_rng_state`` and ``Generator.get_state`` / ``set_state`` inside a
capture are replayed at their point in the program: a state saved and restored inside the
capture makes the following random ops replay the draws that followed the save, so activation
checkpointing's ``preserve_rng_state`` recompute gives eager's gradients. Seeding inside a
capture is refused with torch's reason, and generators other than the default one must be
registered with the graph, as on CUDA.

On native backends torch itself refuses ``get_state``/``set_state`` of the device generator
during capture (CUDAGeneratorImpl: "Cannot call CUDAGeneratorImpl::current_seed", "Please
ensure to utilize the CUDAGeneratorImpl::set_state_index method during capturing"), so the
state tests run on the recorder only; the refusal of seeding runs everywhere.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import accel_graph
from accel_graph.errors import CaptureError, ConfigError, GraphStateError
from accel_graph.testing import assert_bitwise_equal, assert_replay_matches

from ._util import gen, randn

SEED = 4321


def _recorder_only(backend):
    if backend.capabilities().native_graphs:
        pytest.skip("torch refuses get_state/set_state of the device generator during native "
                    "capture (CUDAGeneratorImpl::current_seed / set_state_index)")


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator that random ops on ``device`` draw from without generator=."""
    if device.type == "cpu":
        return torch.default_generator
    mod = getattr(torch, device.type)
    gens = getattr(mod, "default_generators", ())
    if gens:
        return gens[device.index or 0]
    return mod._get_default_mps_generator()  # the recorder's other devices: MPS


def _seed(device: torch.device, seed: int = SEED) -> None:
    torch.manual_seed(seed)  # seeds every device's default generator


# -- get/set pairs ---------------------------------------------------------------------------
def _pair(device):
    """Save the state, draw, restore, draw again (eager: the same numbers twice)."""
    gen_ = _default_generator(device)
    state = gen_.get_state()
    a = torch.randn(64, device=device)
    gen_.set_state(state)
    b = torch.randn(64, device=device)
    c = torch.rand(8, device=device)  # continues after b, as eager does
    return a, b, c


def _module_pair(device):
    """The same with torch.get_rng_state / torch.set_rng_state (the CPU generator)."""
    state = torch.get_rng_state()
    a = torch.randn(64)
    torch.set_rng_state(state)
    b = torch.randn(64)
    return a.to(device), b.to(device), torch.rand(8).to(device)


@pytest.mark.parametrize("fn", [_pair, _module_pair], ids=["Generator.get_state", "torch.get_rng_state"])
def test_get_set_pair_replays_eager_draws(make_graph, backend, device, fn):
    _recorder_only(backend)
    fn(device)  # warm-up
    _seed(device)
    first, second = fn(device), fn(device)
    g = make_graph()
    with accel_graph.graph(g):
        out = fn(device)
    _seed(device)
    g.replay()
    assert_bitwise_equal(out[0], out[1], msg="restored state draws again what the saved state drew")
    assert_replay_matches(out, first, msg="first replay")
    g.replay()
    assert_replay_matches(out, second, msg="second replay continues the eager sequence")


def test_snapshot_tensor_holds_the_state_at_replay(make_graph, backend, device):
    _recorder_only(backend)
    gen_ = _default_generator(device)

    def fn():
        torch.randn(10, device=device)
        return gen_.get_state()

    g = make_graph()
    with accel_graph.graph(g):
        state = fn()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    _seed(device)
    expected = fn()
    _seed(device)
    g.replay()
    assert torch.equal(state, expected), "the state tensor got at capture holds the state at replay"


def test_set_state_from_a_tensor_captured_by_reference(make_graph, backend, device):
    """A state saved before capture is read at replay, like any input captured by reference."""
    _recorder_only(backend)
    gen_ = _default_generator(device)
    _seed(device, 1)
    saved = gen_.get_state()

    def fn():
        gen_.set_state(saved)
        return torch.randn(32, device=device)

    expected_1 = fn()
    g = make_graph()
    with accel_graph.graph(g):
        out = fn()
    torch.randn(5, device=device)  # move the generator: replay restores the saved state anyway
    g.replay()
    assert_bitwise_equal(out, expected_1)
    _seed(device, 2)
    saved.copy_(gen_.get_state())  # new contents: replay follows them, as eager would
    expected_2 = fn()
    g.replay()
    assert_bitwise_equal(out, expected_2)


def test_fork_rng_inside_capture(make_graph, backend, device):
    """torch.random.fork_rng saves and restores the CPU state around its body."""
    _recorder_only(backend)

    def fn():
        with torch.random.fork_rng(devices=[]):
            inner = torch.randn(16)
        after = torch.randn(16)
        return inner.to(device), after.to(device)

    fn()
    torch.manual_seed(SEED)
    expected = fn()
    g = make_graph()
    with accel_graph.graph(g):
        out = fn()
    torch.manual_seed(SEED)
    g.replay()
    assert_replay_matches(out, expected)
    assert_bitwise_equal(out[0], out[1], msg="fork_rng restored the state: the same draws again")


def test_capture_changes_no_generator(make_graph, backend, device):
    """get_state/set_state inside a capture are recorded, not applied: after capture the
    generator is where it was before (capture consumes no random numbers)."""
    _recorder_only(backend)
    gen_ = _default_generator(device)
    _seed(device, 5)
    other = gen_.get_state()
    _seed(device)
    before = gen_.get_state()
    g = make_graph()
    with accel_graph.graph(g):
        gen_.set_state(other)
        torch.randn(8, device=device)
    assert torch.equal(gen_.get_state(), before)


# -- activation checkpointing ------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = gen(0)
        self.lin1 = torch.nn.Linear(16, 32)
        self.lin2 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def block(self, x):
        h = torch.nn.functional.dropout(torch.relu(self.lin1(x)), p=0.5, training=True)
        return torch.nn.functional.dropout(torch.tanh(self.lin2(h)), p=0.3, training=True)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_training_step_equals_eager(make_graph, backend, device, use_reentrant):
    """Forward and backward of a checkpointed block with dropout, captured: the recompute in
    backward restores the forward's RNG state, so the gradients are eager's."""
    _recorder_only(backend)
    net = _Net().to(device)
    x = randn(gen(1), 8, 16, device=device)
    params = list(net.parameters())

    def step():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_(use_reentrant)  # reentrant needs an input requiring grad
        h = checkpoint(net.block, xi, use_reentrant=use_reentrant)
        loss = net.head(torch.nn.functional.dropout(h, p=0.2)).square().mean()
        loss.backward()
        return [loss.detach(), *[p.grad for p in params]]

    step()  # warm-up
    _seed(device)
    first = [t.clone() for t in step()]
    second = [t.clone() for t in step()]
    g = make_graph()
    with accel_graph.graph(g):
        out = step()
    _seed(device)
    g.replay()
    assert_replay_matches(out, first, msg="first replay: loss and gradients")
    g.replay()
    assert_replay_matches(out, second, msg="second replay: loss and gradients")


# -- seeding is refused --------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda d: torch.manual_seed(0),
    lambda d: torch.seed(),
    lambda d: _default_generator(d).manual_seed(3),
], ids=["torch.manual_seed", "torch.seed", "Generator.manual_seed"])
def test_seeding_inside_capture_is_refused(make_graph, backend, device, call):
    g = make_graph()
    native = backend.capabilities().native_graphs
    with pytest.raises(RuntimeError) as info:
        with accel_graph.graph(g):
            torch.randn(4, device=device)
            call(device)
    if native:
        assert "during CUDA graph capture" in str(info.value) or "capture" in str(info.value)
        return
    assert isinstance(info.value, CaptureError)
    msg = str(info.value)
    assert "during CUDA graph capture" in msg and "test_rng_state.py" in msg, msg
    assert g.state == "empty"  # the capture is over; the graph is reusable
    assert not accel_graph.is_current_stream_capturing(device)
    torch.manual_seed(0)  # outside capture: works again


def test_seeding_on_another_thread_during_a_capture_runs(make_graph, backend, device):
    """Interception is per capturing thread: other threads seed and read state eagerly."""
    _recorder_only(backend)
    seen = {}

    def other():
        gen_ = torch.Generator().manual_seed(11)
        state = gen_.get_state()
        first = torch.randn(4, generator=gen_)
        gen_.set_state(state)
        seen["same"] = torch.equal(first, torch.randn(4, generator=gen_))

    g = make_graph()
    with accel_graph.graph(g):
        torch.randn(4, device=device)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["same"]


def test_generator_methods_are_restored_after_every_capture(make_graph, backend, device):
    _recorder_only(backend)
    original = torch.Generator.__dict__["get_state"]
    g = make_graph()
    with accel_graph.graph(g):
        assert torch.Generator.__dict__["get_state"] is not original  # intercepted meanwhile
        torch.randn(3, device=device)
    assert torch.Generator.__dict__["get_state"] is original
    g2 = make_graph()
    with pytest.raises(CaptureError):
        with accel_graph.graph(g2):
            torch.manual_seed(1)  # invalidated capture
    assert torch.Generator.__dict__["get_state"] is original
    g3 = make_graph()
    g3.capture_begin()
    g3.reset()  # aborted capture
    assert torch.Generator.__dict__["get_state"] is original
    assert type(original).__name__ == "method_descriptor"


# -- registered generators -----------------------------------------------------------------
def test_registered_generator_advances_on_each_replay(make_graph, backend, device, accel_graph_compile):
    if accel_graph_compile is not None:
        pytest.skip("an FX graph cannot carry a generator= argument: such graphs fall back to "
                    "interpreted replay, logged (tests/backends/test_recorder_rng.py checks it)")
    gen_ = torch.Generator(device=device)
    gen_.manual_seed(7)

    def fn():
        return torch.randn(16, device=device, generator=gen_), torch.rand(4, device=device)

    fn()
    g = make_graph()
    g.register_generator_state(gen_)
    g.register_generator_state(gen_)  # registering twice is harmless
    with accel_graph.graph(g):
        out = fn()
    gen_.manual_seed(99)
    _seed(device)
    first, second = fn(), fn()
    gen_.manual_seed(99)
    _seed(device)
    g.replay()
    assert_replay_matches(out, first)
    g.replay()
    assert_replay_matches(out, second)


def test_unregistered_generator_is_refused(make_graph, backend, device):
    _recorder_only(backend)
    g = make_graph()
    with pytest.raises(CaptureError, match="register_generator_state"):
        with accel_graph.graph(g):
            torch.randn(16, device=device, generator=torch.Generator(device=device).manual_seed(1))
    assert g.state == "empty"


def test_register_generator_state_misuse(make_graph, device):
    g = make_graph()
    with pytest.raises(ConfigError, match="torch.Generator"):
        g.register_generator_state(3)
    if device.type != "cpu":
        with pytest.raises(ConfigError, match="generator is on cpu"):
            g.register_generator_state(torch.Generator())
    g.capture_begin()
    try:
        with pytest.raises(GraphStateError, match="during capturing stage"):
            g.register_generator_state(torch.Generator(device=device))
    finally:
        g.capture_end()


def test_graphsafe_state_as_in_torch(make_graph, backend, device):
    """Where a generator has no graph-safe states (the CPU), torch's own error, in capture too."""
    _recorder_only(backend)
    gen_ = _default_generator(device)
    try:
        gen_.graphsafe_get_state()
    except (NotImplementedError, RuntimeError) as exc:
        eager_error = type(exc)
    else:
        pytest.skip(f"{device.type} generators have graph-safe states (unverified on the recorder)")
    g = make_graph()
    with accel_graph.graph(g):
        torch.randn(2, device=device)
        with pytest.raises(eager_error):
            gen_.graphsafe_get_state()
        with pytest.raises(eager_error):
            gen_.graphsafe_set_state(torch.Generator(device=device))


# -- other invisible state: compute settings -------------------------------------------------
def test_flush_denormal_set_inside_capture_is_replayed(make_graph, backend, device):
    """torch.set_flush_denormal changes what later CPU ops compute without an aten op: each
    replay applies it where the captured code called it."""
    _recorder_only(backend)
    if device.type != "cpu" or not torch.set_flush_denormal(False):
        pytest.skip("flush-denormal mode is a CPU (SSE3) setting")
    x = torch.full((4,), 1e-39)  # a float32 denormal
    one = torch.ones(4)  # a tensor, not 1.0: Inductor would fold x * 1.0 to x

    def fn():
        torch.set_flush_denormal(True)
        flushed = x * one
        torch.set_flush_denormal(False)
        return flushed, x * one

    try:
        expected = fn()
        assert torch.equal(expected[0], torch.zeros(4)) and not torch.equal(expected[1], torch.zeros(4))
        g = make_graph()
        with accel_graph.graph(g):
            out = fn()
        torch.set_flush_denormal(True)  # replay sets it as the code did, wherever it starts
        g.replay()
        # Exact checks in both replay modes (a denormal is within any float tolerance of 0).
        assert torch.equal(out[0], torch.zeros(4)), "flushed while flush-denormal was on"
        assert torch.equal(out[1], x), "kept once the code turned flush-denormal off"
        assert torch.equal(x * one, x), "the code left flush-denormal off: so does replay"
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_compute_settings_changed_inside_capture_are_replayed(make_graph, backend, device, tmp_path):
    """Settings read by kernels at run time (deterministic algorithms, mkldnn, threads) changed
    inside the capture become program steps at the same points."""
    _recorder_only(backend)
    x = randn(gen(0), 8, 8, device=device)
    det = torch.are_deterministic_algorithms_enabled()

    def fn():
        with torch.backends.mkldnn.flags(enabled=False):
            a = x @ x
        b = x + 1
        torch.use_deterministic_algorithms(True)
        return a, b

    try:
        g = make_graph()
        with accel_graph.graph(g):
            fn()
        torch.use_deterministic_algorithms(False)
        g.replay()
        assert torch.are_deterministic_algorithms_enabled(), "replay applies what the code left set"
        g.debug_dump(str(tmp_path / "g.dot"))
        import json

        ops = json.loads((tmp_path / "g.dot.json").read_text())["ops"]
        kinds = [(op["kind"], op["op"]) for op in ops if op["kind"] != "view"]
        hosts = [i for i, (k, _) in enumerate(kinds) if k == "host"]
        assert [kinds[i][1] for i in hosts] == [
            "set torch.backends.mkldnn.enabled(False)",
            "set torch.backends.mkldnn.enabled(True)",
            "set torch.use_deterministic_algorithms(True)",
        ], kinds
        assert "mm" in kinds[hosts[0] + 1][1] and "add" in kinds[hosts[1] + 1][1], kinds
    finally:
        torch.use_deterministic_algorithms(det)
