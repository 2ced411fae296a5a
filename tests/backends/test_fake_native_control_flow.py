"""torch.cond / torch.while_loop inside native captures, against a FAKE torch.cuda / torch.xpu:
plumbing only (issue 18 item 3).

Nothing here captures a conditional node or runs on a GPU: the fakes (tests/backends/fakes.py)
record which of torch's conditional-node APIs the backend drives, and branch ops run eagerly on
the CPU. What is checked: feature detection by API, that the control-flow mode is on the stack
exactly while a native capture is underway, the refusals and their words, the guards that keep
the result eager's (clones, predicate copy, same-metadata check), and that a refused capture
leaves the Graph usable and earlier graphs replaying. Hardware: tools/device_check.py's
control_flow row.

The operators are called as ``torch.ops.higher_order.cond`` / ``while_loop``: eager
``torch.cond`` first runs TorchDynamo over its wrapper (the mode ignores compile internals, as
torch's own do), and Dynamo reaches into the real ``torch.cuda``, which the fakes do not imitate.
What Dynamo then calls is this same operator.
"""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph import CaptureError
from accel_graph.backends import get_backend
from accel_graph.backends.native.control_flow import ControlFlowMode
from accel_graph.backends.native.control_flow_support import (
    TORCH_MODULE,
    python_level_refusal,
    torch_module,
)
from accel_graph.backends.recorder.modes import mode_stack

from .fakes import (
    FakeCudaModule,
    FakeXpuModule,
    conditional_nodes_module,
    install_conditional_nodes,
)

cond_op = torch.ops.higher_order.cond


def flow_modes() -> list[ControlFlowMode]:
    return [m for m in mode_stack() if isinstance(m, ControlFlowMode)]


def first_graph(fake: FakeCudaModule) -> accel_graph.Graph:
    """A graph captured before the one under test (it must keep working)."""
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        fake.allocate(64)
    return g


def assert_still_usable(g: accel_graph.Graph, earlier: accel_graph.Graph, fake: FakeCudaModule) -> None:
    assert g.state == "empty" and fake.capturing is None and flow_modes() == []
    before = fake.replays
    earlier.replay()
    assert fake.replays == before + 1
    with accel_graph.graph(g):
        fake.allocate(32)
    g.replay()
    assert g.state == "instantiated"


