"""The compiled-replay variant of the suite checks what it claims to check.

Every device test runs twice on a backend that compiles (the recorder): interpreted
(``recorder``) and compiled (``recorder+inductor``, ``ACCEL_GRAPH_COMPILE=inductor``). These tests
make sure a ``+inductor`` case really replays compiled code, and that a graph whose compilation
fell back to interpreted replay fails its case instead of passing unnoticed.
"""

from __future__ import annotations

import json

import pytest

from accel_graph.testing import assert_replay_matches, capture, compiled_replay

from ._util import copy_into, gen, randn


def _fn(x, w):
    return (x @ w).relu() + 1


def test_compiled_case_replays_compiled_code(make_graph, device, accel_graph_compile, tmp_path):
    if accel_graph_compile is None:
        pytest.skip("interpreted case: nothing is compiled")
    assert compiled_replay(), "the +inductor case did not set ACCEL_GRAPH_COMPILE"
    x, w = randn(gen(0), 4, 8, device=device), randn(gen(1), 8, 3, device=device)
    g = make_graph()
    out = capture(g, _fn, x, w)
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    with open(f"{path}.json") as fh:
        info = json.load(fh)["compiled"]
    assert info is not None and info.get("backend") == accel_graph_compile, info
    assert "fallback" not in info, f"compilation fell back: {info['fallback']}"
    assert info["compile_s"] >= 0
    # The case forces the compiled program (ACCEL_GRAPH_COMPILE_REPLAY): timing must not swap
    # in the interpreted one, or the +inductor suite would test nothing compiled.
    mode = g.replay_mode()
    assert mode.mode == "compiled" and "forced" in mode.reason, mode
    assert info["replay_mode"]["mode"] == "compiled"
    fresh = [randn(gen(2), 4, 8, device=device), w]
    copy_into([x, w], fresh)
    g.replay()
    assert_replay_matches(out, _fn(*fresh))


_INNER = """
import torch
import accel_graph.backends.recorder.compiled.choice as compiled_choice
from accel_graph.testing import capture

def _no_compiler(*args, **kwargs):
    raise RuntimeError("no C++ compiler in this test")

def test_it(make_graph, device, monkeypatch):
    monkeypatch.setattr(compiled_choice, "compile_program", _no_compiler)
    x = torch.ones(3, device=device)
    g = make_graph()
    out = capture(g, lambda x: x + 1, x)
    g.replay()
    assert torch.equal(out, x + 1)  # the fallback replays right: only the plugin objects
"""


def test_a_fallback_fails_the_compiled_case(pytester):
    """A graph that falls back to interpreted replay fails its ``+inductor`` case, with the
    logged reason, even though its results are right."""
    pytester.makeconftest('pytest_plugins = ["accel_graph.testing.plugin"]')
    pytester.makepyfile(test_inner=_INNER)
    result = pytester.runpytest_inprocess(
        "--accel-graph-backend=recorder", "-p", "no:cacheprovider", "-rA"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "PASSED test_inner.py::test_it?recorder?",
            "FAILED test_inner.py::test_it?recorder+inductor?*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*1 graph(s) fell back to interpreted replay*", "*RuntimeError: no C++ compiler*"]
    )
