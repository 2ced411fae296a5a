"""Graph lifecycle hooks (accel_graph.graphs.hooks, torch 2.14's register_graph_*_hook) on the recorder,
which runs on every torch in CI: when each event fires, with what, in which order, removal, and
what a raising hook does (torch: swallowed, the rest still run)."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import accel_graph
from accel_graph import Graph

EVENTS = ("capture_start", "capture_end", "instantiate", "replay_start", "replay_end", "destroy")


class Recorder:
    """One hook per event, logging ``(event, detail)``; graph events log ``graph.state`` and keep
    only a weak reference, so the hooks never keep a graph alive."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.graphs: list[weakref.ref[Graph]] = []
        self.handles = []
        for event in EVENTS:
            register = getattr(accel_graph, f"register_graph_{event}_hook")
            self.handles.append(register(self._destroy if event == "destroy" else self._graph(event)))

    def _graph(self, event: str) -> Any:
        def hook(g: Graph) -> None:
            self.log.append((event, g.state))
            self.graphs.append(weakref.ref(g))
        return hook

    def _destroy(self, ids: set[int]) -> None:
        self.log.append(("destroy", ids))

    def events(self) -> list[str]:
        return [e for e, _ in self.log]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture
def rec() -> Iterator[Recorder]:
    gc.collect()  # graphs left by earlier tests are destroyed now, not into this log
    r = Recorder()
    yield r
    r.remove()


def capture(g: Graph, x: torch.Tensor) -> torch.Tensor:
    with g:
        y = x * 2 + 1
    return y


def test_keep_graph_false_order_and_arguments(rec: Recorder) -> None:
    x = torch.arange(4.0)
    g = Graph(device="cpu")
    y = capture(g, x)
    exec_id = g.exec_id
    assert isinstance(exec_id, int)
    g.replay()
    x.add_(1)
    g.replay()
    assert torch.equal(y, x * 2 + 1)  # the hooks changed nothing about replay
    g.reset()
    assert g.exec_id is None
    assert rec.log == [
        ("capture_start", "capturing"), ("capture_end", "instantiated"),
        ("instantiate", "instantiated"),
        ("replay_start", "instantiated"), ("replay_end", "instantiated"),
        ("replay_start", "instantiated"), ("replay_end", "instantiated"),
        ("destroy", {exec_id}),
    ]
    assert all(ref() is g for ref in rec.graphs)  # the accel_graph.Graph itself, every time
    del g
    gc.collect()
    assert rec.log[-1] == ("destroy", set())  # the cycle reset() began never instantiated


def test_keep_graph_true_instantiates_on_demand(rec: Recorder) -> None:
    x = torch.arange(3.0)
    g = Graph(True, device="cpu")
    capture(g, x)
    assert rec.events() == ["capture_start", "capture_end"]
    assert rec.log[1] == ("capture_end", "captured") and g.exec_id is None
    g.replay()  # instantiates first
    assert rec.events()[2:] == ["instantiate", "replay_start", "replay_end"]
    first = g.exec_id
    g.instantiate()  # already instantiated: nothing happens, no event (docs/torch-api.md)
    assert rec.events()[5:] == [] and g.exec_id == first
    g.reset()
    capture(g, x)
    g.instantiate()
    second = g.exec_id
    assert second not in (None, first)
    g.replay()
    del g
    gc.collect()
    assert rec.events()[5:] == [
        "destroy", "capture_start", "capture_end", "instantiate", "replay_start", "replay_end",
        "destroy",
    ]
    assert rec.log[5] == ("destroy", {first}) and rec.log[-1] == ("destroy", {second})


def test_capture_start_hook_runs_inside_the_capture(rec: Recorder) -> None:
    seen = []
    h = accel_graph.register_graph_capture_start_hook(
        lambda g: seen.append(accel_graph.is_current_stream_capturing("cpu")))
    try:
        capture(Graph(device="cpu"), torch.ones(2))
    finally:
        h.remove()
    assert seen == [True]


def test_reset_mid_capture_and_a_failed_capture(rec: Recorder) -> None:
    x = torch.ones(2)
    g = Graph(device="cpu")
    g.capture_begin()
    _ = x + 1
    g.reset()  # a reset ends the cycle whatever the state; nothing was instantiated
    assert rec.log == [("capture_start", "capturing"), ("destroy", set())]
    with pytest.raises(ValueError, match="body"):
        with g:
            _ = x + 1
            raise ValueError("body")
    # a capture that failed is dropped, not ended: no capture_end, the cycle goes on
    assert rec.events()[2:] == ["capture_start"] and g.state == "empty"
    capture(g, x)
    assert rec.events()[3:] == ["capture_start", "capture_end", "instantiate"]


def test_empty_graph_reset_fires_destroy_as_torch(rec: Recorder) -> None:
    g = Graph(device="cpu")
    g.reset()
    g.reset()
    assert rec.log == [("destroy", set()), ("destroy", set())]