def with_torch_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``if_else_node`` present: the real one (2.13+), or on a torch without the module
    (2.11) a FAKE stand-in that must never be called (the tests using this refuse first)."""
    api = conditional_nodes_module(monkeypatch)
    if not hasattr(api, "if_else_node"):
        def if_else_node(*args: object) -> None:
            raise AssertionError("FAKE if_else_node called although the graph class lacks the API")
        monkeypatch.setattr(api, "if_else_node", if_else_node, raising=False)


# -- feature detection --------------------------------------------------------------------------
def test_fake_cf_detection_without_the_api_names_it(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    with_torch_builder(monkeypatch)
    s = get_backend("cuda").control_flow_support()
    assert s.kind == "CUDA" and "begin_capture_to_if_node" in (s.cond or "")
    assert s.while_loop and s.switch


def test_fake_cf_detection_with_if_nodes_only(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    s = get_backend("cuda").control_flow_support()
    assert s.cond is None
    assert "while-node capture" in (s.while_loop or "") and "begin_capture_to_while_node" in s.while_loop
    assert s.switch  # no torch has switch-node capture yet


def test_fake_cf_detection_with_while_nodes(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch, while_nodes=True)
    s = get_backend("cuda").control_flow_support()
    assert s.cond is None and s.while_loop is None


def test_fake_cf_detection_refuses_old_cuda_builds(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.2")
    assert "CUDA 12.4+" in (get_backend("cuda").control_flow_support().cond or "")


def test_fake_cf_detection_rocm_and_xpu(fake_rocm: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_rocm, monkeypatch)  # the methods exist on ROCm, but error
    s = get_backend("hip").control_flow_support()
    assert s.kind == "HIP" and "ROCm" in (s.cond or "")


def test_fake_cf_detection_without_torchs_module(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11 has no cudagraph_conditional_nodes (None in sys.modules: importing it fails, as
    # there). Every operator is refused with the module's name; everything else still captures.
    import sys

    monkeypatch.setitem(sys.modules, TORCH_MODULE, None)
    assert torch_module() is None
    s = get_backend("cuda").control_flow_support()
    for why in (s.cond, s.while_loop, s.switch):
        assert f"{TORCH_MODULE}.if_else_node" in (why or "")
    earlier = first_graph(fake_cuda)  # a native capture without the module
    assert earlier.state == "instantiated"
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError) as info, accel_graph.graph(g):
        cond_op(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (torch.ones(3),))
    assert "no conditional-node capture" in str(info.value) and "device='cpu'" in str(info.value)
    assert_still_usable(g, earlier, fake_cuda)
    assert f"torch {torch.__version__} cannot capture torch.cond" in (python_level_refusal("cond", "cuda") or "")


def test_fake_cf_python_level_refusal_for_check_capturable() -> None:
    api = torch_module()  # the real module, where this torch has it (2.13+; 2.11 has none)
    if hasattr(api, "if_else_node"):
        assert python_level_refusal("cond", "cuda") is None
    else:
        assert f"torch {torch.__version__} cannot capture torch.cond" in (
            python_level_refusal("cond", "cuda") or "")
    if hasattr(api, "while_loop_node"):  # a torch with while-node capture (2.14+)
        assert python_level_refusal("while_loop", "cuda") is None
    else:
        assert f"torch {torch.__version__} cannot capture torch.while_loop" in (
            python_level_refusal("while_loop", "cuda") or "")
    assert "CUDA graphs only" in (python_level_refusal("cond", "xpu") or "")
    assert python_level_refusal("while_loop", "cpu") is None


# -- the mode's lifetime ------------------------------------------------------------------------
def test_fake_cf_mode_is_on_the_stack_only_while_capturing(fake_cuda: FakeCudaModule) -> None:
    g = accel_graph.Graph(device="cuda:0")
    assert flow_modes() == []
    with accel_graph.graph(g):
        (mode,) = flow_modes()
        assert mode.active and mode.support.backend == "cuda"
    assert flow_modes() == [] and not mode.active
    with pytest.raises(ZeroDivisionError), accel_graph.graph(g := accel_graph.Graph(device="cuda:0")):
        1 / 0  # noqa: B018
    assert flow_modes() == []


# -- cond through conditional nodes ---------------------------------------------------------------
def test_fake_cf_cond_builds_two_if_nodes(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    x = torch.arange(4.0)
    pred = torch.tensor(True)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        y = cond_op(pred, lambda t: t * 2, lambda t: t - 1, (x,))
    assert [c[0] for c in log] == ["begin_capture_to_if_node", "end_capture_to_conditional_node"] * 2
    assert [c[1] for c in log[::2]] == [True, False]  # pred, then not pred
    assert g.state == "instantiated" and y.shape == x.shape
    g.replay()


def test_fake_cf_integer_predicate_becomes_a_fresh_bool(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    pred = torch.tensor([2])  # nonzero: true, as eager's bool(pred)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        cond_op(pred, lambda t: t + 1, lambda t: t - 1, (torch.zeros(2),))
    assert [c[1] for c in log[::2]] == [True, False]


def test_fake_cf_true_branch_returning_an_operand_is_cloned(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch copies the false branch's results into the true branch's: without the clone a true
    branch that returns its operand would have the operand overwritten (a silent wrong result)."""
    install_conditional_nodes(fake_cuda, monkeypatch)
    x = torch.arange(4.0)
    w = torch.ones(4)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        a, b, c = cond_op(torch.tensor(True), lambda t: (t, w, t), lambda t: (t * 10, t * 20, t * 30), (x,))
    assert torch.equal(x, torch.arange(4.0)) and torch.equal(w, torch.ones(4))
    assert len({a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(), c.untyped_storage().data_ptr()}) == 3


def test_fake_cf_fresh_true_outputs_are_not_copied_again(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    seen = []

    def true_fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(t * 2)
        return seen[-1]

    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        out = cond_op(torch.tensor(True), true_fn, lambda t: t + 1, (torch.ones(3),))
    assert out is seen[0]  # fresh memory of the branch: no extra clone kernel


@pytest.mark.parametrize("false_fn, words", [
    (lambda t: t.sum(), "same shape"),
    (lambda t: t.to(torch.float64), "same shape, dtype"),
    (lambda t: (t, t), "different structures"),
])
def test_fake_cf_branches_must_agree(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch,
                                     false_fn: object, words: str) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=words), accel_graph.graph(g):
        cond_op(torch.tensor(False), lambda t: t + 1, false_fn, (torch.ones(3),))
    assert_still_usable(g, earlier, fake_cuda)


