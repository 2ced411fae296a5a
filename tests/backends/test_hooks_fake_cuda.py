"""Graph lifecycle hooks on the cuda backend against a FAKE torch.cuda: plumbing only.

Nothing runs on a GPU. The fake ``CUDAGraph`` logs calls; ``install_torch_graph_hooks`` makes it
fire FAKE torch-2.14-style module hooks too, so the tests show that a hook registered through
``accel_graph`` fires exactly once per event on a native graph (never forwarded to torch's
registry), with the ``accel_graph.Graph``, while torch's own registry fires for torch's object.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import accel_graph

from .fakes import FakeCudaModule, install_torch_graph_hooks

EVENTS = ("capture_start", "capture_end", "instantiate", "replay_start", "replay_end", "destroy")


def register_all(register: Any, log: list[tuple[str, Any]]) -> list[Any]:
    """Register one logging hook per event through ``register(event, fn)``; graph events log
    the argument's type name (not the graph itself, which would keep it alive). Graphs left
    by earlier tests are collected first, so their destroy events do not land in ``log``."""
    gc.collect()
    handles = []
    for event in EVENTS:
        if event == "destroy":
            handles.append(register(event, lambda ids, e=event: log.append((e, ids))))
        else:
            handles.append(register(event, lambda g, e=event: log.append((e, type(g).__name__))))
    return handles


def ours(event: str, fn: Any) -> Any:
    return getattr(accel_graph, f"register_graph_{event}_hook")(fn)


def torchs(event: str, fn: Any) -> Any:
    return getattr(torch.cuda.graphs, f"register_graph_{event}_hook")(fn)


def run_cycle(fake: FakeCudaModule, keep_graph: bool) -> int | None:
    """Capture, replay twice, reset, drop: the exec id the capture got."""
    g = accel_graph.Graph(keep_graph, device="cuda:0")
    with accel_graph.graph(g):
        fake.allocate(256)
    g.replay()
    g.replay()
    exec_id = g.exec_id
    g.reset()
    del g
    gc.collect()
    return exec_id


@pytest.mark.parametrize("torch_has_hooks", [True, False], ids=["torch-2.14-hooks", "no-torch-hooks"])
def test_fake_cuda_graph_fires_each_accel_graph_hook_once(
    fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch, torch_has_hooks: bool
) -> None:
    mine: list[tuple[str, Any]] = []
    theirs: list[tuple[str, Any]] = []
    registries = install_torch_graph_hooks(fake_cuda, monkeypatch) if torch_has_hooks else None
    handles = register_all(ours, mine)
    if torch_has_hooks:
        handles += register_all(torchs, theirs)
    try:
        exec_id = run_cycle(fake_cuda, keep_graph=False)
    finally:
        for h in handles:
            h.remove()
    assert exec_id is not None
    assert mine == [
        ("capture_start", "Graph"), ("capture_end", "Graph"), ("instantiate", "Graph"),
        ("replay_start", "Graph"), ("replay_end", "Graph"),
        ("replay_start", "Graph"), ("replay_end", "Graph"),
        ("destroy", {exec_id}),   # reset() ends the cycle that instantiated
        ("destroy", set()),       # collection ends the (empty) cycle reset() began
    ]
    assert fake_cuda.replays == 2
    if torch_has_hooks:
        # torch's registry heard torch's own object, once per event; ours were never in it
        assert theirs == [
            ("capture_start", "FakeCUDAGraph"), ("capture_end", "FakeCUDAGraph"),
            ("instantiate", "FakeCUDAGraph"), ("replay_start", "FakeCUDAGraph"),
            ("replay_end", "FakeCUDAGraph"), ("replay_start", "FakeCUDAGraph"),
            ("replay_end", "FakeCUDAGraph"), ("destroy", set()),
        ]
        assert registries is not None and not any(registries.values())  # all removed


def test_fake_cuda_keep_graph_instantiates_at_first_replay(fake_cuda: FakeCudaModule) -> None:
    log: list[tuple[str, Any]] = []
    handles = register_all(ours, log)
    try:
        g = accel_graph.Graph(True, device="cuda:0")
        with accel_graph.graph(g):
            fake_cuda.allocate(64)
        assert [e for e, _ in log] == ["capture_start", "capture_end"]
        g.replay()
        assert [e for e, _ in log][2:] == ["instantiate", "replay_start", "replay_end"]
        assert [c for c, _ in fake_cuda.graphs[-1].calls] == [
            "capture_begin", "capture_end", "instantiate", "replay"]
    finally:
        for h in handles:
            h.remove()


def test_fake_cuda_replay_end_fires_when_the_launch_raises(
    fake_cuda: FakeCudaModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    handles = [accel_graph.register_graph_replay_start_hook(lambda g: log.append("start")),
               accel_graph.register_graph_replay_end_hook(lambda g: log.append("end"))]
    try:
        g = accel_graph.Graph(device="cuda:0")
        with accel_graph.graph(g):
            fake_cuda.allocate(64)

        def launch_fails() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        # the backend binds torch's replay as the impl's instance attribute: replace that
        monkeypatch.setattr(g._impl, "replay", launch_fails)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            g.replay()
        assert log == ["start", "end"]
    finally:
        for h in handles:
            h.remove()


def test_real_torch_registry_is_left_alone() -> None:
    """Against the installed torch's real torch.cuda.graphs: registering through accel_graph
    adds nothing to torch's module registries (2.14), or torch has none (2.13, 2.11)."""
    graphs = torch.cuda.graphs
    torch_regs = [getattr(graphs, f"_global_{e}_hooks", None) for e in EVENTS]
    if not hasattr(graphs, "register_graph_capture_start_hook"):
        assert all(r is None for r in torch_regs)  # no hooks in this torch: nothing to mirror
        return
    before = [len(r) for r in torch_regs]
    log: list[tuple[str, Any]] = []
    handles = register_all(ours, log)
    try:
        assert [len(r) for r in torch_regs] == before
    finally:
        for h in handles:
            h.remove()
