"""A compile request on a native backend (FAKE CUDA: plumbing, not the GPU): never dropped
silently. ``Backend.new_graph`` receives the resolved ``CompileOptions`` and warns once per
graph, at the line that built the ``Graph`` (also when the runner builds one per bucket)."""

from __future__ import annotations

import warnings

import pytest

import accel_graph
from accel_graph.graphs.graph import resolved_graph

from .fakes import FakeCudaModule


def test_compile_warning_points_at_the_line_that_built_the_graph(fake_cuda: FakeCudaModule) -> None:
    with pytest.warns(UserWarning, match="compile='inductor' is ignored on the cuda backend") as rec:
        accel_graph.Graph(device="cuda:0", compile="inductor", compile_options={"freeze": True})
    assert [w.filename for w in rec] == [__file__]
    with pytest.warns(UserWarning, match="is ignored on the cuda backend") as rec:
        resolved_graph(device="cuda:0", pool=None,
                       compile=accel_graph.CompileOptions())
    assert [w.filename for w in rec] == [__file__]


def test_no_compile_request_no_warning(fake_cuda: FakeCudaModule,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel_graph.Graph(device="cuda:0")