@pytest.mark.parametrize("pred, words", [
    (torch.tensor(0.5), "bool \\(or integer\\) tensor"),
    (torch.tensor([True, False]), "one-element"),
])
def test_fake_cf_bad_predicates(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch,
                                pred: torch.Tensor, words: str) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=words), accel_graph.graph(g):
        cond_op(pred, lambda t: t + 1, lambda t: t - 1, (torch.ones(3),))
    assert g.state == "empty" and flow_modes() == []


def test_fake_cf_random_op_in_a_branch_is_refused(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match=r"aten\.rand.*random numbers inside a torch\.cond branch"), \
            accel_graph.graph(g):
        cond_op(torch.tensor(True), lambda t: t + torch.rand(3), lambda t: t, (torch.ones(3),))
    # the IF node's capture was ended before the error left torch's builder
    assert [c[0] for c in log] == ["begin_capture_to_if_node", "end_capture_to_conditional_node"]
    assert_still_usable(g, earlier, fake_cuda)


def test_fake_cf_random_op_outside_branches_is_allowed(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        noise = torch.rand(3)
        cond_op(torch.tensor(True), lambda t, n: t + n, lambda t, n: t - n, (torch.ones(3), noise))
    assert g.state == "instantiated"


# -- refusals where nodes are missing --------------------------------------------------------------
def test_fake_cf_cond_refused_without_conditional_nodes(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    with_torch_builder(monkeypatch)  # torch's builder present, the graph class without the API
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError) as info, accel_graph.graph(g):
        cond_op(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (torch.ones(3),))
    msg = str(info.value)
    assert "torch.cond cannot be captured into a CUDA graph on cuda:0 (cuda backend)" in msg
    assert "begin_capture_to_if_node" in msg and "device='cpu'" in msg
    assert_still_usable(g, earlier, fake_cuda)


def test_fake_cf_while_loop_refused_without_while_nodes(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch)
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError) as info, accel_graph.graph(g):
        torch.ops.higher_order.while_loop(lambda i: i < 3, lambda i: (i + 1,), (torch.tensor(0),), ())
    msg = str(info.value)
    assert f"torch.while_loop cannot be captured into a CUDA graph on cuda:0 (cuda backend) with torch {torch.__version__}" in msg
    assert "while-node capture (torch 2.14+)" in msg and "Graph(device='cpu')" in msg
    assert_still_usable(g, earlier, fake_cuda)


def test_fake_cf_while_loop_through_while_nodes(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    log = install_conditional_nodes(fake_cuda, monkeypatch, while_nodes=True)
    g = accel_graph.Graph(device="cuda:0")
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    with accel_graph.graph(g):
        # a body that swaps its carries: the results must be read before they are overwritten
        out = torch.ops.higher_order.while_loop(lambda x, y: x < 5, lambda x, y: (y, x), (a, b), ())
    assert [c[0] for c in log] == ["begin_capture_to_while_node", "set_conditional_handle_for_current_node",
                                   "end_capture_to_conditional_node"]
    assert [float(t) for t in out] == [2.0, 1.0]  # one pass of the fake node: swapped, not (2, 2)
    assert float(a) == 1.0 and float(b) == 2.0  # carried inputs untouched


def test_fake_cf_while_body_changing_a_shape_is_refused(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_cuda, monkeypatch, while_nodes=True)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="carried values and body_fn's results"), accel_graph.graph(g):
        torch.ops.higher_order.while_loop(lambda x: x.sum() < 5, lambda x: (torch.cat([x, x]),),
                                          (torch.ones(2),), ())
    assert g.state == "empty"


