"""Issue 29 item 5: an address at or above 2^63 is refused by every loader (exit 4, one line)
from every command, never an internal error (``inspect`` put it in an int64 array: exit 70).

Segment and block addresses were already limited to 2^63 - 1; event addresses were not, so a
file with one loaded, ``simulate``/``tune`` ran on it, and ``inspect`` crashed.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.analysis.inspect import inspect_trace
from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import Trace, load_trace, save_trace
from accel_graph.allocator.traces.actions import ACTION_CODE as C

from .test_hostile_exit_codes import COMMANDS, _argv

HIGH = 1 << 63


def _snapshot_with_high_events() -> dict:
    """A generated trace moved up by 2^63, without a segment list (segments come from events)."""
    snap = generate("frag", seed=0).to_snapshot()
    for e in snap["device_traces"][0]:
        e["addr"] += HIGH
    snap["segments"] = []
    return snap


def _compact_with_high_events(path: Path) -> Path:
    # save_trace writes what it is given; the loader must refuse it
    trace = generate("frag", seed=0)
    high = trace.device_traces[0].copy()
    high["addr"] += np.uint64(HIGH)
    save_trace(Trace([high], [], trace.allocator_settings, "cuda"), path, format="compact")
    return path


def _files(tmp_path: Path) -> dict[str, Path]:
    snap = _snapshot_with_high_events()
    pkl, js, rmm = tmp_path / "high.pkl", tmp_path / "high.json", tmp_path / "high.csv"
    pkl.write_bytes(pickle.dumps(snap))
    js.write_text(json.dumps(snap))
    rmm.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                   f"1,0.1,allocate,{HIGH:#x},1024,0\n1,0.2,free,{HIGH:#x},1024,0\n")
    one = generate("frag", seed=0).to_snapshot()
    one["device_traces"][0][1]["addr"] = HIGH  # one alloc among valid events
    single = tmp_path / "one.pkl"
    single.write_bytes(pickle.dumps(one))
    return {"pickle": pkl, "json": js, "rmm": rmm, "one event": single,
            "compact": _compact_with_high_events(tmp_path / "high.agtrace")}


def test_every_command_exits_4_with_one_line(tmp_path: Path, cli: Callable) -> None:
    for fmt, path in _files(tmp_path).items():
        for command in COMMANDS:
            run = cli(*_argv(command, path))
            lines = [line for line in run.err.splitlines() if "error:" in line]
            assert run.code == 4, (fmt, command, run.code, run.err[-800:])
            assert len(lines) == 1 and ("2^63" in lines[0] or "9223372036854775807" in lines[0]), (
                fmt, command, run.err[-800:])
            assert "internal error" not in run.err and "Traceback" not in run.err


def test_the_highest_valid_address_still_loads_and_inspects(tmp_path: Path, cli: Callable) -> None:
    top = (1 << 63) - (4 << 20)  # a 2 MiB segment ending below 2^63
    trace = Trace.from_events([(C["segment_alloc"], top, 2 << 20, 0, 0),
                               (C["alloc"], top, 512, 0, 0)])
    path = tmp_path / "top.pkl"
    save_trace(trace, path)
    assert int(load_trace(path).device_traces[0]["addr"].max()) == top
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.err[-800:]
    assert run.json()["peaks"]["reserved"] == 2 << 20


def test_inspect_of_an_in_memory_trace_says_why() -> None:
    trace = Trace.from_events([(C["segment_alloc"], HIGH, 2 << 20, 0, 0)])
    with pytest.raises(ValueError, match="at or above 2\\^63"):
        inspect_trace(trace)
