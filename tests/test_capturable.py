"""check_capturable: every capture-illegal op with its source line; the pytest helper."""

from __future__ import annotations

import json

import pytest
import torch

from accel_graph import check_capturable
from accel_graph.models import Decoder, DecoderConfig
from accel_graph.testing.capturable import assert_capturable


def messy(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:  # host sync
        y = y + 1
    z = y[y > 1]  # boolean mask
    n = x.nonzero()  # data-dependent shape
    values = x.tolist()  # invisible to the dispatcher
    return y + z.sum() + n.sum() + len(values)


def test_reports_every_illegal_op_with_its_line() -> None:
    report = check_capturable(messy, torch.randn(6))
    assert not report and not report.ok
    ops = [f.op for f in report]
    assert any("_local_scalar_dense" in o or "is_nonzero" in o for o in ops)
    assert any("index" in o for o in ops)
    assert any("nonzero" in o for o in ops)
    assert any("tolist" in o for o in ops)
    for f in report:
        assert __file__ in f.location and " in messy" in f.location
        assert f.reason
    lines = {int(f.location.split(":")[1].split()[0]) for f in report}
    assert len(lines) == 4
    assert report.result is not None  # the function ran to the end
    json.dumps(report.as_dict())
    assert "capture-illegal" in report.format()


def test_capturable_function_is_ok() -> None:
    model = Decoder(DecoderConfig(max_batch=2, n_layers=1, max_seq=16))
    tok, pos = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    report = check_capturable(model.decode_step, tok, pos, target="cuda")
    assert report.ok and bool(report) and report.ops_seen > 10
    assert report.result.shape == (2, 512)


def test_gpu_target_counts_cpu_tensors_as_host_memory() -> None:
    def fn(x):
        idx = torch.arange(x.shape[0])  # no device=: a host tensor on a GPU box
        host = x.cpu()
        other = x.to("cpu")
        return x[idx] + host + other

    assert check_capturable(fn, torch.randn(3)).ok  # no target: CPU is the device
    report = check_capturable(fn, torch.randn(3), target="cuda")
    reasons = " ".join(f.reason for f in report)
    assert len(report) == 3
    assert "device=" in reasons and ".cpu()" in reasons and '.to("cpu")' in reasons
    assert all(f.level == "python" for f in report)


def test_kwargs_are_passed_and_exceptions_propagate() -> None:
    def fn(x, *, scale):
        return x * scale

    assert check_capturable(fn, torch.ones(2), scale=3.0).result.tolist() == [3.0, 3.0]
    with pytest.raises(ZeroDivisionError):
        check_capturable(lambda: 1 / 0)


def test_assert_capturable_helper() -> None:
    assert_capturable(lambda x: x * 2, torch.ones(2))
    with pytest.raises(AssertionError) as info:
        assert_capturable(messy, torch.randn(6))
    msg = str(info.value)
    assert "messy is not capturable" in msg and "nonzero" in msg and "test_capturable.py" in msg
