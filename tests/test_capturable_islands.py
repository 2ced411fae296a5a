"""Issue 26 item 4: ``check_capturable`` names, for each refused op, the smallest enclosing
``nn.Module`` to mark as an eager island, by class and attribute path."""

from __future__ import annotations

import functools
import json
import threading

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

from accel_graph import check_capturable
from accel_graph.testing.capturable import assert_capturable


class Router(nn.Module):
    """The MoE router pattern: reads the choice on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)
        hit = (logits > 0).nonzero()  # data-dependent shape
        if hit.numel() and logits.max() > 100:  # a host read
            logits = logits * 2
        return logits


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.router = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(self.norm(x))


class Net(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.head(layer(x))
        return x


class Loose(nn.Module):
    """Returns a Python number beside its tensor: not an island (outputs must be tensors)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x + 1, int(x.sum())  # int(): a host read


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loose = Loose()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, n = self.loose(x)
        return y * 2


model = Net()  # a global the step names, as in the recipes


def step(x: torch.Tensor) -> torch.Tensor:
    return model(x)


def dispatch(report) -> list:
    return [f for f in report if f.level == "dispatch"]


def test_each_refused_op_names_its_innermost_module_by_path_and_class() -> None:
    rep = check_capturable(step, torch.randn(2, 4), steps=1)
    found = dispatch(rep)
    assert found and all(f.island is not None for f in found)
    paths = {f.island["path"] for f in found}
    assert paths == {"model.layers.0.router", "model.layers.1.router"}
    f = found[0]
    assert f.island["class"] == "Router" and f.island["root"] == "model"
    assert f.island["submodule"] == "layers.0.router"
    assert model.get_submodule(f.island["submodule"]) is model.layers[0].router
    # coarser islands that would do too, innermost first, up to the root itself
    assert [w["class"] for w in f.island["within"]] == ["Block", "Net"]
    assert f.island["within"][0]["path"] == "model.layers.0"
    assert f.island["within"][1]["path"] == "model"


def test_report_text_and_json_name_the_island_and_keep_the_finding_lines() -> None:
    rep = check_capturable(step, torch.randn(2, 4), steps=1)
    text = rep.format()
    lines = text.splitlines()
    assert lines[0].startswith(f"{len(rep)} capture-illegal operation(s)")
    for f in rep.unique():  # each finding's own line as before
        assert f"  {f}" in lines
        assert "eager island" not in str(f)
    assert ("mark model.layers.0.router, model.layers.1.router (Router) as eager islands, or "
            "every Router") in text
    assert "the enclosing Block would do too" in text
    data = json.loads(json.dumps(rep.as_dict()))
    assert data["findings"][0]["island"]["path"] == "model.layers.0.router"


def test_one_module_is_named_alone_with_its_enclosing_one() -> None:
    net = Net(n=1)
    rep = check_capturable(net, torch.randn(2, 4), steps=1)
    assert {f.island["path"] for f in dispatch(rep)} == {"Net.layers.0.router"}
    assert "mark Net.layers.0.router (Router) as an eager island" in rep.format()
    assert "the enclosing Net.layers.0 (Block) would do too" in rep.format()


def test_a_module_returning_non_tensors_is_skipped_for_the_enclosing_one() -> None:
    holder = Holder()
    rep = check_capturable(lambda x: holder(x), torch.ones(3), steps=1)
    (f,) = dispatch(rep)
    assert f.island["path"] == "holder" and f.island["class"] == "Holder"
    assert f.island["within"] == []


def test_ops_outside_every_module_have_no_island_and_say_so() -> None:
    def bare(x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum() + x

    rep = check_capturable(bare, torch.randn(5), steps=1)
    assert rep.findings and all(f.island is None for f in rep.findings)
    assert "outside every nn.Module" in rep.format()
    assert "@accel_graph.eager_island" in rep.format()


def test_capturable_function_gets_no_island_lines() -> None:
    rep = check_capturable(lambda x: model.head(x), torch.randn(2, 3))
    assert rep.ok and "island" not in rep.format()


@pytest.mark.parametrize("how", ["argument", "kwarg", "closure", "partial", "bound", "server",
                                 "global", "helper", "list"])
def test_roots_are_found_where_the_function_reaches_its_model(how: str) -> None:
    net = Net(n=1)
    x = torch.randn(2, 4)

    class Server:
        def __init__(self) -> None:
            self.engine = net

        def run(self, x: torch.Tensor) -> torch.Tensor:
            return self.engine(x)

    if how == "argument":
        rep, root = check_capturable(lambda m, x: m(x), net, x, steps=1), "m"
    elif how == "kwarg":
        rep, root = check_capturable(lambda x, *, net: net(x), x, net=net, steps=1), "net"
    elif how == "closure":
        rep, root = check_capturable(lambda x: net(x), x, steps=1), "net"
    elif how == "partial":
        rep = check_capturable(functools.partial(lambda m, x: m(x), net), x, steps=1)
        root = "m"
    elif how == "bound":
        rep, root = check_capturable(net.forward, x, steps=1), "self"
    elif how == "server":
        rep, root = check_capturable(Server().run, x, steps=1), "self.engine"
    elif how == "global":
        rep, root = check_capturable(step, x, steps=1), "model"  # the global model, not net
    elif how == "helper":  # a lambda calling a global function that names the model
        rep, root = check_capturable(lambda x: step(x), x, steps=1), "model"
    else:
        rep, root = check_capturable(lambda ms, x: ms[0](x), [net], x, steps=1), "ms[0]"
    f = dispatch(rep)[0]
    assert f.island["root"] == root and f.island["path"] == f"{root}.layers.0.router"
    assert f.island["submodule"] == "layers.0.router"


def test_a_module_no_root_reaches_is_named_from_the_outermost_call() -> None:
    def fresh(x: torch.Tensor) -> torch.Tensor:
        return Net(n=1)(x)  # built inside: no argument, closure or global holds it

    f = dispatch(check_capturable(fresh, torch.randn(2, 4), steps=1))[0]
    assert f.island["path"] == "<Net>.layers.0.router" and f.island["root"] == "<Net>"


def _global_hooks() -> tuple[int, int]:
    return len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)


