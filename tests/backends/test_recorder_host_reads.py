"""Host reads the dispatcher never sees (``tolist``, ``numpy``, ``numpy.asarray``, ``repr``,
``print``, f-strings, pickling) are refused during a recorder capture, as ``.item()`` is: on a
device each is a device-to-host copy, which fails while a stream captures; on the recorder they
would read pool memory that no kernel has written yet (issue 29, item 1)."""

from __future__ import annotations

import io
import pickle
import threading

import numpy as np
import pytest
import torch

import accel_graph as ag
from accel_graph import check_capturable
from accel_graph.backends.capture_common import hostreads
from accel_graph.errors import CaptureError

READS = {
    "tolist": (lambda t: t.tolist(), "Tensor.tolist()"),
    "numpy": (lambda t: t.numpy(), "Tensor.numpy()"),
    "asarray": (lambda t: np.asarray(t), "numpy.asarray"),
    "repr": (repr, "repr(tensor)"),
    "str": (str, "str(tensor)"),
    "print": (lambda t: print(t, file=io.StringIO()), "print(tensor)"),
    "fstring": (lambda t: f"{t}", "f-string"),
    "fstring_0d": (lambda t: f"{t.sum():.3f}", "f-string"),
    "pickle": (pickle.dumps, "pickling"),
    "torch.save": (lambda t: torch.save(t, io.BytesIO()), "pickling"),
}


@pytest.mark.parametrize("compile", [None, "inductor"])
@pytest.mark.parametrize("made_before", [False, True], ids=["made_in_capture", "static_input"])
@pytest.mark.parametrize("name", sorted(READS))
def test_host_read_during_capture_is_a_capture_error(name: str, made_before: bool,
                                                     compile: str | None) -> None:
    read, words = READS[name]
    x = torch.arange(4.0)
    g = ag.Graph(device="cpu", compile=compile)
    with pytest.raises(CaptureError, match="during capture") as info:
        with ag.graph(g):
            y = x * 2
            read(x if made_before else y)
    assert words in str(info.value)
    # The capture is over and dropped: the graph captures again, and replays right.
    assert not hostreads.installed()
    with ag.graph(g):
        y = x * 2
    x.add_(1)
    g.replay()
    assert y.tolist() == [2.0, 4.0, 6.0, 8.0]  # a host read after the capture is fine


def test_capture_error_ends_the_capture_even_if_caught() -> None:
    """Catching the error inside the captured code does not let the capture go on (as at an
    illegal op on CUDA): capture_end reports what invalidated it."""
    x = torch.ones(3)
    g = ag.Graph(device="cpu")
    g.capture_begin()
    y = x + 1
    with pytest.raises(CaptureError):
        y.tolist()
    with pytest.raises(CaptureError, match="tolist"):
        g.capture_end()


def test_reads_on_other_threads_and_after_capture_pass() -> None:
    x = torch.ones(3)
    seen: list = []
    g = ag.Graph(device="cpu")
    with ag.graph(g):
        y = x + 1
        t = threading.Thread(target=lambda: seen.append(x.tolist()))  # not the capturing thread
        t.start()
        t.join()
    assert seen == [[1.0, 1.0, 1.0]]
    g.replay()
    assert repr(y) == "tensor([2., 2., 2.])"
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # torch's own methods are back


def test_host_reads_on_another_device_pass_while_capturing_on_meta_like_device() -> None:
    """Only tensors of the capture's device count: the check compares device types."""
    token = hostreads.watch("cuda", lambda: True, lambda what, exc: None)
    hostreads.acquire()
    try:
        assert torch.ones(2).tolist() == [1.0, 1.0]  # a CPU tensor is host memory for a cuda capture
    finally:
        hostreads.unwatch(token)
        hostreads.release()


@pytest.mark.parametrize("name", sorted(READS))
def test_check_capturable_reports_each_read(name: str) -> None:
    read, words = READS[name]
    rep = check_capturable(lambda t: read(t * 2), torch.ones(3), steps=1)
    assert not rep.ok
    assert sum(f.level == "python" for f in rep.findings) == 1, rep.format()
    assert "test_recorder_host_reads.py" in rep.findings[0].location, rep.format()