def test_handle_remove_stops_one_hook_only(rec: Recorder) -> None:
    extra: list[str] = []
    h = accel_graph.register_graph_replay_start_hook(lambda g: extra.append("extra"))
    g = Graph(device="cpu")
    capture(g, torch.ones(2))
    g.replay()
    h.remove()
    h.remove()  # a second remove is harmless, as torch's RemovableHandle
    g.replay()
    assert extra == ["extra"]
    assert rec.events().count("replay_start") == 2  # the others stay registered
    with accel_graph.register_graph_replay_end_hook(lambda g: extra.append("ctx")):
        g.replay()
    g.replay()
    assert extra == ["extra", "ctx"]


def test_hooks_run_in_registration_order() -> None:
    order: list[int] = []
    handles = [accel_graph.register_graph_capture_end_hook(lambda g, i=i: order.append(i))
               for i in range(4)]
    handles[1].remove()
    try:
        capture(Graph(device="cpu"), torch.ones(2))
    finally:
        for h in handles:
            h.remove()
    assert order == [0, 2, 3]


def test_a_raising_hook_is_swallowed_and_the_rest_run(
    rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    def bad(_: object) -> None:
        raise RuntimeError("consumer bug")

    handles = [getattr(accel_graph, f"register_graph_{e}_hook")(bad) for e in EVENTS]
    after: list[str] = []
    handles.append(accel_graph.register_graph_replay_start_hook(lambda g: after.append("ran")))
    x = torch.arange(3.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="accel_graph.hooks"):
            g = Graph(device="cpu")
            y = capture(g, x)
            x.mul_(3)
            g.replay()
            g.reset()
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(y, x * 2 + 1)  # the graph worked through every raising hook
    assert after == ["ran"]
    assert rec.events() == ["capture_start", "capture_end", "instantiate", "replay_start",
                            "replay_end", "destroy"]
    raised = [r for r in caplog.records if r.exc_info and "consumer bug" in str(r.exc_info[1])]
    assert len(raised) == 6


def test_base_exceptions_propagate_as_torch() -> None:
    def interrupt(_: object) -> None:
        raise KeyboardInterrupt

    g = Graph(device="cpu")
    capture(g, torch.ones(2))
    h = accel_graph.register_graph_replay_start_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            g.replay()
    finally:
        h.remove()


def test_replay_end_fires_when_replay_raises(rec: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    g = Graph(device="cpu")
    capture(g, torch.ones(2))

    def boom() -> None:
        raise RuntimeError("replay failed")

    monkeypatch.setattr(g._impl, "replay", boom)
    with pytest.raises(RuntimeError, match="replay failed"):
        g.replay()
    assert rec.events()[-2:] == ["replay_start", "replay_end"]


def test_refused_replay_fires_nothing(rec: Recorder) -> None:
    g = Graph(device="cpu")
    with pytest.raises(accel_graph.GraphStateError):
        g.replay()
    assert rec.log == []


def test_hook_registered_late_still_hears_destroy() -> None:
    g = Graph(device="cpu")
    capture(g, torch.ones(2))
    exec_id = g.exec_id
    gc.collect()  # graphs of earlier tests go now, not into this hook
    seen: list[set[int]] = []
    h = accel_graph.register_graph_destroy_hook(seen.append)
    try:
        del g
        gc.collect()
    finally:
        h.remove()
    assert seen == [{exec_id}]


def test_hooks_do_not_keep_graphs_alive(rec: Recorder) -> None:
    g = Graph(device="cpu")
    capture(g, torch.ones(2))
    ref = weakref.ref(g)
    del g
    gc.collect()
    assert ref() is None and rec.events()[-1] == "destroy"


def test_exec_ids_are_unique_across_graphs(rec: Recorder) -> None:
    graphs = [Graph(device="cpu") for _ in range(3)]
    for g in graphs:
        capture(g, torch.ones(2))
    ids = {g.exec_id for g in graphs}
    assert len(ids) == 3 and None not in ids


@pytest.mark.parametrize("event", EVENTS)
def test_registering_a_non_callable_says_what_to_pass(event: str) -> None:
    register = getattr(accel_graph, f"register_graph_{event}_hook")
    with pytest.raises(TypeError, match="takes a callable, got int"):
        register(3)


def test_exports() -> None:
    from accel_graph.graphs import hooks

    for event in EVENTS:
        name = f"register_graph_{event}_hook"
        assert name in accel_graph.__all__
        assert getattr(accel_graph, name) is getattr(hooks, name)
        # torch's name, where this torch has it (2.14): the same registration function
        torch_fn = getattr(torch.cuda.graphs, name, None)
        if torch_fn is not None:
            assert torch_fn.__name__ == name


def test_graph_runner_graphs_fire_the_hooks(rec: Recorder) -> None:
    """A server built on GraphRunner sees its buckets' graphs through the same hooks."""
    from accel_graph import GraphRunner

    def affine(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    runner = GraphRunner(affine, torch.zeros(1, 3), buckets=[1, 2], device="cpu",
                         progress=False).capture()
    captured = rec.events().count("capture_end")
    assert captured >= 2 and rec.events().count("instantiate") >= 2  # one per bucket at least
    before = rec.events().count("replay_start")
    out = runner(torch.ones(2, 3))
    assert torch.equal(out, torch.full((2, 3), 3.0))
    assert rec.events().count("replay_start") == before + 1
    assert rec.events().count("replay_end") == before + 1
