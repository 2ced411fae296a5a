"""accel_graph.allocator.analysis.inspect: peaks, the waste breakdown at the peak, sites, layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.analysis.inspect import (
    SCHEMA,
    WASTE_COMPONENTS,
    inspect_trace,
)
from accel_graph.allocator.analysis.layout import layout_at
from accel_graph.allocator.analysis.sites import top_user_frame
from accel_graph.allocator.sim.fidelity import find_npu_traces
from accel_graph.allocator.sim.trace_ops import recorded_summary
from accel_graph.allocator.traces import Trace, load_trace
from accel_graph.allocator.traces.actions import ACTION_CODE as C
from accel_graph.allocator.traces.record import TRACE_DTYPE

MIB = 1 << 20
A, B = 7, 9  # streams: A does most allocations
L1, SB, SA, L2, P = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000, 0x5000_0000


def _known_trace() -> Trace:
    """Every waste component nonzero, with answers known exactly (CUDA rounding: 512 bytes)."""
    ev = [
        # a 20 MiB large segment used once, then wholly free
        (C["segment_alloc"], L1, 20 * MIB, A, 0),
        (C["alloc"], L1, 12 * MIB, A, 0),
        (C["free_requested"], L1, 12 * MIB, A, 0),
        (C["free_completed"], L1, 12 * MIB, A, 0),
        # a small segment of stream B: one live block, one freed but awaiting completion
        (C["segment_alloc"], SB, 2 * MIB, B, 0),
        (C["alloc"], SB, 100, B, 0),
        (C["alloc"], SB + 512, 3000, B, 0),
        (C["free_requested"], SB + 512, 3000, B, 0),
        # a large segment with one live 4 MiB block: 16 MiB free in the large pool
        (C["segment_alloc"], L2, 20 * MIB, A, 0),
        (C["alloc"], L2, 4 * MIB, A, 0),
        # a private pool (graph) segment
        (C["segment_alloc"], P, 2 * MIB, A, 1),
        (C["alloc"], P, 1000, A, 1),
        # the peak: a small segment of the main stream for three 100-byte requests
        (C["segment_alloc"], SA, 2 * MIB, A, 0),
        (C["alloc"], SA, 100, A, 0),
        (C["alloc"], SA + 512, 100, A, 0),
        (C["alloc"], SA + 1024, 100, A, 0),
    ]
    return Trace.from_events(ev, device_type="cuda")


def test_every_component_on_a_known_trace() -> None:
    r = inspect_trace(_known_trace())
    w = r["waste_at_peak"]
    assert w == {
        "internal_rounding": (512 - 100) + 0 + (1024 - 1000) + 3 * (512 - 100),
        "free_in_live_segments": 2 * MIB - 1536,
        "wholly_free_segments": 20 * MIB,
        # stream B's segment: free bytes plus the 3072-byte block awaiting free_completed
        "other_streams": 2 * MIB - 512,
        "pool_boundary": 16 * MIB,
        "private_pools": 2 * MIB - 1024,
        "unattributed": 0,
    }
    at = r["at_peak"]
    assert at["reserved"] == 46 * MIB == r["peaks"]["reserved"]
    assert at["requested"] == 100 + 4 * MIB + 1000 + 300
    assert sum(w.values()) == at["reserved"] - at["requested"]
    assert at["active"] - at["allocated"] == 3072  # the pending block
    assert at["trigger"]["pool"] == "small" and at["trigger"]["requested"] == 100
    assert at["main_stream"] == A and r["events"]["streams"] == 2
    assert at["active"] == 4 * MIB + 512 + 3072 + 1024 + 3 * 512
    # the 12 MiB block, freed before the peak of reserved, sets the other peaks
    assert r["peaks"]["requested"] == r["peaks"]["allocated"] == r["peaks"]["active"] == 12 * MIB
    assert r["peaks"]["utilisation"] == pytest.approx(12 / 46, abs=1e-6)
    assert r["peaks"]["utilisation_at_peak_reserved"] == pytest.approx(at["active"] / (46 * MIB),
                                                                       abs=1e-6)
    assert not r["events"]["starts_mid_run"] and r["start"]["reserved"] == 0
    assert r["sites"] == [] and r["sites_note"] == "no stack frames recorded"
    assert [a["component"] for a in r["advice"]] == [
        "wholly_free_segments", "pool_boundary", "other_streams", "private_pools",
        "free_in_live_segments", "internal_rounding"]  # by bytes
    assert "expandable_segments:True" in r["advice"][4]["advice"]
    assert "record_stream" in r["advice"][2]["advice"]
    json.dumps(r)  # JSON types only


def test_peak_moment_is_the_fullest_state_of_the_reserved_plateau() -> None:
    ev = [(C["segment_alloc"], SA, 2 * MIB, A, 0), (C["alloc"], SA, 1000, A, 0),
          (C["alloc"], SA + 1024, 5000, A, 0), (C["free_requested"], SA + 1024, 5000, A, 0),
          (C["free_completed"], SA + 1024, 5000, A, 0)]
    r = inspect_trace(Trace.from_events(ev, device_type="cuda"))
    assert r["at_peak"]["state"] == 3 and r["at_peak"]["requested"] == 6000
    assert r["peaks"]["reserved_event_index"] == 0
    assert r["waste_at_peak"]["free_in_live_segments"] == 2 * MIB - 1024 - 5120


def test_mid_run_start_state() -> None:
    """A trace that frees a block it never allocated, and ends with one it never touched."""
    seg = 0x6000_0000
    ev = [(C["free_requested"], seg + 512, 200, A, 0), (C["free_completed"], seg + 512, 200, A, 0),
          (C["alloc"], seg + 1024, 1000, A, 0)]
    blocks = [
        {"address": seg, "size": 512, "requested_size": 300, "state": "active_allocated"},
        {"address": seg + 512, "size": 512, "requested_size": 0, "state": "inactive"},
        {"address": seg + 1024, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
        {"address": seg + 2048, "size": 2 * MIB - 2048, "requested_size": 0, "state": "inactive"},
    ]
    final = [{"device": 0, "address": seg, "total_size": 2 * MIB, "stream": A,
              "segment_type": "small", "segment_pool_id": (0, 0), "is_expandable": False,
              "blocks": [dict(b, frames=[]) for b in blocks], "frames": []}]
    t = Trace.from_events(ev, device_type="cuda", segments=final)
    r = inspect_trace(t)
    e = r["events"]
    assert e["starts_mid_run"] and e["pre_existing_blocks"] == 2 and e["pre_existing_frees"] == 1
    assert r["start"] == {"reserved": 2 * MIB, "requested": 500, "allocated": 1024,
                          "active": 1024}
    assert r["peaks"]["requested"] == 1300 and r["peaks"]["reserved"] == 2 * MIB
    assert r["waste_at_peak"]["internal_rounding"] == 212 + 24
    assert r["waste_at_peak"]["free_in_live_segments"] == 2 * MIB - 1536
    # the layout rebuilt at the end is the final segments' live blocks
    lay = layout_at(t)
    assert [(b["address"], b["size"], b["requested_size"]) for b in lay[0]["blocks"]] == [
        (seg, 512, 300), (seg + 1024, 1024, 1000)]
    # at the start, the block freed later is live too
    assert [b["address"] for b in layout_at(t, state=0)[0]["blocks"]] == [seg, seg + 512]


def test_expandable_map_unmap_and_sites() -> None:
    stacks = [
        ({"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
         {"filename": "/home/u/model.py", "line": 42, "name": "forward"}),
        ({"filename": "<frozen runpy>", "line": 1, "name": "_run"},),
    ]
    rows = [(C["segment_map"], SA, 4 * MIB, A, 0, 0), (C["alloc"], SA, 3 * MIB, A, 0, 0),
            (C["alloc"], SA + 3 * MIB, 100, A, 0, 1), (C["segment_map"], SA + 4 * MIB, 2 * MIB, A, 0, -1),
            (C["alloc"], SA + 4 * MIB, 1 * MIB + 1, A, 0, -1),
            (C["free_requested"], SA + 4 * MIB, MIB + 1, A, 0, -1),
            (C["free_completed"], SA + 4 * MIB, MIB + 1, A, 0, -1),
            (C["segment_unmap"], SA + 4 * MIB, 2 * MIB, A, 0, -1)]
    ev = np.zeros(len(rows), TRACE_DTYPE)
    for i, (act, addr, size, st, pool, fr) in enumerate(rows):
        ev[i] = (act, fr, addr, size, st, -1, pool)
    t = Trace(device_traces=[ev], device_type="cuda", stacks=stacks)
    t.segments = t.derive_segments()
    r = inspect_trace(t, top=5)
    assert r["peaks"]["reserved"] == 6 * MIB == recorded_summary(t, 0)["peak_reserved"]
    assert r["peaks"]["final_reserved"] == 4 * MIB
    assert r["settings"]["expandable_segments"] is True
    assert "inferred" in r["settings"]["expandable_segments_source"]
    assert r["at_peak"]["segments"] == 1  # the two mapped ranges are one contiguous range
    w = r["waste_at_peak"]
    assert sum(w.values()) == r["at_peak"]["reserved"] - r["at_peak"]["requested"]
    sites = {s["site"]: s for s in r["sites"]}
    assert sites["/home/u/model.py:42 (forward)"]["live_at_peak_bytes"] == 3 * MIB
    assert sites["<frozen runpy>:1 (_run)"]["live_at_peak_bytes"] == 100  # only pseudo-frames
    assert sites["(no stack frames)"]["allocations"] == 1
    assert r["sites"][0]["site"] == "/home/u/model.py:42 (forward)"
    assert inspect_trace(t, top=1)["sites"] == r["sites"][:1]


def test_top_user_frame() -> None:
    torch_f = {"filename": "/v/lib/python3.11/site-packages/torch/nn/modules/module.py"}
    npu_f = {"filename": "/v/site-packages/torch_npu/npu/memory.py"}
    vision = {"filename": "/v/site-packages/torchvision/models/resnet.py"}
    assert top_user_frame([torch_f, npu_f, vision]) is vision
    assert top_user_frame([{"filename": "<string>"}, torch_f]) == {"filename": "<string>"}
    assert top_user_frame([]) is None


def test_empty_device_and_bad_top() -> None:
    t = _known_trace()
    r = inspect_trace(t, device=3)
    assert r["events"]["total"] == 0 and r["peaks"]["reserved"] == 0
    assert r["waste_at_peak"] == dict.fromkeys(WASTE_COMPONENTS, 0)
    with pytest.raises(ValueError):
        inspect_trace(t, top=-1)


# ------------------------------------------------------------------------------------------
# the Ascend traces


@pytest.fixture(scope="module")
def npu() -> dict[str, Trace]:
    d = find_npu_traces(Path(__file__).resolve().parents[2])
    if d is None:
        pytest.skip("shared/traces/npu not found")
    return {p.name: load_trace(p) for p in sorted(Path(d).glob("*.pkl"))}


def test_npu_components_sum_and_peaks(npu: dict[str, Trace]) -> None:
    for name, t in npu.items():
        for device in t.devices:
            r = inspect_trace(t, device)
            at, w = r["at_peak"], r["waste_at_peak"]
            assert r["schema"] == SCHEMA
            assert sum(w.values()) == at["reserved"] - at["requested"], name
            assert w["unattributed"] == 0 and min(w.values()) >= 0, (name, w)
            rec = recorded_summary(t, device)
            assert r["peaks"]["reserved"] == rec["peak_reserved"] == at["reserved"], name
            assert r["start"]["reserved"] == rec["start_reserved"], name
            assert r["peaks"]["final_reserved"] == rec["final_reserved"], name
            # the README's figures: peak allocated (requested bytes) and the start state
            assert r["peaks"]["requested"] in (597_327_488, 471_498_368), name
            if r["events"]["starts_mid_run"]:
                assert r["events"]["pre_existing_blocks"] == 320
                assert r["start"]["requested"] == 94_326_992
                assert r["start"]["reserved"] == 113_246_208


def test_npu_empty_cache_breakdown(npu: dict[str, Trace]) -> None:
    r = inspect_trace(npu["snapshot_with_empty_cache.pkl"], top=3)
    assert r["peaks"]["reserved"] == 662_700_032
    assert r["waste_at_peak"]["wholly_free_segments"] == 20 * MIB
    assert r["settings"]["recorded"] is None and r["settings"]["expandable_segments"] is False
    assert r["sites"][0]["site"].endswith("memory_leaks_demo.py:17 (train_one_step)")
    assert any(s["site"] == "(allocated before the recording began)"
               and s["live_at_peak_count"] == 320 for s in r["sites"])


def test_npu_layout_at_end_is_the_final_segments(npu: dict[str, Trace]) -> None:
    for name in ("snapshot_with_empty_cache.pkl", "snapshot_with_empty_cache_expandable.pkl"):
        t = npu[name]
        lay = layout_at(t)
        assert [(s["address"], s["total_size"]) for s in lay] == sorted(
            (s["address"], s["total_size"]) for s in t.segments), name
        got = sorted((b["address"], b["size"], b["requested_size"]) for s in lay for b in s["blocks"])
        want = sorted((b["address"], b["size"], b["requested_size"]) for s in t.segments
                      for b in s["blocks"] if b["state"] != "inactive")
        assert got == want, name
