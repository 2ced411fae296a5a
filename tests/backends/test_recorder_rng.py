"""Recorder internals of generator state in a capture (accel_graph/backends/recorder/rng.py):
the interception's lifetime across threads, the program's host steps in the dump, and
``compile="inductor"`` for programs with host steps (compiled in stretches) or explicit
generators (falls back, with the reason)."""

from __future__ import annotations

import json
import threading

import torch

import accel_graph
from accel_graph.backends.recorder import rng


def _original(name: str) -> bool:
    return type(torch.Generator.__dict__[name]).__name__ == "method_descriptor"


def _pair():
    state = torch.get_rng_state()
    a = torch.randn(32)
    torch.set_rng_state(state)
    return a, torch.randn(32) * 2


def test_interception_is_available_on_this_interpreter():
    assert rng.interception_available()
    assert not rng.installed() and _original("get_state") and _original("manual_seed")


def test_interception_lasts_while_any_capture_is_underway():
    """Two captures on two threads: methods stay intercepted until the last one ends, and each
    thread records only its own calls."""
    started, release = threading.Event(), threading.Event()
    results = {}

    def other():
        g = accel_graph.Graph(device="cpu")
        with accel_graph.graph(g):
            out = _pair()
            started.set()
            release.wait(30)
        torch.manual_seed(3)
        g.replay()
        results["other"] = torch.equal(out[0] * 2, out[1])

    t = threading.Thread(target=other)
    t.start()
    assert started.wait(30)
    g = accel_graph.Graph(device="cpu")
    with accel_graph.graph(g):
        out = _pair()
    assert rng.installed() and not _original("get_state"), "the other thread still captures"
    # This thread is not capturing now: its calls reach torch, although the other one captures.
    torch.manual_seed(1)
    release.set()
    t.join(30)
    assert not rng.installed() and _original("get_state") and _original("set_state")
    torch.manual_seed(2)
    g.replay()
    assert torch.equal(out[0] * 2, out[1]) and results["other"]


def test_host_steps_are_in_the_dump(tmp_path):
    g = accel_graph.Graph(device="cpu")
    with accel_graph.graph(g):
        _pair()
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    ops = json.loads((tmp_path / "g.dot.json").read_text())["ops"]
    host = [op for op in ops if op["kind"] == "host"]
    assert [op["op"] for op in host] == ["torch.default_generator.get_state",
                                         "torch.default_generator.set_state"]
    assert not any(op["allocates_at_replay"] for op in host)


def test_compiled_program_with_host_steps_runs_in_stretches(tmp_path):
    torch.manual_seed(7)
    expected = _pair()
    g = accel_graph.Graph(device="cpu", compile="inductor")
    with accel_graph.graph(g):
        out = _pair()
    torch.manual_seed(7)
    g.replay()
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    info = json.loads((tmp_path / "g.dot.json").read_text())["compiled"]
    assert "fallback" not in info, info
    assert info["host_steps"] == 2 and info["stretches"] == 2, info
    assert torch.equal(out[0], expected[0]) and torch.equal(out[0] * 2, out[1])


def test_explicit_generator_falls_back_with_its_reason(tmp_path, caplog):
    gen = torch.Generator().manual_seed(5)
    g = accel_graph.Graph(device="cpu", compile="inductor")
    g.register_generator_state(gen)
    with accel_graph.graph(g):
        out = torch.randn(16, generator=gen)
    gen.manual_seed(5)
    expected = torch.randn(16, generator=gen)
    gen.manual_seed(5)
    g.replay()
    assert torch.equal(out, expected)
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    info = json.loads((tmp_path / "g.dot.json").read_text())["compiled"]
    assert "explicit generator" in info["fallback"], info
    assert "C++ compiler" not in caplog.text  # not a compiler problem: no such hint


def test_generator_state_steps_and_refusals_leave_no_cyclic_garbage():
    """Captures with host steps, and captures ended by a refused seeding, go away by reference
    counting alone (as every capture must: test_recorder_soak)."""
    import gc

    def cycle(refuse: bool) -> None:
        g = accel_graph.Graph(device="cpu")
        try:
            with accel_graph.graph(g):
                _pair()
                if refuse:
                    torch.manual_seed(1)
        except accel_graph.CaptureError:
            assert refuse
        else:
            g.replay()

    for refuse in (False, True):
        cycle(refuse)
        gc.collect()
        gc.disable()
        try:
            cycle(refuse)
            assert gc.collect() == 0, f"refused={refuse}"
        finally:
            gc.enable()
