"""Issue 29 item 4: compile-fallback reasons name memory by dtype, shape and offset, never by
its values (``repr(tensor)`` put weights and activations into logs and ``compile_info()``)."""

from __future__ import annotations

import logging

import pytest
import torch

import accel_graph
from accel_graph.backends.recorder.memory_names import describe_memory
from accel_graph.backends.recorder.pool_protocol import ADDRESS, PoolRef


def test_staging_fallback_reason_has_no_tensor_values(caplog: pytest.LogCaptureFixture) -> None:
    # values with a recognisable printout: repr() would show "1234.5000"
    buf = torch.full((8,), 1234.5)
    view = buf[2:6]  # a second tensor over the same memory: staging cannot cover it
    g = accel_graph.Graph(device="cpu", compile="inductor")
    x = torch.ones(8)
    with caplog.at_level(logging.WARNING, logger="accel_graph"), accel_graph.graph(g):
        out = buf.clone()
        buf.add_(x)
        twice = view * 2
    g.replay()
    info = g.compile_info()
    assert info is not None and "fallback" in info, info
    reason = info["fallback"]
    assert "float32 (8,) tensor at element 0 of its storage" in reason, reason
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "float32 (8,)" in logged, logged
    for text in (reason, logged):
        assert "tensor([" not in text and "1234" not in text and "1235" not in text, text
    # the fallback replays the captured program faithfully (capture itself ran nothing)
    assert torch.equal(out, torch.full((8,), 1234.5)) and torch.equal(buf, torch.full((8,), 1235.5))
    assert torch.equal(twice, torch.full((4,), 2471.0))


def test_describe_memory() -> None:
    ref = PoolRef(0, 512, (2, 3), (3, 1), torch.float16)
    assert describe_memory(ref) == "float16 (2, 3) at byte 512 of pool segment 0"
    assert describe_memory(PoolRef(ADDRESS, 4096, (4,), (1,), torch.int64)) == (
        "int64 (4,) at address 0x1000"
    )
    t = torch.arange(10.0)[3:]
    assert describe_memory(t) == "float32 (7,) tensor at element 3 of its storage"
    assert describe_memory(object()) == "a object"
