"""accel_graph.Graph mirrors torch.accelerator.Graph (2.12+) member for member; intended
differences are the one table accel_graph.graphs.torch_api.GRAPH_API_DIFFERENCES, rendered in
docs/torch-api.md. The drift checks introspect the installed torch (2.13 and 2.14.1 in CI)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import accel_graph
from accel_graph import ConfigError, Graph
from accel_graph.backends.base import PoolHandle
from accel_graph.graphs.torch_api import (
    ACCELERATOR_GRAPH,
    CUDA_GRAPH,
    GRAPH_API_DIFFERENCES,
    api_drift,
    differences_markdown,
    stale_differences,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "torch-api.md"

needs_accelerator_graph = pytest.mark.skipif(
    not hasattr(getattr(torch, "accelerator", None), "Graph"),
    reason=f"torch {torch.__version__} has no torch.accelerator.Graph (first shipped in 2.12)",
)


def unlisted(drift: list) -> list[str]:
    return [str(d) for d in drift if (d.reference, d.subject) not in GRAPH_API_DIFFERENCES]


@needs_accelerator_graph
def test_no_unlisted_drift_from_accelerator_graph() -> None:
    assert unlisted(api_drift(Graph, torch.accelerator.Graph, ACCELERATOR_GRAPH)) == []


@needs_accelerator_graph
def test_no_stale_accelerator_graph_entries() -> None:
    assert stale_differences(Graph, torch.accelerator.Graph, ACCELERATOR_GRAPH) == []


@needs_accelerator_graph
def test_every_accelerator_graph_method_is_there() -> None:
    # the list, checked by name as well as by the generic walk above
    for name in ("capture_begin", "capture_end", "instantiate", "replay", "reset", "pool",
                 "debug_dump", "enable_debug_mode", "__enter__", "__exit__"):
        assert hasattr(torch.accelerator.Graph, name)
        assert callable(getattr(Graph, name))


def test_no_unlisted_drift_from_cuda_graph() -> None:
    # extra parameters of ours are fine against CUDAGraph: code written for it never passes them
    drift = api_drift(Graph, torch.cuda.CUDAGraph, CUDA_GRAPH, extras=False)
    assert unlisted(drift) == []
    assert stale_differences(Graph, torch.cuda.CUDAGraph, CUDA_GRAPH, extras=False) == []


def test_constructor_signature_as_torch_2_14() -> None:
    params = list(inspect.signature(Graph).parameters.values())
    P = inspect.Parameter
    assert [(p.name, p.kind, p.default) for p in params[:3]] == [
        ("keep_graph", P.POSITIONAL_OR_KEYWORD, False),
        ("pool", P.KEYWORD_ONLY, None),
        ("capture_error_mode", P.KEYWORD_ONLY, "default"),
    ]
    assert all(p.kind is P.KEYWORD_ONLY for p in params[3:])
    assert Graph(True, device="cpu").keep_graph is True
    with pytest.raises(TypeError):
        Graph(False, None, device="cpu")  # pool is keyword-only, as in torch


@pytest.mark.parametrize("mode", ["default", "global", "thread_local", "relaxed"])
def test_each_capture_error_mode_is_accepted(mode: str) -> None:
    g = Graph(device="cpu", capture_error_mode=mode)
    assert g.capture_error_mode == mode
    x = torch.ones(2)
    with g:
        y = x + 1
    x.fill_(5)
    g.replay()
    assert torch.equal(y, torch.full((2,), 6.0))


def test_unknown_capture_error_mode_names_the_four() -> None:
    with pytest.raises(ConfigError, match="'default', 'global', 'thread_local', 'relaxed'|"
                                          "default, global, thread_local, relaxed"):
        Graph(device="cpu", capture_error_mode="strict")


def test_attributes_set_between_captures_apply_to_the_next() -> None:
    g = Graph(device="cpu")
    with g:
        _ = torch.ones(2) + 1
    first_pool = g.pool()
    g.reset()
    shared = accel_graph.graph_pool_handle("cpu")
    g.graph_pool = shared  # as torch.accelerator.Graph: plain attributes read by capture_begin
    g.capture_error_mode = "relaxed"
    with g:
        _ = torch.ones(2) + 1
    assert g.pool() == shared and g.pool() != first_pool


def test_behaviour_rows_hold() -> None:
    """The `member: topic` rows of the table, which no signature shows."""
    g = Graph(device="cpu")
    with g as same:  # __enter__: return value
        _ = torch.ones(2) * 3
    assert same is g
    assert isinstance(g.pool(), PoolHandle)  # pool: return value
    g.reset()
    with pytest.raises(RuntimeError, match="inside"):  # __exit__: body raised
        with g:
            raise RuntimeError("inside")
    assert g.state == "empty"
    k = Graph(True, device="cpu")  # instantiate: again
    with k:
        _ = torch.ones(2) * 3
    k.instantiate()
    first = k.exec_id
    k.instantiate()
    assert k.exec_id == first
    # device: extra attribute: a torch.device, so torch takes it; device_spec is the backend's
    assert isinstance(g.device, torch.device) and g.device == torch.device("cpu")
    assert (g.device.type, g.device.index) == ("cpu", None)
    assert torch.zeros(2, device=g.device).device == g.device
    spec = g.device_spec
    assert spec.torch_device == g.device and spec.backend == g.backend.name
    g.backend.synchronize(g.device_spec)


def test_docs_table_matches_the_code_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- graph-api-differences:begin -->\n(.*?)<!-- graph-api-differences:end -->",
                      text, re.S)
    assert block, "docs/torch-api.md lost its graph-api-differences markers"
    rows = {}
    for line in block.group(1).splitlines()[2:]:
        m = re.fullmatch(r"\| `([^`]+)` \| `([^`]+)` \| (.*) \|", line)
        assert m, f"not a table row: {line!r}"
        rows[(m.group(1), m.group(2))] = m.group(3)
    assert rows == GRAPH_API_DIFFERENCES, (
        "docs/torch-api.md disagrees with accel_graph.graphs.torch_api.GRAPH_API_DIFFERENCES; paste "
        "differences_markdown() between the markers"
    )
    assert block.group(1) == differences_markdown()


class _TorchNext:
    """A made-up torch release that drifted from ours in each way the check must catch."""

    def __init__(self, keep_graph: bool = True, *, pool: object = None,
                 capture_error_mode: str = "default", stream: object = None) -> None: ...
    def capture_begin(self, capture_error_mode: str | None = None, pool: object = None) -> None: ...
    def capture_end(self) -> None: ...
    def replay(self, *, sync: bool = False) -> None: ...
    def reset(self) -> None: ...
    def instantiate(self) -> None: ...
    def pool(self) -> tuple[int, int]: ...
    def debug_dump(self, *, path: str) -> None: ...
    def enable_debug_mode(self) -> None: ...
    def replay_n(self, n: int) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc_info: object) -> None: ...


def test_the_drift_check_catches_each_kind() -> None:
    found = {d.subject: d.what for d in api_drift(Graph, _TorchNext, "torch.next")}
    assert "default False, torch True" in found["constructor(keep_graph)"]
    assert "Graph has none" in found["constructor(stream)"]
    assert "Graph has none" in found["replay(sync)"]
    assert "kind positional or keyword, torch keyword-only" in found["debug_dump(path)"]
    assert found["replay_n"] == "torch has this method; Graph has not"
    assert found["capture_begin(capture_error_mode)"] == "position 1, torch 0"
    assert "extra parameter" in found["constructor(device)"]
    assert "capture_end" not in found and "__exit__(exc_info)" not in found
