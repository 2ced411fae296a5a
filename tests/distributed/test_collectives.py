"""Collectives inside recorder captures, on two real gloo processes over 127.0.0.1.

Each test spawns one pair of processes (accel_graph.testing.distributed.run_ranks) and runs
many checks in it, since spawning (a torch import per process) dominates the cost. Every rank
compares each replay with the eager collective on the same data; the checks return what they
found and the parent asserts on every rank's report.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import accel_graph
from accel_graph.errors import CaptureError, ReplayError
from accel_graph.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)


def _fc():
    import torch.distributed._functional_collectives as fc

    return fc


# -- the programs under test: f(x) with one collective each; eager and captured runs compare -----
def _functional_cases() -> dict:
    fc = _fc()
    w = dist.group.WORLD
    n = dist.get_world_size()
    return {
        "fc.all_reduce": lambda x: fc.all_reduce(x * 2, "sum", w) + 1,
        "fc.all_reduce_max": lambda x: fc.all_reduce(x, "max", w),
        "fc.all_gather_tensor": lambda x: fc.all_gather_tensor(x, 0, w) - 1,
        "fc.reduce_scatter_tensor": lambda x: fc.reduce_scatter_tensor(x, "sum", 0, w),
        "fc.broadcast": lambda x: fc.broadcast(x + 1, 1, w),
        "fc.all_to_all_single": lambda x: fc.all_to_all_single(x, [x.shape[0] // n] * n,
                                                               [x.shape[0] // n] * n, w),
        "fc.all_reduce_coalesced": lambda x: torch.cat(fc.all_reduce_coalesced([x, x * 3], "sum", w)),
        "fc.all_gather_into_tensor_coalesced": lambda x: torch.cat(
            fc.all_gather_into_tensor_coalesced([x, x + 1], w)),
        "fc.reduce_scatter_tensor_coalesced": lambda x: torch.cat(
            fc.reduce_scatter_tensor_coalesced([x, x * 2], "sum", [0, 0], w)),
        "fc.wait_tensor": lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", w)) * x,
    }


def _inplace_cases() -> dict:
    n = dist.get_world_size()

    def all_reduce(x):
        y = x * 2
        dist.all_reduce(y)
        return y

    def all_reduce_async(x):
        y = x + 1
        work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
        z = x * 3
        work.wait()
        return y + z

    def all_gather(x):
        out = torch.empty(n * x.shape[0], dtype=x.dtype)
        dist.all_gather_into_tensor(out, x)
        return out

    def reduce_scatter(x):
        out = torch.empty(x.shape[0] // n, dtype=x.dtype)
        work = dist.reduce_scatter_tensor(out, x, async_op=True)
        work.wait()
        return out

    def broadcast(x):
        y = x.clone()
        dist.broadcast(y, src=1)
        return y

    def all_to_all(x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    def into_input(x):
        dist.all_reduce(x)  # an in-place collective on a tensor captured by reference
        return x * 1

    return {"dist.all_reduce": all_reduce, "dist.all_reduce async_op": all_reduce_async,
            "dist.all_gather_into_tensor": all_gather,
            "dist.reduce_scatter_tensor async_op": reduce_scatter,
            "dist.broadcast": broadcast, "dist.all_to_all_single": all_to_all,
            "dist.all_reduce on an input": into_input}


def _data(rank: int, i: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) * (rank + 1) + 10 * i


def _check_cases(rank: int, cases: dict, compile: str | None = None) -> list[str]:
    """Capture each case once, replay it three times with new inputs, compare with eager."""
    warnings.simplefilter("ignore", FutureWarning)  # torch's renames of the *_into_tensor APIs
    problems = []
    for name, fn in cases.items():
        x = _data(rank, 0)
        g = accel_graph.Graph(compile=compile)
        with accel_graph.graph(g):
            out = fn(x)
        for i in range(1, 4):
            x.copy_(_data(rank, i))
            expect = fn(x.clone())  # eager, on a copy: in-place collectives must not touch x
            g.replay()
            if not torch.equal(out, expect):
                problems.append(f"rank {rank} {name} replay {i}: {out.tolist()} != {expect.tolist()}")
    return problems


# -- jobs (module level: pickled by name into the spawned processes) ----------------------------
def _job_capture_replay(rank: int, world: int) -> dict:
    """Every collective captured and replayed against eager; a whole captured step too."""
    problems = _check_cases(rank, _functional_cases()) + _check_cases(rank, _inplace_cases())

    # Several collectives and compute in one graph, with the outputs reused across replays.
    fc = _fc()
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    x = _data(rank, 0)

    def step(x):
        h = fc.all_reduce(x @ w, "sum", dist.group.WORLD)
        y = torch.relu(h)
        dist.all_reduce(y, async_op=True).wait()
        return torch.softmax(y, 0)

    g = accel_graph.Graph()
    with accel_graph.graph(g):
        out = step(x)
    for i in range(3):
        x.copy_(_data(rank, i + 5))
        g.replay()
        expect = step(x)
        if not torch.equal(out, expect):
            problems.append(f"rank {rank} step replay {i}: differs from eager")
    # Repeated captures of dist.all_reduce do not grow the process-wide plan cache (its reduce
    # op arrives as a fresh script object on every call).
    from accel_graph.backends.recorder import plan

    y = torch.ones(4)
    sizes = []
    for _ in range(5):
        g = accel_graph.Graph()
        with accel_graph.graph(g):
            dist.all_reduce(y)
        sizes.append(len(plan._PLANS))
    return {"problems": problems, "threads": torch.get_num_threads(), "plan_sizes": sizes}


def _refusal(fn) -> str:
    g = accel_graph.Graph()
    try:
        with accel_graph.graph(g):
            fn()
    except CaptureError as exc:
        return str(exc)
    return "NOT REFUSED"


def _job_refused(rank: int, world: int) -> dict:
    """Ops that cannot be replayed are refused with CaptureError naming them; the graph and the
    process group stay usable afterwards."""
    x = torch.ones(4)
    out = {
        "all_gather_object": _refusal(lambda: dist.all_gather_object([None] * world, {"r": rank})),
        "broadcast_object_list": _refusal(lambda: dist.broadcast_object_list([rank], src=0)),
        "barrier": _refusal(lambda: dist.barrier()),
        "send/recv": _refusal(lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0)),
        "new_group": _refusal(lambda: dist.new_group([0, 1])),
    }
    # The group still works after the refusals (nothing was issued on it).
    y = torch.full((2,), float(rank))
    dist.all_reduce(y)
    out["after"] = y.tolist()
    return out


def _job_mismatch(rank: int, world: int) -> dict:
    """A rank that captured a different program is named at the first replay, on every rank,
    without a hang; a rank that never replays makes the check fail within the group's timeout;
    a collective timeout at replay names the rank and the op."""
    fc = _fc()
    found = {}
    # 1. Different shapes on rank 1.
    x = torch.ones(4 if rank == 0 else 6)
    g = accel_graph.Graph()
    with accel_graph.graph(g):
        fc.all_reduce(x, "sum", dist.group.WORLD)
    try:
        g.replay()
        found["shape"] = "NO ERROR"
    except ReplayError as exc:
        found["shape"] = str(exc)
    # 2. A different op on rank 1.
    y = torch.ones(4)
    g2 = accel_graph.Graph()
    with accel_graph.graph(g2):
        if rank == 0:
            dist.all_reduce(y)
        else:
            dist.broadcast(y, src=0)
    try:
        g2.replay()
        found["op"] = "NO ERROR"
    except ReplayError as exc:
        found["op"] = str(exc)
    # 2b. A different reduction on rank 1.
    g2b = accel_graph.Graph()
    with accel_graph.graph(g2b):
        dist.all_reduce(y, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    try:
        g2b.replay()
        found["reduce"] = "NO ERROR"
    except ReplayError as exc:
        found["reduce"] = str(exc)
    # 3. The same programs everywhere: the check passes, replay works.
    g3 = accel_graph.Graph()
    with accel_graph.graph(g3):
        z = fc.all_reduce(y * 0 + rank, "sum", dist.group.WORLD)
    g3.replay()
    found["ok"] = z.tolist()
    # 4. A group with a short timeout, on which rank 1 never replays: rank 0's first-replay
    #    check fails within the timeout; then rank 0 replays twice, rank 1 once: the second
    #    replay's collective times out, naming rank 0 and the op.
    short = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    g4 = accel_graph.Graph()
    with accel_graph.graph(g4):
        fc.all_reduce(y, "sum", short)
    t0 = time.monotonic()
    if rank == 0:
        try:
            g4.replay()
            found["absent"] = "NO ERROR"
        except ReplayError as exc:
            found["absent"] = str(exc)
    found["absent_s"] = time.monotonic() - t0
    dist.barrier()  # on the default group, which still works
    short2 = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    g5 = accel_graph.Graph()
    with accel_graph.graph(g5):
        fc.all_reduce(y, "sum", short2)
    g5.replay()  # both ranks: the check and one collective
    if rank == 0:
        try:
            g5.replay()
            found["timeout"] = "NO ERROR"
        except ReplayError as exc:
            found["timeout"] = str(exc)
    dist.barrier()
    return found


# -- one spawned pair runs every job; the tests assert on its reports ----------------------------
def _compiled(rank: int, world: int) -> dict:
    """compile="inductor": functional collectives, and dist.all_reduce / all_gather_into_tensor
    (translated to their functional twins), compile in one graph and replay equal to eager
    within tolerances; dist.all_to_all_single (not translated) falls back to interpreted replay
    with the reason kept, and that replay is exact."""
    fc = _fc()
    x = _data(rank, 0)

    def fn(x):
        y = fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        out = torch.empty(world * y.shape[0])
        dist.all_gather_into_tensor(out, y)
        return out * 3

    g = accel_graph.Graph(compile="inductor")
    with accel_graph.graph(g):
        out = fn(x)
    diffs = []
    for i in range(1, 3):
        x.copy_(_data(rank, i))
        g.replay()
        diffs.append(float((out - fn(x)).abs().max() / fn(x).abs().max()))
    y = torch.ones(4)
    g2 = accel_graph.Graph(compile="inductor")
    with accel_graph.graph(g2):
        dist.all_to_all_single(y, y.clone())
    g2.replay()
    fallback = _check_cases(rank, {"dist.all_to_all_single": _inplace_cases()["dist.all_to_all_single"]},
                            "inductor")
    return {"diffs": diffs, "info": _compiled_info(g), "fallback_info": _compiled_info(g2),
            "mode": g.replay_mode().as_dict(),
            "fallback_value": y.tolist(), "fallback_problems": fallback}


def _compiled_info(g) -> dict:
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        g.debug_dump(path)
        with open(path + ".json") as f:
            return json.load(f)["compiled"]


def _job_all(rank: int, world: int) -> dict:
    """Run every job in one process pair (spawning dominates the cost); a job that raises is
    reported as its traceback, so the other jobs' tests still get their results."""
    import traceback

    out = {}
    for name, job in (("replay", _job_capture_replay), ("refused", _job_refused),
                      ("compiled", _compiled), ("mismatch", _job_mismatch)):  # mismatch last
        try:
            out[name] = job(rank, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    """Each rank's reports of :func:`_job_all`, from one spawned pair of gloo processes."""
    return run_ranks(_job_all, 2, timeout=400, pg_timeout=30)


def _part(reports: list[dict], name: str) -> list[dict]:
    parts = [r[name] for r in reports]
    for rank, part in enumerate(parts):
        assert "error" not in part, f"rank {rank} {name}:\n{part['error']}"
    return parts


def test_collectives_capture_and_replay_equal_eager(reports):
    problems = [p for r in _part(reports, "replay") for p in r["problems"]]
    assert problems == []


def test_repeated_captures_of_c10d_collectives_do_not_grow_the_plan_cache(reports):
    for r in _part(reports, "replay"):
        assert len(set(r["plan_sizes"])) == 1, r["plan_sizes"]


def test_run_ranks_shares_the_cpus_out(reports):
    import os

    assert [r["threads"] for r in _part(reports, "replay")] == [max(1, (os.cpu_count() or 1) // 2)] * 2


def test_run_ranks_refuses_bad_arguments():
    from accel_graph.errors import ConfigError

    for bad in ({"world_size": 0}, {"world_size": True}, {"timeout": 0}, {"pg_timeout": -1},
                {"num_threads": -2}):
        kwargs = {"world_size": 2, **bad}
        with pytest.raises(ConfigError):
            run_ranks(_job_fails_on_rank1, kwargs.pop("world_size"), **kwargs)


def test_unreplayable_distributed_calls_are_refused_by_name(reports):
    for rank, out in enumerate(_part(reports, "refused")):
        assert "torch.distributed.all_gather_object is not allowed" in out["all_gather_object"], out
        assert "torch.distributed.broadcast_object_list is not allowed" in out["broadcast_object_list"]
        assert "barrier" in out["barrier"], out
        assert ("send" if rank == 0 else "recv") in out["send/recv"], out
        assert "created during the capture" in out["new_group"], out
        assert out["after"] == [1.0, 1.0]


def test_compiled_replay_of_collectives(reports):
    for out in _part(reports, "compiled"):
        assert out["info"]["backend"] == "inductor" and "fallback" not in out["info"], out
        # replay="auto" keeps a graph with collectives compiled, untimed, on every rank.
        assert out["mode"]["mode"] == "compiled" and "collectives" in out["mode"]["reason"], out
        assert out["mode"]["compiled_s"] is None, out
        assert all(d <= 1e-5 for d in out["diffs"]), out
        assert "in-place collective without a functional" in out["fallback_info"]["fallback"], out
        assert out["fallback_value"] == [1.0] * 4
        assert out["fallback_problems"] == []


def test_rank_mismatch_and_timeouts_fail_loudly_naming_rank_and_op(reports):
    results = _part(reports, "mismatch")
    for out in results:
        assert "rank 1 records collective #0 as _c10d_functional::all_reduce(input=float32[6]" in out["shape"]
        assert "rank 0 records _c10d_functional::all_reduce(input=float32[4]" in out["shape"]
        assert "c10d::broadcast_" in out["op"] and "c10d::allreduce_" in out["op"], out["op"]
        assert "reduce_op=MAX" in out["reduce"] and "reduce_op=SUM" in out["reduce"], out["reduce"]
        assert out["ok"] == [1.0] * 4
    r0 = results[0]
    assert r0["absent"].startswith("rank 0:"), r0["absent"]
    assert "first replay's check" in r0["absent"]
    assert r0["timeout"].startswith("rank 0: collective #0"), r0["timeout"]
    assert "_c10d_functional::all_reduce" in r0["timeout"]


def test_run_ranks_reports_each_failing_rank():
    from accel_graph.testing.distributed import RankFailure

    with pytest.raises(RankFailure, match="rank 1") as info:
        run_ranks(_job_fails_on_rank1, 2, timeout=120, pg_timeout=10)
    assert list(info.value.failures) == [1]
    assert "boom on rank 1" in info.value.failures[1]


def _job_fails_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank
