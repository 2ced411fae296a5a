"""check_capturable with a GPU target and control flow (issue 18 item 3): ``torch.cond`` /
``torch.while_loop`` that this torch version cannot capture into the target's native graphs are
findings (the recorder captures both everywhere, so without a target they are not)."""

from __future__ import annotations

import torch
from torch._higher_order_ops import while_loop

import accel_graph
from accel_graph.backends.native.control_flow_support import torch_module


def _fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))
    start = torch.zeros((), dtype=torch.int64, device=x.device)
    return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y + 1), (start, y))


def test_check_capturable_flags_control_flow_the_target_cannot_capture() -> None:
    x = torch.ones(3)
    assert accel_graph.check_capturable(_fn, x).ok  # the recorder's rules: both captured
    cuda = accel_graph.check_capturable(_fn, x, target="cuda")
    # What this torch's conditional-node module lacks is a finding: nothing on 2.14.1,
    # while_loop on 2.13 (no while_loop_node), both on 2.11 (no module at all).
    api = torch_module()
    lacking = [op for op, fn in (("cond", "if_else_node"), ("while_loop", "while_loop_node"))
               if not hasattr(api, fn)]
    assert [f.op for f in cuda.findings] == lacking, cuda.format()
    for f in cuda.findings:
        assert f"cannot capture torch.{f.op} into a CUDA graph" in f.reason
        assert "device='cpu'" in f.reason
    xpu = accel_graph.check_capturable(_fn, x, target="xpu")
    assert [f.op for f in xpu.findings] == ["cond", "while_loop"], xpu.format()
    assert all("CUDA graphs only" in f.reason for f in xpu.findings)
    torch.testing.assert_close(xpu.result[1], x * 2 + 3)  # still ran as eager
