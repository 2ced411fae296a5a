"""One replay policy, and ``compile=`` resolved once and passed typed (issue 25, item 2).

- :class:`ReplayPolicy` maps the resolved ``compile=`` and the facts of compiled replay to the
  ``ReplayMode`` a graph shows, in the documented order.
- ``resolve_compile`` returns ``CompileOptions | None``; ``Backend.new_graph`` takes it typed.
- ``GraphRunner`` resolves it at construction: the environment is not read again per bucket.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import accel_graph as ag
from accel_graph.backends.base import Backend
from accel_graph.backends.recorder.backend import RecorderBackend
from accel_graph.backends.recorder.compiled.policy import ReplayPolicy
from accel_graph.errors import BackendUnavailable, ConfigError
from accel_graph.foundation.compile_options import CompileOptions, resolve_compile
from accel_graph.graphs.graph import resolved_graph


@pytest.fixture(autouse=True)
def _no_compile_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE", raising=False)
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE_REPLAY", raising=False)


def test_resolve_compile_is_none_or_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_compile(None, None) is None
    assert resolve_compile("inductor", None) == CompileOptions()
    assert resolve_compile("inductor", {"freeze": True}) == CompileOptions(freeze=True)
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE", "inductor")
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE_REPLAY", "compiled")
    assert resolve_compile(None, None) == CompileOptions(replay="compiled")
    with pytest.raises(ConfigError, match="unknown compile="):
        resolve_compile("inductr", None)


def test_new_graph_takes_the_resolved_value_typed() -> None:
    for cls in (Backend, RecorderBackend):
        params = inspect.signature(cls.new_graph).parameters
        assert list(params) == ["self", "device", "keep_graph", "compile"]
        assert params["compile"].kind is inspect.Parameter.KEYWORD_ONLY


def test_policy_decides_in_the_documented_order() -> None:
    off = ReplayPolicy(None)
    assert not off.compiled_requested
    assert off.not_instantiated().mode == "interpreted"
    auto = ReplayPolicy(CompileOptions())
    assert auto.compiled_requested and auto.not_instantiated().mode == "undecided"
    assert "reset" in auto.not_instantiated(reset=True).reason
    assert auto.skip_compile() is None
    forced_i = ReplayPolicy(CompileOptions(replay="interpreted")).skip_compile()
    assert forced_i is not None and forced_i[0].mode == "interpreted"
    assert forced_i[1] == {"backend": "inductor", "skipped": "compile_options replay='interpreted'"}
    forced_c = ReplayPolicy(CompileOptions(replay="compiled"))
    # A failed compile wins over everything after it; then forced compiled; then collectives.
    assert forced_c.untimed("boom", collectives=True).reason == "compilation failed (boom)"
    assert forced_c.untimed(None, collectives=True).reason.startswith("forced by")
    assert auto.untimed(None, collectives=True).mode == "compiled"
    assert auto.untimed(None, collectives=False) is None  # auto: time both
    assert auto.observable_at_instantiation(None, shares_pool=False) is None
    assert "share its pool" in auto.observable_at_instantiation(None, shares_pool=True)
    assert "random" in auto.observable_at_instantiation("it draws random numbers", shares_pool=True)
    mode = auto.timed(2e-3, 1e-3, 5, "at instantiation")
    assert (mode.mode, mode.decided_at, mode.rounds) == ("interpreted", "instantiate", 5)
    assert auto.timed(1e-3, 1e-3, 3, "on the first real replays").mode == "compiled"  # ties
    assert auto.deciding(4, "why").mode == "undecided"
    assert auto.first_run_failed("x").mode == "interpreted"


def test_graph_reports_a_bad_device_before_a_bad_compile() -> None:
    with pytest.raises(BackendUnavailable):
        ag.Graph(device="meta", compile="inductr")
    with pytest.raises(ConfigError, match="unknown compile="):
        ag.Graph(device="cpu", compile="inductr")


def test_resolved_graph_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE", "inductor")
    g = resolved_graph(device="cpu", pool=None, compile=None)
    assert g.replay_mode().mode == "interpreted" and g.keep_graph is False
    assert g.capture_error_mode == "default"


def test_runner_resolves_compile_once_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE", "inductor")
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE_REPLAY", "interpreted")  # compiles nothing: fast
    r = ag.GraphRunner(lambda x: x * 2, torch.zeros(1, 4), buckets=[1, 2], progress=False)
    assert r.compile is None  # as given
    assert r.runtime.options.graph_compile == CompileOptions(replay="interpreted")
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE")  # read at construction, not again per bucket
    r.capture()
    for b in (1, 2):
        g = r.graph(b)
        assert g is not None and g.compile_info() == {
            "backend": "inductor", "skipped": "compile_options replay='interpreted'"}
    # And the other way round: unset at construction, set before capture: not compiled.
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE_REPLAY")
    r2 = ag.GraphRunner(lambda x: x * 2, torch.zeros(1, 4), buckets=[1], progress=False)
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE", "inductor")
    r2.capture()
    g2 = r2.graph(1)
    assert g2 is not None and g2.compile_info() is None
    assert g2.replay_mode().mode == "interpreted"