def test_hooks_are_removed_after_the_check_also_when_the_function_raises() -> None:
    before = _global_hooks()
    check_capturable(step, torch.randn(2, 4))
    assert _global_hooks() == before

    def broken(x: torch.Tensor) -> torch.Tensor:
        model(x)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        check_capturable(broken, torch.randn(2, 4))
    assert _global_hooks() == before


def test_module_calls_of_other_threads_are_not_counted() -> None:
    other = Net(n=1)
    started, stop = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        while not stop.is_set():
            other(torch.randn(2, 4))

    t = threading.Thread(target=busy)
    t.start()
    started.wait()
    try:
        rep = check_capturable(step, torch.randn(2, 4), steps=1)
    finally:
        stop.set()
        t.join()
    assert {f.island["path"] for f in dispatch(rep)} == {"model.layers.0.router",
                                                         "model.layers.1.router"}


def test_a_forward_that_raises_inside_a_module_is_not_an_island() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.nonzero()
            raise ValueError("inner")

    class Catches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fails = Fails()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                self.fails(x)
            except ValueError:
                pass
            return x + 1

    c = Catches()
    (f,) = dispatch(check_capturable(c, torch.ones(2), steps=1))
    assert f.island["path"] == "Catches" and f.island["class"] == "Catches"


def test_assert_capturable_names_the_island() -> None:
    with pytest.raises(AssertionError) as info:
        assert_capturable(step, torch.randn(2, 4))
    assert "mark model.layers.0.router, model.layers.1.router (Router)" in str(info.value)


# --- islands already marked: run eagerly, unflagged (a capture runs them at every replay) ---

def test_marked_modules_are_not_reported_and_the_rest_still_is() -> None:
    import accel_graph

    net = Net()
    before = check_capturable(net, torch.randn(2, 4), steps=1)
    accel_graph.eager_island(net.layers[0].router)
    rep = check_capturable(net, torch.randn(2, 4), steps=1)
    assert rep.findings and {f.island["path"] for f in rep} == {"Net.layers.1.router"}
    assert rep.ops_seen < before.ops_seen
    accel_graph.eager_island(net.layers[1].router)
    assert check_capturable(net, torch.randn(2, 4)).ok
    from accel_graph.backends.capture_common import islands as marks
    assert marks.capture_runner() is None  # the check's runner is gone


def test_a_function_island_may_read_the_host_and_bake_nothing() -> None:
    import accel_graph

    state = {"n": 0}

    def route(x: torch.Tensor) -> torch.Tensor:
        state["n"] += 1  # host state read each call: baked outside an island
        return x[x > 0].sum() + x * state["n"]

    bare = check_capturable(lambda x: route(x) * 2, torch.randn(4))
    assert {f.level for f in bare} >= {"dispatch", "baked"}
    island = accel_graph.eager_island(route)
    rep = check_capturable(lambda x: island(x) * 2, torch.randn(4))
    assert rep.ok, rep.format()


def test_an_island_returning_a_number_is_reported() -> None:
    import accel_graph

    @accel_graph.eager_island
    def count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x + 1, int(x.sum())

    rep = check_capturable(lambda x: count(x)[0], torch.ones(3), steps=1)
    (f,) = rep.findings
    assert f.op.startswith("eager_island ") and "count" in f.op
    assert "returns int 3" in f.reason and "CaptureError" in f.reason
    assert "test_capturable_islands.py" in f.location


def test_an_island_in_a_cond_branch_is_reported() -> None:
    import accel_graph

    @accel_graph.eager_island
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda y: inner(y), lambda y: y - 1, (x,))

    rep = check_capturable(fn, torch.ones(3), steps=1)
    assert [f.op for f in rep] == [f"eager_island {inner.__qualname__}"]
    assert "torch.cond" in rep.findings[0].reason
    assert torch.equal(rep.result, torch.full((3,), 2.0))
