"""GraphRunner(process_group=...): the ranks agree on every bucket, over two real gloo
processes on loopback.

One spawned job runs every check (spawning costs seconds; a short group timeout makes a bug fail
instead of hang): a bucket whose capture fails on one rank only is disabled on both; a bucket
whose first-replay verification fails on one rank only is disabled on both, and both return
eager's result; ranks built with different ladders are refused on both; the buckets agree.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from accel_graph.errors import CaptureError, ConfigError
from accel_graph.testing.distributed import run_ranks

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


class _Scale:
    """A Python number the step reads at call time: a capture bakes the value it saw."""

    value = 2.0


def _checks(rank: int, world: int) -> dict[str, Any]:
    """Everything this file checks, on one rank; returns what the parent asserts on."""
    import torch.distributed as dist

    from accel_graph import GraphRunner

    logging.getLogger("accel_graph").setLevel(logging.ERROR)
    pg = dist.group.WORLD
    out: dict[str, Any] = {"rank": rank}

    # 1. Capture fails on rank 1 only, for bucket 2 only (.item() is refused at capture; eager
    #    warm-up runs it fine): bucket 2 must be disabled on both ranks.
    def step(x: torch.Tensor) -> torch.Tensor:
        if rank == 1 and x.shape[0] == 2:
            x = x + x.sum().item() * 0
        return x * 3 + 1

    x = torch.arange(1.0, 5.0).unsqueeze(1).repeat(1, 8)
    runner = GraphRunner(step, (x[:1],), buckets=[1, 2, 4], process_group=pg, progress=False)
    with torch.inference_mode():
        runner.capture()
        got = [runner(x[:n]).clone() for n in (1, 2, 3)]
    out["capture_buckets"] = runner.captured_buckets
    out["capture_status"] = {m.size: (m.status, m.reason) for m in runner.runtime.buckets}
    out["capture_values_ok"] = all(torch.equal(g, x[:n] * 3 + 1) for g, n in zip(got, (1, 2, 3)))
    out["capture_stats"] = runner.stats()["eager_calls"]

    # 2. Verification fails on rank 0 only, for bucket 1 (the capture baked scale 2, eager then
    #    reads 5 on rank 0): bucket 1 disabled on both, and both return eager's values.
    _Scale.value = 2.0

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * _Scale.value

    runner2 = GraphRunner(scaled, (x[:1],), buckets=[1, 2], process_group=pg, progress=False)
    with torch.inference_mode():
        runner2.capture()
        if rank == 0:
            _Scale.value = 5.0
        first = runner2(x[:1]).clone()
        expected_first = (x[:1] * _Scale.value).tolist()
        _Scale.value = 2.0
        second = runner2(x[:2]).clone()  # bucket 2: verified fine on both (scale read again)
    out["verify_buckets"] = runner2.captured_buckets
    out["verify_first"] = first.tolist()
    out["verify_expected"] = expected_first
    out["verify_reason"] = runner2.runtime.bucket(1).reason
    out["verify_second_ok"] = torch.equal(second, x[:2] * 2.0)

    # 3. Strict: the capture failure of (1) raises CaptureError on both ranks, not on one.
    strict = GraphRunner(step, (x[:1],), buckets=[1, 2], process_group=pg, progress=False,
                         strict=True)
    try:
        with torch.inference_mode():
            strict.capture()
        out["strict"] = None
    except CaptureError as exc:
        out["strict"] = str(exc)

    # 4. Different ladders on the ranks: refused on both, before any capture.
    mixed = GraphRunner(scaled, (x[:1],), buckets=[1, 2] if rank == 0 else [1, 4],
                        process_group=pg, progress=False)
    try:
        mixed.capture()
        out["setup"] = None
    except ConfigError as exc:
        out["setup"] = str(exc)

    # 5. The group still works: nothing is left half-paired.
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def test_runner_ranks_agree_on_buckets() -> None:
    r0, r1 = run_ranks(_checks, 2, timeout=150, pg_timeout=20)
    for r in (r0, r1):
        # (1) bucket 2 failed on rank 1 only; both serve 1 and 4 from graphs, 2 eagerly.
        assert r["capture_buckets"] == [1, 4], r
        assert r["capture_values_ok"], r
        assert r["capture_stats"] == 1  # the batch of 2 ran eagerly
        # (2) bucket 1 mismatched on rank 0 only: disabled on both; both keep bucket 2.
        assert r["verify_buckets"] == [2], r
        assert r["verify_first"] == r["verify_expected"]  # eager's values, on either rank
        assert "rank(s) [0]" in r["verify_reason"]
        # (3) strict raises on every rank.
        assert r["strict"] is not None and "bucket 2" in r["strict"]
        # (4) setups that differ are named on both ranks.
        assert r["setup"] is not None and "rank(s) [1]" in r["setup"]
        assert r["after"] == 3.0
    status0, status1 = r0["capture_status"][2], r1["capture_status"][2]
    assert status1[0] == "failed" and "CaptureError" in status1[1] and "disabled on every rank" in status1[1]
    assert status0[0] == "disabled" and "rank(s) [1]" in status0[1]
    assert r0["verify_second_ok"] and r1["verify_second_ok"]
    assert "replay differed from eager on rank(s) [0]" in r1["verify_reason"]


def test_process_group_without_distributed_is_refused() -> None:
    from accel_graph import GraphRunner

    if dist.is_initialized():
        pytest.skip("this process already joined a group")
    with pytest.raises(ConfigError, match="init_process_group"):
        GraphRunner(lambda x: x + 1, (torch.zeros(1, 2),), buckets=[1], process_group=object())
