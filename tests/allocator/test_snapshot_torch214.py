"""torch 2.14 snapshots: the ``annotate`` trace action, ``host_segments``/``host_traces`` and
per-thread ``user_metadata`` are read, kept, shown, and change no simulated figure.

No snapshot *with events* can be recorded on this machine: ``_record_memory_history`` needs a
CUDA driver (torch 2.14.1+cu130 on a GPU-less host raises "Found no NVIDIA driver"). What torch
2.14.1 does produce here is an event-less ``torch.cuda.memory._snapshot()``, used as-is below
(it has the new top-level keys). The snapshot with events is built by hand from the structure
torch 2.14.1's Python side documents and consumes: the ``TraceEntry``/``Segment``/``Block``
TypedDicts of ``torch/cuda/memory.py::_snapshot`` (action "annotate": "'addr' is the
allocation's base address and 'user_metadata' holds the annotation"), ``_annotate_tensor`` and
``_set_memory_metadata`` (per-thread ``user_metadata`` on every event of the calling thread),
``torch/cuda/_memory_viz.py::trace`` (reads ``e['user_metadata']`` of an annotate), and
``c10/core/CachingDeviceAllocator.h`` (``HostSegmentInfo``: address, size, allocated, active,
owner pool; host traces are ``TraceEntry`` lists like the device ones).
"""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any

import numpy as np
import pytest

from accel_graph.allocator.analysis.inspect import inspect_trace
from accel_graph.allocator.sim.replayer import replay_trace
from accel_graph.allocator.traces import Trace, TraceFormatError, load_trace, save_trace
from accel_graph.allocator.traces.actions import A_ANNOTATE, ACTIONS

MIB = 1 << 20
SEG = 0x7F0000000000
FR = [{"filename": "/work/train.py", "line": 12, "name": "step"}]


def _ev(action: str, addr: int, size: int, t: int, **extra: Any) -> dict[str, Any]:
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": FR}
    e.update(extra)
    return e


