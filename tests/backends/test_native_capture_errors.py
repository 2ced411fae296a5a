"""torch's raw stream-capture refusals inside a native capture become CaptureError.

Found on real hardware (H200, torch 2.11): ``.item()`` inside a CUDA capture raised torch's bare
``AcceleratorError: operation not permitted when stream is capturing`` where the recorder raises
a ``CaptureError`` naming the op. Here the runtime's refusal is played by a custom op that
raises torch's words (a FAKE of the device runtime, plumbing only): the control-flow dispatch
mode every native capture runs under must turn it into a ``CaptureError``, chained to torch's
error, and let every other error through unchanged.
"""

from __future__ import annotations

import pytest
import torch

from accel_graph.backends.native.capture_errors import as_capture_error
from accel_graph.backends.native.control_flow import ControlFlowMode
from accel_graph.backends.native.control_flow_support import ControlFlowSupport
from accel_graph.errors import CaptureError

REFUSAL = ("CUDA error: operation not permitted when stream is capturing\nSearch for "
           "`cudaErrorStreamCaptureUnsupported' in https://docs.nvidia.com/cuda/")
MESSAGE = {"text": REFUSAL}


@torch.library.custom_op("accel_graph_test::runtime_refuses", mutates_args=())
def runtime_refuses(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(MESSAGE["text"])


@runtime_refuses.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _mode() -> ControlFlowMode:
    support = ControlFlowSupport(backend="cuda", kind="CUDA", cond=None, while_loop=None, switch=None)
    return ControlFlowMode(support, "cuda:0 (cuda backend)")


def test_a_stream_capture_refusal_becomes_a_capture_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MESSAGE, "text", REFUSAL)
    x = torch.ones(3)
    with pytest.raises(CaptureError) as info, _mode():
        torch.ops.accel_graph_test.runtime_refuses(x)
    msg = str(info.value)
    assert "accel_graph_test.runtime_refuses" in msg and "cuda:0 (cuda backend)" in msg
    assert "operation not permitted when stream is capturing" in msg
    assert "check_capturable" in msg and "device='cpu'" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_later_ops_of_a_ruined_capture_point_at_the_first_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MESSAGE, "text", "CUDA error: operation failed due to a previous error "
                                         "during capture\n`cudaErrorStreamCaptureInvalidated'")
    with pytest.raises(CaptureError, match="find the first refused op"), _mode():
        torch.ops.accel_graph_test.runtime_refuses(torch.ones(3))


def test_other_errors_pass_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MESSAGE, "text", "shape mismatch: something else entirely")
    with pytest.raises(RuntimeError) as info, _mode():
        torch.ops.accel_graph_test.runtime_refuses(torch.ones(3))
    assert not isinstance(info.value, CaptureError)
    assert str(info.value) == "shape mismatch: something else entirely"


def test_as_capture_error_leaves_our_own_errors_alone() -> None:
    assert as_capture_error("op", "cuda:0", CaptureError("already ours: " + REFUSAL)) is None
    assert as_capture_error("op", "cuda:0", ValueError(REFUSAL)) is None
    assert isinstance(as_capture_error("op", "cuda:0", RuntimeError(REFUSAL)), CaptureError)


def test_a_dropped_capture_ends_on_the_stream_it_began_on() -> None:
    """torch's capture_end refuses any other stream; a capture left open made every later op
    on the H200 fail. FAKE backend and graph: which stream is current at capture_end."""
    import contextlib

    from accel_graph.backends.native.capture_errors import end_capture_quietly

    current = ["default"]
    ended_on: list[str] = []

    class Backend:
        @contextlib.contextmanager
        def stream_context(self, stream: str):  # noqa: ANN202
            before, current[0] = current[0], stream
            try:
                yield
            finally:
                current[0] = before

    class Graph:
        def capture_end(self) -> None:
            ended_on.append(current[0])
            if current[0] != "side":
                raise RuntimeError("Capture must end on the same stream it began on.")

    end_capture_quietly(Backend(), "side", Graph())
    assert ended_on == ["side"] and current == ["default"]
    end_capture_quietly(Backend(), None, Graph())  # no stream known: tried as is, never raises
    assert ended_on == ["side", "default"]
