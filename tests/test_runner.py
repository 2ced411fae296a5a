"""GraphRunner on the CPU recorder: capture, padding, outputs, fallbacks, reports, bad input.

Small functions only (no Inductor); timings are never asserted.
"""

from __future__ import annotations

import gc
import json
import logging

import pytest
import torch

import accel_graph
from accel_graph import AccelGraphError, CaptureError, ConfigError, GraphRunner
from accel_graph.runner import MEMORY_SCHEMA, STATS_SCHEMA


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def runner_for(fn=affine, example=None, **kw) -> GraphRunner:
    example = torch.zeros(1, 3) if example is None else example
    kw.setdefault("buckets", [1, 2, 4])
    kw.setdefault("progress", False)
    return GraphRunner(fn, example, **kw).capture()


def test_exported_from_package() -> None:
    assert accel_graph.GraphRunner is GraphRunner
    assert callable(accel_graph.suggest_buckets) and callable(accel_graph.check_capturable)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_results_match_eager_for_every_batch_size(n: int) -> None:
    r = runner_for()
    x = torch.randn(n, 3)
    out = r(x)
    assert out.shape == (n, 3)
    torch.testing.assert_close(out, affine(x))


def test_outputs_are_views_into_static_memory_unless_copied() -> None:
    r = runner_for()
    a = r(torch.ones(3, 3))
    b = r(torch.zeros(3, 3))
    assert a.data_ptr() == b.data_ptr()  # the same static memory, overwritten
    assert torch.equal(a, torch.ones(3, 3))  # a now shows the second call's result
    rc = runner_for(copy_outputs=True)
    a = rc(torch.ones(3, 3))
    rc(torch.zeros(3, 3))
    assert torch.equal(a, torch.full((3, 3), 3.0))


def test_padding_rows_get_pad_value_and_stats_count_waste() -> None:
    seen = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + 0

    r = runner_for(fn, pad_value=-7.0)
    r(torch.ones(4, 3))  # live data in row 3 first: the next padded call must overwrite it
    r.reset_stats()
    r(torch.ones(3, 3))
    seen["static"] = r.inputs[0].static.clone()
    assert torch.equal(seen["static"][3], torch.full((3,), -7.0))
    st = r.stats()
    assert st["schema"] == STATS_SCHEMA
    assert st["padding_waste_rows"] == 1 and st["live_rows"] == 3
    assert st["batch_size_histogram"] == {"3": 1}
    assert {b["bucket"]: b["replays"] for b in st["buckets"]} == {1: 0, 2: 0, 4: 1}
    json.dumps(st)


def test_pad_index_points_padded_rows_at_a_dummy_slot() -> None:
    # A slot-mapped cache: row i writes its value into cache[slot[i]]. Slot 9 is the dummy.
    cache = torch.zeros(10)

    def write(slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        cache.index_put_((slots,), values)
        return values * 1

    r = runner_for(write, example=(torch.tensor([9]), torch.zeros(1)), pad_index=(9, None))
    cache.zero_()
    r(torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0, 3.0]))  # padded to 4: row 3 -> slot 9
    assert cache[:3].tolist() == [1.0, 2.0, 3.0]
    assert cache[3:9].tolist() == [0.0] * 6


def test_pytree_inputs_kwargs_and_outputs() -> None:
    def fn(pair, *, scale):
        a, b = pair
        return {"sum": a + b, "scaled": (a * scale, b.sum(-1))}

    ex = ((torch.zeros(1, 2), torch.zeros(1, 2)),)
    r = GraphRunner(fn, ex, buckets=[2, 4], example_kwargs={"scale": torch.ones(1, 2)},
                    progress=False).capture()
    a, b, s = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2)
    out = r((a, b), scale=s)
    with pytest.raises(ConfigError, match="keyword inputs"):
        r((a, b), factor=s)
    with pytest.raises(ConfigError, match=r"args\[0\]\[1\]"):
        r((a, 3), scale=s)
    torch.testing.assert_close(out["sum"], a + b)
    torch.testing.assert_close(out["scaled"][0], a * s)
    torch.testing.assert_close(out["scaled"][1], b.sum(-1))


def test_batch_dim_per_input_and_unbatched_inputs() -> None:
    def fn(x, w):  # x: [3, B], w: [3] (no batch dim)
        return (x * w.unsqueeze(1)).t().contiguous()

    r = GraphRunner(fn, (torch.zeros(3, 1), torch.ones(3)), buckets=[2, 4],
                    batch_dim=(1, None), progress=False).capture()
    x, w = torch.randn(3, 3), torch.randn(3)
    torch.testing.assert_close(r(x, w), fn(x, w))


def test_above_largest_bucket_runs_eagerly_and_is_logged(caplog) -> None:
    r = runner_for()
    x = torch.randn(6, 3)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        torch.testing.assert_close(r(x), affine(x))
    assert "above the largest bucket" in caplog.text
    fb = r.stats()["eager_fallbacks"]
    assert fb[0]["count"] == 1 and "batch 6" in fb[0]["reason"]
    with pytest.raises(AccelGraphError, match="largest bucket"):
        runner_for(strict=True)(x)