def snapshot_214() -> dict[str, Any]:
    """A torch 2.14.1-shaped snapshot: a 20 MiB segment, blocks a (live), b (freed), c (freed,
    its address reused by d, live); annotations on a (live), on b (then freed) and on c (then
    freed, the address reused); thread metadata on the allocations; pinned host records."""
    a, b = SEG, SEG + 4 * MIB
    events = [
        _ev("segment_alloc", SEG, 20 * MIB, 1),
        _ev("alloc", a, 4 * MIB, 2, user_metadata="thread=main"),
        _ev("alloc", b, 2 * MIB, 3, user_metadata="thread=loader"),
        _ev("annotate", a, 4 * MIB, 4, user_metadata="packed for backward"),
        _ev("annotate", b, 2 * MIB, 5, user_metadata="prefetch buffer"),
        _ev("free_requested", b, 2 * MIB, 6),
        _ev("free_completed", b, 2 * MIB, 7),
        _ev("alloc", b, 3 * MIB // 2, 8, user_metadata="thread=main"),  # c at b's address
        _ev("annotate", b, 3 * MIB // 2, 9, user_metadata="scratch"),
        _ev("free_requested", b, 3 * MIB // 2, 10),
        _ev("free_completed", b, 3 * MIB // 2, 11),
        _ev("alloc", b, 3 * MIB, 12),                                       # d: live, unannotated
    ]
    blocks = [
        {"address": a, "size": 4 * MIB, "requested_size": 4 * MIB, "state": "active_allocated",
         "frames": FR},
        {"address": b, "size": 3 * MIB, "requested_size": 3 * MIB, "state": "active_allocated",
         "frames": FR},
        {"address": b + 3 * MIB, "size": 13 * MIB, "requested_size": 0, "state": "inactive",
         "frames": []},
    ]
    segment = {"device": 0, "address": SEG, "total_size": 20 * MIB, "allocated_size": 7 * MIB,
               "active_size": 7 * MIB, "requested_size": 7 * MIB, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": FR, "blocks": blocks}
    host = 0x200000000
    return {
        "segments": [segment],
        "device_traces": [events],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "garbage_collection_threshold": 0.0,
                               "expandable_segments": False,
                               "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}},
        "external_annotations": [],
        "host_segments": [{"address": host, "size": 2 * MIB, "allocated": True, "active": True,
                           "segment_pool_id": (0, 0), "frames": FR}],
        "host_traces": [{"action": "alloc", "addr": host, "size": 2 * MIB, "stream": 0,
                         "time_us": 3, "frames": FR}],
    }


def _without_annotations(snap: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(snap)
    out["device_traces"] = [[e for e in d if e["action"] != "annotate"]
                            for d in out["device_traces"]]
    for k in ("host_segments", "host_traces"):
        out.pop(k)
    return out


@pytest.fixture
def trace214(tmp_path) -> Trace:
    path = tmp_path / "snap214.pickle"
    path.write_bytes(pickle.dumps(snapshot_214()))
    return load_trace(path)


def test_annotate_is_an_action_that_loads(trace214: Trace) -> None:
    assert ACTIONS[A_ANNOTATE] == "annotate"
    assert trace214.action_counts() == {"segment_alloc": 1, "alloc": 4, "annotate": 3,
                                        "free_requested": 2, "free_completed": 2}
    i = int(np.flatnonzero(trace214.events()["action"] == A_ANNOTATE)[0])
    assert trace214.event_extras[(0, i)] == {"user_metadata": "packed for backward"}
    assert trace214.event_extras[(0, 1)] == {"user_metadata": "thread=main"}  # per thread
    assert trace214.event_extras[(0, 2)] == {"user_metadata": "thread=loader"}


def test_round_trip_keeps_annotations_and_host_records(trace214: Trace, tmp_path) -> None:
    snap = snapshot_214()
    out = trace214.to_snapshot()
    assert out["device_traces"] == snap["device_traces"]
    assert out["host_segments"] == snap["host_segments"]
    assert out["host_traces"] == snap["host_traces"]
    for fmt, name in (("json", "t.json"), ("compact", "t.agt"), ("pickle", "t.pickle")):
        save_trace(trace214, tmp_path / name, format=fmt)
        back = load_trace(tmp_path / name)
        assert back.action_counts() == trace214.action_counts(), fmt
        assert np.array_equal(back.events()["action"], trace214.events()["action"]), fmt


def test_annotations_allocate_nothing(trace214: Trace, tmp_path) -> None:
    """The replay of the trace equals the replay of the same trace without its annotate events
    (and without the host records): same peaks, same segment calls."""
    path = tmp_path / "plain.pickle"
    path.write_bytes(pickle.dumps(_without_annotations(snapshot_214())))
    plain = load_trace(path)
    assert len(plain.events()) == len(trace214.events()) - 3
    with_ann, without = replay_trace(trace214), replay_trace(plain)
    assert with_ann.peak_reserved == without.peak_reserved == 20 * MIB
    assert with_ann.peak_allocated == without.peak_allocated
    assert with_ann.summary() == without.summary()


def test_validate_accepts_it_and_flags_an_annotation_after_free(trace214: Trace) -> None:
    report = trace214.validate()
    assert report.ok, report.errors
    assert not any("annotat" in w for w in report.warnings), report.warnings
    snap = snapshot_214()
    b = SEG + 4 * MIB
    snap["device_traces"][0].insert(7, _ev("annotate", b, 2 * MIB, 7, user_metadata="late"))
    late = Trace.from_snapshot(snap)
    assert [w for w in late.validate().warnings if "annotates a block that was freed" in w]


def test_inspect_lists_annotations_of_live_blocks_and_counts_host_records(trace214: Trace) -> None:
    report = inspect_trace(trace214)
    ann = report["annotations"]
    assert ann["total"] == 3
    # only a's annotation: b's block was freed, and c's address now holds d (unannotated)
    assert [(a["addr"], a["text"]) for a in ann["on_blocks_live_at_peak"]] == [
        (SEG, "packed for backward")]
    assert report["host_memory"] == {"host_segments": 1, "host_traces": 1}
    assert report["events"]["by_action"]["annotate"] == 3
    assert report["at_peak"]["requested"] == 7 * MIB  # the annotations add no bytes


@pytest.mark.parametrize("key, value", [("host_segments", {"a": 1}), ("host_traces", "x")])
def test_host_records_must_be_lists(key: str, value: object) -> None:
    snap = snapshot_214()
    snap[key] = value
    with pytest.raises(TraceFormatError, match=f"{key}: expected a list"):
        Trace.from_snapshot(snap)


def test_unknown_actions_are_still_refused() -> None:
    snap = snapshot_214()
    snap["device_traces"][0][3]["action"] = "annotated"
    with pytest.raises(TraceFormatError, match="unknown action 'annotated'.*annotate"):
        Trace.from_snapshot(snap)


def test_torch_memory_viz_reads_what_we_write(trace214: Trace) -> None:
    """torch's own reader of the installed build: 2.14's ``_memory_viz.trace`` prints each
    annotation of our written snapshot (an older torch has no annotate branch at all)."""
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    if "annotate" not in inspect.getsource(_memory_viz.trace):
        pytest.skip(f"torch {torch.__version__}'s _memory_viz predates the annotate action")
    text = _memory_viz.trace(trace214.to_snapshot())
    assert "# annotate" in text and "packed for backward" in text and "scratch" in text


def test_a_real_torch_snapshot_loads() -> None:
    """What the installed torch's ``_snapshot()`` returns on this host (no driver needed on
    2.14.1: it has no events, but torch 2.14's top-level keys)."""
    torch = pytest.importorskip("torch")
    try:
        snap = torch.cuda.memory._snapshot()
    except (AttributeError, RuntimeError) as e:  # CPU builds; 2.11 needs a driver here
        pytest.skip(f"torch {torch.__version__} gives no snapshot on this host: {e}")
    trace = Trace.from_snapshot(snap)
    if hasattr(torch.cuda.memory, "_annotate_tensor"):  # 2.14: pinned host records
        assert {"host_segments", "host_traces"} <= set(snap)
        assert inspect_trace(trace)["host_memory"] == {"host_segments": 0, "host_traces": 0}
    assert trace.to_snapshot()["allocator_settings"] == snap["allocator_settings"]


def test_accel_alloc_reads_a_214_snapshot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 4 ("unknown action 'annotate' ... not a valid PyTorch memory snapshot")."""
    from accel_graph.cli.alloc.main import main

    path = tmp_path / "snap214.pickle"
    path.write_bytes(pickle.dumps(snapshot_214()))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "annotate 3" in out
    assert "Annotations (torch 2.14 _annotate_tensor): 3 in the trace, 1 on blocks live" in out
    assert f"{SEG:#x}: packed for backward" in out
    assert "pinned host memory (torch 2.14 host_segments/host_traces): 1 segments, 1 events" in out
    for command in (["validate", str(path)], ["simulate", str(path), "--torch", "2.14"]):
        assert main(command) in (0, 1), command  # 1: validate's fidelity verdict, not a refusal
        assert "not a valid PyTorch memory snapshot" not in capsys.readouterr().err
