"""``torch.distributed`` collectives called inside eager islands, on two real gloo processes
(issue 26, item 5: "an island may call collectives; they run eagerly, in order, on every rank").

An island runs eagerly with the recording mode lifted, so a collective inside it is neither
recorded nor refused by the capture: it communicates at capture (the island's run there) and
at every replay, at the island's point of the program, between the captured pieces (and
between captured collectives, which replay in their own order). Each rank compares every
replay with eager on data that changes per replay and across ranks, so a collective that did
not run, ran on stale data or ran out of order gives another value.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import accel_graph
from accel_graph.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)

#: What the islands issued, in order, on this rank (appended by the islands as they run).
CALLS: list[str] = []


@accel_graph.eager_island
def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    CALLS.append("all_reduce")
    dist.all_reduce(y)  # in place, on a tensor the island made
    return y


@accel_graph.eager_island
def _gather_and_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = dist.get_world_size()
    out = torch.empty(n * x.shape[0], dtype=x.dtype)
    CALLS.append("all_gather_into_tensor")
    dist.all_gather_into_tensor(out, x.contiguous())
    m = x.clone()
    CALLS.append("all_reduce(MAX, async)")
    dist.all_reduce(m, op=dist.ReduceOp.MAX, async_op=True).wait()
    # a host read of a collective's result: legal here, the island runs eagerly
    if float(m.sum()) > 1e9:
        raise AssertionError("unexpected data")
    return out, m


@accel_graph.eager_island
def _functional_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    CALLS.append("fc.all_reduce")
    return fc.all_reduce(x + 1, "sum", dist.group.WORLD)  # an AsyncCollectiveTensor


@accel_graph.eager_island
def _halve(t: torch.Tensor) -> torch.Tensor:
    return t * 0.5  # called with the captured functional collective's AsyncCollectiveTensor


def _program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Captured pieces around three islands with collectives, a captured collective whose
    result (an AsyncCollectiveTensor at capture) goes into a fourth island."""
    import torch.distributed._functional_collectives as fc

    h = torch.relu(x @ w)
    s = _sum_over_ranks(h)
    g, m = _gather_and_max(s - 1)
    t = fc.all_reduce(g[: x.shape[0]] * m, "sum", dist.group.WORLD)  # captured, replayed
    u = _functional_all_reduce(torch.tanh(_halve(t)))
    return u * 3 + s


def _data(rank: int, i: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 8) * (rank + 1) + 0.25 * i


def _collective_ops(g) -> list[str]:
    """The collective ops the graph recorded (from its debug dump)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        g.debug_dump(path)
        with open(path + ".json") as f:
            ops = json.load(f)["ops"]
    return [str(op.get("op", op)) for op in ops if "c10d" in json.dumps(op)]


def _job(rank: int, world: int, compile: str | None) -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    x = _data(rank, 0)
    g = accel_graph.Graph(compile=compile,
                          compile_options={"replay": "compiled"} if compile else None)
    CALLS.clear()
    with accel_graph.graph(g):
        out = _program(x, w)
    at_capture = list(CALLS)
    problems, diffs, per_replay = [], [], []
    for i in range(1, 5):
        x.copy_(_data(rank, i))
        CALLS.clear()
        g.replay()
        per_replay.append(list(CALLS))
        expect = _program(x.clone(), w)  # eager: every island a plain call
        if compile is None and not torch.equal(out, expect):
            problems.append(f"rank {rank} replay {i}: {out.tolist()} != {expect.tolist()}")
        diffs.append(float((out - expect).abs().max()))
    return {"problems": problems, "diffs": diffs, "at_capture": at_capture,
            "per_replay": per_replay, "recorded": _collective_ops(g),
            "mode": g.replay_mode().mode,
            "info": {k: v for k, v in (g.compile_info() or {}).items()
                     if k in ("fallback", "stretches", "interpreted_stretches", "host_steps")}}


def _job_all(rank: int, world: int) -> dict:
    out = {}
    for name, compile in (("interpreted", None), ("compiled", "inductor")):
        try:
            out[name] = _job(rank, world, compile)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(_job_all, 2, timeout=400, pg_timeout=30)


def _part(reports: list[dict], name: str) -> list[dict]:
    parts = [r[name] for r in reports]
    for rank, part in enumerate(parts):
        assert "error" not in part, f"rank {rank} {name}:\n{part['error']}"
    return parts


ORDER = ["all_reduce", "all_gather_into_tensor", "all_reduce(MAX, async)", "fc.all_reduce"]


def test_island_collectives_replay_bitwise_equal_to_eager_on_every_rank(reports):
    parts = _part(reports, "interpreted")
    assert [p for r in parts for p in r["problems"]] == []
    for r in parts:
        assert r["diffs"] == [0.0] * 4 and r["mode"] == "interpreted"


def test_island_collectives_run_eagerly_in_order_at_capture_and_every_replay(reports):
    for name in ("interpreted", "compiled"):
        for r in _part(reports, name):
            assert r["at_capture"] == ORDER, r
            assert r["per_replay"] == [ORDER] * 4, r
            # Only the collective outside the islands is recorded; the islands' run eagerly.
            assert len(r["recorded"]) == 1 and "all_reduce" in r["recorded"][0], r["recorded"]


def test_island_collectives_under_compiled_replay(reports):
    for r in _part(reports, "compiled"):
        assert r["mode"] == "compiled" and not r["info"].get("fallback"), r
        assert r["info"]["host_steps"] == 4 and r["info"]["interpreted_stretches"] == [], r
        assert max(r["diffs"]) <= 1e-5, r