@pytest.mark.filterwarnings("ignore:hip. accel_graph.graph.. is capturing on the backend's side stream")
def test_fake_cf_rocm_refuses_cond_with_the_reason(fake_rocm: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    install_conditional_nodes(fake_rocm, monkeypatch)
    g = accel_graph.Graph(device="cuda:0")
    assert g.backend.name == "hip"
    with pytest.raises(CaptureError, match="into a HIP graph.*ROCm builds of torch have no conditional-node"), \
            accel_graph.graph(g):
        cond_op(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (torch.ones(3),))
    assert g.state == "empty" and flow_modes() == []


def test_fake_cf_xpu_refuses_cond(monkeypatch: pytest.MonkeyPatch, native_registry: None) -> None:
    fake = FakeXpuModule()
    fake.install_into_torch(monkeypatch)
    g = accel_graph.Graph(device="xpu:0")
    with pytest.raises(CaptureError, match="into a XPU graph.*torch.xpu graphs have no conditional nodes"), \
            accel_graph.graph(g):
        cond_op(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (torch.ones(3),))
    assert g.state == "empty" and flow_modes() == []
    with accel_graph.graph(g):
        fake.allocate(8)
    assert g.state == "instantiated"


# -- warm-up --------------------------------------------------------------------------------------
def test_fake_cf_warmup_captures_both_branches_then_runs_eager(fake_cuda: FakeCudaModule,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    backend = get_backend("cuda")
    spec = backend.device_spec(torch.device("cuda:0"))
    x = torch.arange(3.0)
    with backend.control_flow_warmup(spec):
        y = cond_op(torch.tensor(False), lambda t: t * 2, lambda t: t - 1, (x,))
    assert torch.equal(y, x - 1)  # the eager result
    assert [c[0] for c in log].count("begin_capture_to_if_node") == 2
    throwaway = fake_cuda.graphs[-1]
    assert dict(throwaway.calls)["capture_begin"]["mode"] == "relaxed"
    assert [c[0] for c in throwaway.calls][-1] == "reset" and fake_cuda.capturing is None
    assert flow_modes() == []


def test_fake_cf_warmup_is_a_no_op_without_nodes(fake_cuda: FakeCudaModule) -> None:
    backend = get_backend("cuda")
    spec = backend.device_spec(torch.device("cuda:0"))
    n = len(fake_cuda.graphs)
    with backend.control_flow_warmup(spec):
        y = cond_op(torch.tensor(True), lambda t: t * 2, lambda t: t - 1, (torch.ones(2),))
    assert torch.equal(y, torch.full((2,), 2.0)) and len(fake_cuda.graphs) == n


def test_fake_cf_warmup_hides_the_throwaway_capture_from_modes_below(fake_cuda: FakeCudaModule,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An undo log or counter below the warm-up must not take the throwaway capture's ops (never
    run) for real work: it sees the operator once, as eager runs it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    install_conditional_nodes(fake_cuda, monkeypatch)
    seen: list[str] = []

    class Count(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(str(func.name()) if hasattr(func, "name") else str(func))
            return func(*args, **(kwargs or {}))

    backend = get_backend("cuda")
    spec = backend.device_spec(torch.device("cuda:0"))
    pred, x = torch.tensor(False), torch.ones(2)
    with Count(), backend.control_flow_warmup(spec):
        y = cond_op(pred, lambda t: t.mul(2), lambda t: t.sub(1), (x,))
    assert seen == ["cond"] and torch.equal(y, torch.zeros(2))


def test_fake_cf_mode_can_be_turned_off(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACCEL_GRAPH_NATIVE_CONTROL_FLOW=0: no mode (no per-op cost); torch.cond is plain torch."""
    install_conditional_nodes(fake_cuda, monkeypatch)
    monkeypatch.setenv("ACCEL_GRAPH_NATIVE_CONTROL_FLOW", "0")
    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        assert flow_modes() == []
        fake_cuda.allocate(8)
    backend = get_backend("cuda")
    with backend.control_flow_warmup(backend.device_spec(torch.device("cuda:0"))):
        assert mode_stack() == []


def test_fake_cf_doctor_facts_say_what_is_captured(fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    facts = dict(get_backend("cuda").describe())
    assert facts["control flow"].startswith("cond: CaptureError (")
    install_conditional_nodes(fake_cuda, monkeypatch)
    facts = dict(get_backend("cuda").describe())
    assert facts["control flow"].startswith("cond: captured natively; while_loop: CaptureError (")


def test_fake_cf_nested_cond_returning_an_outer_branch_tensor_is_cloned(
        fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the outer branch made is the inner cond's operand: the inner true branch that
    returns it must not hand it to torch's copy of the inner false branch's result."""
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    kept: list[torch.Tensor] = []

    def outer_true(t: torch.Tensor) -> torch.Tensor:
        made = t + 1
        kept.append(made)
        inner = cond_op(torch.tensor(True), lambda u: u, lambda u: u * 100, (made,))
        return inner + made

    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        cond_op(torch.tensor(True), outer_true, lambda t: t * 3, (torch.ones(2),))
    assert torch.equal(kept[0], torch.full((2,), 2.0))  # not overwritten with 200
    assert [c[0] for c in log].count("begin_capture_to_if_node") == 4  # 2 outer + 2 inner


def test_fake_cf_branch_writing_its_predicate_cannot_run_the_other_branch(
        fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch builds the false IF node on not(pred) after the true node: were pred not copied
    first, a true branch that clears it would make the false branch run too."""
    log = install_conditional_nodes(fake_cuda, monkeypatch)
    flag = torch.tensor(True)

    def true_fn(t: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        f.fill_(False)
        return t + 1

    g = accel_graph.Graph(device="cuda:0")
    with accel_graph.graph(g):
        cond_op(flag, true_fn, lambda t, f: t - 1, (torch.ones(2), flag))
    assert [c[1] for c in log[::2]] == [True, False]  # the false node's condition: not(True)


def test_fake_cf_detection_never_raises(fake_cuda: FakeCudaModule) -> None:
    """Detection runs right after torch's capture began: an odd module refuses, never raises."""
    from accel_graph.backends.native.control_flow_support import detect_support

    class Odd:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError("odd build")

    s = detect_support("cuda", "cuda", Odd())
    assert s.cond == s.while_loop == s.switch and "odd build" in (s.cond or "")


def test_fake_cf_error_caught_inside_the_capture_still_invalidates_it(
        fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that left a branch half-captured, caught by user code: capture_end refuses the
    graph (its conditional node is half-built), as CUDA invalidates a capture at an illegal op."""
    install_conditional_nodes(fake_cuda, monkeypatch)
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="is invalid: an error left a torch.cond/while_loop body"), \
            accel_graph.graph(g):
        try:
            cond_op(torch.tensor(True), lambda t: t + torch.rand(3), lambda t: t, (torch.ones(3),))
        except CaptureError:
            pass  # the user carries on
    assert_still_usable(g, earlier, fake_cuda)


# -- while_loop routing and switch (issue 24 item 8) --------------------------------------------
def test_fake_cf_while_loop_refused_where_torch_lacks_while_loop_node(
        fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    # The graph class has the while-node methods, torch's builder is missing: refused, and the
    # reason names the builder (never a call into an absent function).
    install_conditional_nodes(fake_cuda, monkeypatch, while_nodes=True)
    monkeypatch.delattr(torch_module(), "while_loop_node")
    s = get_backend("cuda").control_flow_support()
    assert s.cond is None
    assert "cudagraph_conditional_nodes.while_loop_node" in (s.while_loop or "")
    assert "begin_capture_to_while_node" not in (s.while_loop or "")  # the class has it
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    with pytest.raises(CaptureError, match="while_loop_node") as info, accel_graph.graph(g):
        torch.ops.higher_order.while_loop(lambda i: i < 3, lambda i: (i + 1,), (torch.tensor(0),), ())
    assert "Graph(device='cpu')" in str(info.value)
    assert_still_usable(g, earlier, fake_cuda)


def test_real_torch_while_node_api_matches_what_detection_asks_for() -> None:
    # Not a fake: the real torch module. Where torch ships while_loop_node (2.14.1), the graph
    # methods it calls are exactly the ones detection requires, and the real CUDAGraph has
    # them; where it does not (2.13), detection on the real torch.cuda gives that reason.
    import inspect

    from accel_graph.backends.native.control_flow_support import WHILE_METHODS, detect_support

    api = torch_module()
    s = detect_support("cuda", "cuda", torch.cuda)
    if hasattr(api, "while_loop_node") and hasattr(torch.cuda, "CUDAGraph"):
        source = inspect.getsource(api)
        for name in WHILE_METHODS:
            assert f".{name}(" in source, f"torch's while_loop_node no longer calls {name}"
            assert hasattr(torch.cuda.CUDAGraph, name)
        assert s.while_loop is None or s.while_loop == s.cond  # only cond's reason (a driver) remains
    else:
        assert "while_loop_node" in (s.while_loop or "") or s.while_loop == s.cond


def test_fake_cf_switch_is_refused_at_capture_with_the_reason(
        fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    switch_op = getattr(torch.ops.higher_order, "switch", None)
    if switch_op is None:
        pytest.skip(f"torch {torch.__version__} has no torch.switch operator "
                    f"(torch._higher_order_ops.switch first shipped in 2.14)")
    install_conditional_nodes(fake_cuda, monkeypatch, while_nodes=True)
    s = get_backend("cuda").control_flow_support()
    assert s.cond is None and s.while_loop is None and "switch-node capture" in (s.switch or "")
    earlier = first_graph(fake_cuda)
    g = accel_graph.Graph(device="cuda:0")
    x = torch.ones(3)
    with pytest.raises(CaptureError) as info, accel_graph.graph(g):
        switch_op(torch.tensor(1), (lambda t: t + 1, lambda t: t * 2), (x,))
    msg = str(info.value)
    assert f"torch.switch cannot be captured into a CUDA graph on cuda:0 (cuda backend) with torch {torch.__version__}" in msg
    assert "switch_node" in msg and "Graph(device='cpu')" in msg
    assert_still_usable(g, earlier, fake_cuda)
