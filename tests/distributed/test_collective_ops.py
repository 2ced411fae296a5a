"""How the recorder classifies collective ops (no process group needed: nothing spawned)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from accel_graph.backends.capture_common import collective_rules as rules
from accel_graph.backends.recorder import collective_replay
from accel_graph.backends.recorder import collectives as coll

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

c10d = torch.ops.c10d
F = torch.ops._c10d_functional


def test_roles_of_collective_ops():
    import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)

    assert rules.is_collective(c10d.allreduce_.default)
    assert rules.is_collective(F.wait_tensor.default)
    assert not rules.is_collective(torch.ops.aten.add.Tensor)
    assert coll.role(c10d.allreduce_.default) == coll.INPLACE
    assert coll.role(c10d._allgather_base_.default) == coll.INPLACE
    assert coll.role(F.all_reduce_.default) == coll.INPLACE
    assert coll.role(F.all_gather_into_tensor_out.default) == coll.INPLACE
    assert coll.role(F.all_reduce.default) == coll.ISSUE
    assert coll.role(F.all_to_all_single.default) == coll.ISSUE
    assert coll.role(F.wait_tensor.default) == coll.IDENTITY
    assert coll.role(F._wrap_tensor_autograd.default) == coll.IDENTITY


def test_refused_collective_ops_say_why():
    assert "barrier" in rules.refusal(c10d.barrier.default)
    assert "point-to-point" in rules.refusal(c10d.send.default)
    assert "point-to-point" in rules.refusal(c10d.recv_.default)
    if hasattr(F, "isend"):  # functional isend: torch 2.13+ (2.11 has none to refuse)
        assert "point-to-point" in rules.refusal(F.isend.default)
    assert "root" in rules.refusal(c10d.scatter_.default)
    assert rules.refusal(c10d.allreduce_.default) is None
    assert rules.refusal(F.all_reduce.default) is None
    assert set(rules.REFUSED_CALLERS) >= {"all_gather_object", "broadcast_object_list", "barrier",
                                         "new_group", "send", "recv"}


def test_which_functional_collectives_allocate_at_replay():
    assert not collective_replay.allocates(F.all_reduce.default)  # in place on the captured output
    assert not collective_replay.allocates(F.broadcast.default)
    assert not collective_replay.allocates(F.all_gather_into_tensor.default)  # through the _out form
    assert not collective_replay.allocates(F.reduce_scatter_tensor.default)
    assert collective_replay.allocates(F.all_to_all_single.default)  # computed, then copied
    assert not collective_replay.allocates(c10d.allreduce_.default)  # in place as called


def test_descriptions_are_rank_independent_metadata():
    x = torch.ones(2, 3)
    assert coll.describe(F.all_reduce.default, (x, "sum", "0"), {}) == (
        "_c10d_functional::all_reduce(input=float32[2, 3], reduce_op='sum')")
    assert coll.describe(F.all_gather_into_tensor.default, (x.half(), 4, "7"), {}) == (
        "_c10d_functional::all_gather_into_tensor(input=float16[2, 3], group_size=4)")


def test_completed_work_waits_at_once():
    work = coll.completed_work()
    assert isinstance(work, torch.ScriptObject)
    unboxed = torch._C._distributed_c10d.Work.unbox(work)
    assert unboxed.is_completed() and unboxed.wait()


def test_no_process_group_means_no_known_groups():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    assert coll.known_groups() == frozenset()


def test_check_capturable_rules_know_collectives():
    """check_capturable applies ops.illegal_reason: a collective returns a Work handle, which is
    not a host value, so it is legal unless refused by name."""
    from accel_graph.backends.capture_common.illegal_ops import illegal_reason

    assert illegal_reason(c10d.allreduce_.default, (), {}) is None
    assert illegal_reason(c10d.alltoall_base_.default, (), {}) is None
    assert "barrier" in illegal_reason(c10d.barrier.default, (), {})
    assert "point-to-point" in illegal_reason(c10d.send.default, (), {})


def test_a_collective_on_an_unknown_group_is_refused_at_the_op():
    """A functional collective naming a group that does not exist (here: no process group at
    all) fails at the op with CaptureError, and the capture is over, as for any refused op."""
    import accel_graph
    from accel_graph.errors import CaptureError

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    x = torch.ones(4)
    g = accel_graph.Graph()
    with pytest.raises(CaptureError, match="process group cannot be resolved"):
        with accel_graph.graph(g):
            F.all_reduce(x, "sum", "no-such-group")
    with accel_graph.graph(g):  # the graph is empty and reusable
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)