def test_capture_error_disables_the_bucket_and_falls_back() -> None:
    def fn(x):
        if x.shape[0] == 4:  # only the largest bucket does something illegal
            return x * x.sum().item()
        return x * 2

    r = runner_for(fn)
    rep = r.memory_report()
    assert [b["status"] for b in rep["buckets"]] == ["captured", "captured", "failed"]
    assert "item" in rep["buckets"][2]["reason"] or "_local_scalar_dense" in rep["buckets"][2]["reason"]
    assert rep["left_out"] == [4]
    x = torch.randn(3, 3)
    # The fallback runs fn at the bucket's padded shape (4 rows, the 4th padding), as the graph
    # would have, and returns the live rows.
    padded = torch.cat([x, torch.zeros(1, 3)])
    torch.testing.assert_close(r(x), fn(padded)[:3])
    torch.testing.assert_close(r(x[:2]), x[:2] * 2)  # the other buckets keep serving
    # fallback="live": fn on the live batch, as before per-bucket state existed.
    torch.testing.assert_close(runner_for(fn, fallback="live")(x), fn(x))
    with pytest.raises(CaptureError, match="bucket 4"):
        runner_for(fn, strict=True)


def test_verification_mismatch_disables_bucket_and_returns_eager() -> None:
    # Random draws differ between eager and replay: verification must catch it.
    r = runner_for(lambda x: x + torch.rand_like(x))
    x = torch.zeros(2, 3)
    out = r(x)
    assert out.shape == (2, 3)
    rep = r.memory_report()["buckets"][1]
    assert rep["status"] == "disabled" and "verification" in rep["reason"]
    r(x)  # now eager, counted
    assert r.stats()["eager_calls"] == 2
    with pytest.raises(CaptureError, match="verification"):
        runner_for(lambda x: x + torch.rand_like(x), strict=True)(x)


def test_verification_does_not_apply_side_effects_twice() -> None:
    counter = torch.zeros(1)

    def step(x):
        counter.add_(1)
        return x + counter

    r = runner_for(step, example=torch.zeros(1, 1), buckets=[2])
    counter.zero_()
    out = r(torch.zeros(2, 1))  # first replay of the bucket: verified against eager
    assert counter.item() == 1.0
    torch.testing.assert_close(out, torch.ones(2, 1))
    assert r.stats()["buckets"][0]["verified"]
    r(torch.zeros(2, 1))
    assert counter.item() == 2.0


def test_padded_verification_uses_tolerances_not_bitwise() -> None:
    w = torch.randn(64, 64)
    r = runner_for(lambda x: x @ w, example=torch.zeros(1, 64), buckets=[8])
    x = torch.randn(5, 64)
    torch.testing.assert_close(r(x), x @ w)
    assert r.memory_report()["buckets"][0]["status"] == "captured"


def test_memory_report_schema_and_shared_pool() -> None:
    r = runner_for(lambda x: x.repeat(1, 4096), example=torch.zeros(1, 8))
    rep = r.memory_report()
    assert rep["schema"] == MEMORY_SCHEMA and rep["backend"] == "recorder"
    json.dumps(rep)
    for b in rep["buckets"]:
        assert b["status"] == "captured" and b["capture_ms"] > 0
        assert b["standalone_bytes"] >= b["bucket"] * 8 * 4096 * 4
    # Largest first into one pool: the largest bucket's growth covers the smaller ones.
    assert rep["pool_reserved_bytes"] == sum(b["incremental_bytes"] for b in rep["buckets"])
    assert rep["buckets"][-1]["incremental_bytes"] == rep["pool_reserved_bytes"]


def _big(x):
    return x.repeat(1, 3 << 17)  # [B, 8] -> [B, 3 * 2**20] float32: 12 MiB per row


def test_memory_budget_rolls_back_buckets_that_overshoot() -> None:
    # The budget is what buckets 1 and 2 alone need, whatever the pool's rounding policy.
    budget = runner_for(_big, example=torch.zeros(1, 8), buckets=[1, 2]).memory_report()[
        "pool_reserved_bytes"]
    alone4 = runner_for(_big, example=torch.zeros(1, 8), buckets=[4]).memory_report()[
        "pool_reserved_bytes"]
    assert alone4 > budget
    r = runner_for(_big, example=torch.zeros(1, 8), memory_budget=budget)
    rep = r.memory_report()
    assert rep["left_out"] == [4]
    assert rep["pool_reserved_bytes"] <= budget
    assert rep["buckets"][2]["status"] == "over_budget"
    assert rep["buckets"][2]["incremental_bytes"] is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(r(x), _big(x))  # eager, logged
    assert "memory_budget" in r.stats()["eager_fallbacks"][0]["reason"]
    torch.testing.assert_close(r(x[:2]), _big(x[:2]))
    assert r.stats()["graph_calls"] == 1


def test_budget_too_small_for_smallest_bucket() -> None:
    r = GraphRunner(_big, torch.zeros(1, 8), buckets=[1, 2], memory_budget=1024, progress=False)
    with pytest.raises(ConfigError, match="too small for the smallest bucket"):
        r.capture()
    x = torch.randn(1, 8)
    torch.testing.assert_close(r(x), _big(x))  # still serves, eagerly


def test_gc_is_restored_after_capture() -> None:
    assert gc.isenabled()
    runner_for()
    assert gc.isenabled()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buckets": []}, "empty"),
        ({"buckets": [0, 2]}, "positive"),
        ({"buckets": [1, -4]}, "positive"),
        ({"buckets": [1, 2.5]}, "positive"),
        ({"buckets": None}, "max_batch"),
        ({"buckets": [1, 16], "max_batch": 8}, "exceeds max_batch"),
        ({"memory_budget": 0}, "memory_budget"),
        ({"batch_dim": 5}, "out of range"),
        ({"pad_index": 1.5}, "number|index"),
    ],
)
def test_bad_configuration(kwargs, match) -> None:
    kwargs.setdefault("buckets", [1, 2])
    with pytest.raises(ConfigError, match=match):
        GraphRunner(affine, torch.zeros(1, 3), **kwargs)


def test_pad_index_on_float_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="not an index"):
        GraphRunner(affine, torch.zeros(1, 3), buckets=[1], pad_index=0)


def test_default_ladder_is_vllm_style() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), max_batch=20)
    assert r.buckets == [1, 2, 4, 8, 16, 20]


def test_callable_returning_non_tensor() -> None:
    r = GraphRunner(lambda x: x.shape[0], torch.zeros(1, 3), buckets=[1, 2], progress=False)
    with pytest.raises(ConfigError, match="must return a tensor"):
        r.capture()
    r2 = GraphRunner(lambda x: (x, None), torch.zeros(1, 3), buckets=[1], progress=False)
    with pytest.raises(ConfigError, match="NoneType"):
        r2.capture()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(2, 3, dtype=torch.float64), r"args\[0\].*float32\[2, 3\].*float64"),
        (torch.zeros(2, 4), r"args\[0\]: expected torch.float32\[2, 3\]"),
        (torch.zeros(2, 3, 1), r"args\[0\]: expected"),
        (torch.zeros(3), r"args\[0\]: expected"),
        (torch.zeros(0, 3), "size 0"),
        (torch.zeros(9, 4), r"args\[0\]: expected"),
        (torch.zeros(2, 3, device="meta"), "meta"),
    ],
)
def test_bad_input_names_the_input_and_graphs_keep_serving(bad, match) -> None:
    r = runner_for()
    with pytest.raises(ConfigError, match=match):
        r(bad)
    x = torch.randn(2, 3)
    torch.testing.assert_close(r(x), affine(x))
    assert r.stats()["graph_calls"] == 1


def test_kwargs_in_any_order() -> None:
    r = GraphRunner(lambda *, a, b: a - b, (), example_kwargs={"a": torch.zeros(1), "b": torch.zeros(1)},
                    buckets=[2], progress=False).capture()
    x, y = torch.randn(2), torch.randn(2)
    torch.testing.assert_close(r(b=y, a=x), x - y)


def test_non_tensor_leaf_in_a_call() -> None:
    r = GraphRunner(lambda a, b: a + b, (torch.zeros(1), torch.zeros(1)), buckets=[1],
                    progress=False).capture()
    with pytest.raises(ConfigError, match=r"args\[1\].*got int"):
        r(torch.zeros(1), 3)


def test_inconsistent_batch_sizes_across_inputs() -> None:
    r = GraphRunner(lambda a, b: a + b, (torch.zeros(1, 2), torch.zeros(1, 2)), buckets=[4],
                    progress=False).capture()
    with pytest.raises(ConfigError, match=r"args\[1\]"):
        r(torch.zeros(2, 2), torch.zeros(3, 2))


def test_call_before_capture_runs_eagerly_and_capture_twice_refused() -> None:
    r = GraphRunner(affine, torch.zeros(1, 3), buckets=[1, 2], progress=False)
    x = torch.randn(2, 3)
    torch.testing.assert_close(r(x), affine(x))
    r.capture()
    with pytest.raises(AccelGraphError, match="already"):
        r.capture()


def test_progress_bar_runs(capsys) -> None:
    runner_for(progress=True)
    assert "capture" in capsys.readouterr().err


def test_grad_mode_callers_get_no_autograd_graph() -> None:
    r = runner_for()
    x = torch.randn(2, 3, requires_grad=True)
    out = r(x)
    assert not out.requires_grad
    assert not r.inputs[0].static.requires_grad


def test_observed_traffic_feeds_suggest_buckets() -> None:
    r = runner_for(buckets=[1, 2, 4, 8])
    for n in (3, 3, 3, 5, 7, 7, 9):
        r(torch.zeros(n, 3))
    hist = r.stats()["batch_size_histogram"]
    assert hist == {"3": 3, "5": 1, "7": 2, "9": 1}  # eager calls (9) counted too
    ladder, waste = accel_graph.suggest_buckets(hist, max_graphs=3)
    assert ladder == [3, 7, 9] and waste == pytest.approx(2 / 7)
