"""``GraphRunner(dynamic=...)`` (issue 24 item 7): the ladder from a
``torch.fx.experimental.dynamic_spec`` ShapeVar/IntVar, its validation, and the behaviour where
torch has no such module (simulated: both torch versions CI runs, 2.13.0 and 2.14.1, ship it)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import accel_graph
from accel_graph import ConfigError
from accel_graph.runner.buckets import default_ladder

ds = pytest.importorskip(
    "torch.fx.experimental.dynamic_spec",
    reason=f"torch {torch.__version__} has no torch.fx.experimental.dynamic_spec")
ShapeVar, IntVar, TensorSpec = ds.ShapeVar, ds.IntVar, ds.TensorSpec


def _step(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).sin()


def _runner(**kw) -> accel_graph.GraphRunner:
    return accel_graph.GraphRunner(_step, (torch.randn(2, 5),), **kw)


@pytest.mark.parametrize(("lo", "hi", "ladder"), [
    (1, 64, default_ladder(64)),
    (0, 10, [1, 2, 4, 8, 10]),           # ShapeVar's default min is 0: a batch has >= 1 row
    (3, 20, [4, 8, 16, 20]),             # no bucket below min: no batch in range would use it
    (17, 17, [17]),
    (40, 300, [40, 48, 56, *range(64, 249, 8), 256, 272, 288, 300]),
])
def test_ladder_is_the_runner_rule_over_the_spec_range(lo, hi, ladder):
    assert _runner(dynamic=ShapeVar("batch", min=lo, max=hi)).buckets == ladder


def test_intvar_and_tensorspec_name_the_batch_too():
    assert _runner(dynamic=IntVar("n", max=8)).buckets == [1, 2, 4, 8]  # min None: from 1
    b = ShapeVar("batch", min=2, max=8)
    assert _runner(dynamic=TensorSpec([b, 5])).buckets == [2, 4, 8]


def test_runner_built_from_a_spec_serves_every_batch_in_range():
    runner = _runner(dynamic=ShapeVar("batch", min=1, max=12), strict=True).capture()
    assert runner.captured_buckets == [1, 2, 4, 8, 12]
    for n in (1, 3, 9, 12):
        x = torch.randn(n, 5)
        torch.testing.assert_close(runner(x), _step(x))
    assert not runner.stats()["eager_fallbacks"]  # every batch replayed a graph


def test_max_batch_or_buckets_agreeing_with_the_spec_are_accepted():
    b = ShapeVar("batch", min=2, max=16)
    assert _runner(dynamic=b, max_batch=16).buckets == [2, 4, 8, 16]
    assert _runner(dynamic=b, buckets=[4, 16]).buckets == [4, 16]


@pytest.mark.parametrize(("kw", "match"), [
    ({"dynamic": ShapeVar("batch", min=1)}, r"has no max: .*ShapeVar\('batch', min=\.\.\., max=N\)"),
    ({"dynamic": IntVar("n", min=-2, max=4)}, "min=-2 is negative"),
    ({"dynamic": IntVar("n", max=0)}, "max=0 allows no batch"),
    ({"dynamic": 64}, "dynamic= takes a ShapeVar/IntVar .* got int: 64; for a plain size pass max_batch=N"),
    ({"dynamic": ShapeVar("batch", max=8), "max_batch": 16}, "max_batch=16 disagrees with dynamic= .max=8."),
    ({"dynamic": ShapeVar("batch", min=4, max=8), "buckets": [2, 8]}, r"buckets \[2\] lie outside .* 4\.\.8"),
    ({"dynamic": ShapeVar("batch", max=8), "buckets": [2, 4]}, r"largest bucket \(4\) is below dynamic='s max \(8\)"),
])
def test_bad_specs_and_conflicts_are_clear_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        _runner(**kw)


def test_min_above_max_is_refused():
    # torch refuses ShapeVar(min=9, max=4) itself (ValueRangeError); a spec edited after
    # construction still gets the runner's own check.
    b = ShapeVar("batch", min=1, max=4)
    b.min = 9
    with pytest.raises(ConfigError, match="min=9 is above max=4; give min <= max"):
        _runner(dynamic=b)


def test_a_spec_naming_another_dim_is_refused():
    b = ShapeVar("batch", max=8)
    with pytest.raises(ConfigError, match=r"dynamic dim 1, does not match input args\[0\] "
                                          r"\(rank 2, batch_dim=0\): the spec names another dimension"):
        _runner(dynamic=TensorSpec([2, b]))
    with pytest.raises(ConfigError, match="rank 2"):
        _runner(dynamic=TensorSpec([b, 5, 1]))
    with pytest.raises(ConfigError, match="exactly one dynamic dim"):
        _runner(dynamic=TensorSpec([b * 2, 5]))
    with pytest.raises(ConfigError, match="exactly one dynamic dim"):
        _runner(dynamic=TensorSpec([b, ShapeVar("seq", max=4)]))
    # batch_dim=1 with the ShapeVar at dim 1 is the same runner transposed: accepted.
    r = accel_graph.GraphRunner(_step, (torch.randn(5, 2),), batch_dim=1, dynamic=TensorSpec([5, b]))
    assert r.buckets == [1, 2, 4, 8]


def test_torch_without_the_module_says_what_to_pass_instead(monkeypatch):
    # SIMULATED: both torch versions CI runs have the module; a None entry in sys.modules makes
    # its import fail as it does on torch 2.11.
    monkeypatch.setitem(sys.modules, "torch.fx.experimental.dynamic_spec", None)
    with pytest.raises(ConfigError, match=rf"torch {re.escape(torch.__version__)} does not have; pass "
                                          r"max_batch=N \(or buckets=\[\.\.\.\]\) instead"):
        _runner(dynamic=object())
    assert _runner(max_batch=4).buckets == [1, 2, 4]  # without dynamic= nothing is imported


def test_one_spec_serves_torch_export_and_the_runner():
    if not hasattr(ds, "dynamic_spec"):  # torch.export takes ShapesSpec from torch 2.14
        pytest.skip(f"torch {torch.__version__}'s torch.export does not take a ShapesSpec")
    batch = ShapeVar("batch", min=2, max=32)

    class M(torch.nn.Module):
        def forward(self, x):
            return _step(x)

    ep = torch.export.export(M(), (torch.randn(8, 5),),
                             dynamic_shapes=ds.ShapesSpec({"x": TensorSpec([batch, 5])}))
    [(lo, hi)] = [(int(r.lower), int(r.upper)) for r in ep.range_constraints.values()]
    runner = _runner(dynamic=batch)
    assert (lo, hi) == (2, 32) and (runner.buckets[0], runner.buckets[-1]) == (2, 32)
