"""``accel-alloc inspect``: text report, JSON schema, exit codes."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path

from accel_graph.cli.alloc.options import EXIT_BAD_TRACE, EXIT_UNSUPPORTED, EXIT_USAGE

TOP_KEYS = {"schema", "trace", "device", "device_type", "settings", "events", "peaks",
            "waste_at_peak", "advice", "sites"}
COMPONENTS = {"internal_rounding", "free_in_live_segments", "wholly_free_segments",
              "other_streams", "pool_boundary", "private_pools", "unattributed"}


def test_text_report_headings(cli, train_trace: Path) -> None:
    r = cli("inspect", train_trace)
    assert r.code == 0, r.err
    for heading in ("Peaks", "Waste at the peak of reserved", "What removes it",
                    "Top allocation sites", "allocator settings: recorded",
                    "peak reserved", "utilisation:", "total (reserved - requested)"):
        assert heading in r.out, heading
    assert "start: from empty" in r.out


def test_json_on_npu_trace(cli, npu_dir: Path) -> None:
    r = cli("inspect", npu_dir / "snapshot_with_empty_cache.pkl", "--json", "--top", "3")
    assert r.code == 0, r.err
    doc = r.json()
    assert TOP_KEYS <= set(doc)
    assert doc["schema"] == "accel-alloc/inspect/1" and doc["device_type"] == "npu"
    assert set(doc["waste_at_peak"]) == COMPONENTS
    at = doc["at_peak"]
    assert sum(doc["waste_at_peak"].values()) == at["reserved"] - at["requested"]
    assert doc["peaks"]["reserved"] == 662_700_032
    assert doc["events"]["by_action"]["segment_free"] == 54
    assert doc["events"]["starts_mid_run"] and not doc["events"]["has_timestamps"]
    assert doc["settings"]["recorded"] is None
    assert len(doc["sites"]) == 3
    assert {"component", "bytes", "advice"} == set(doc["advice"][0])


def test_npu_text_says_settings_not_recorded(cli, npu_dir: Path) -> None:
    r = cli("inspect", npu_dir / "snapshot_expandable.pkl")
    assert r.code == 0, r.err
    assert "allocator settings: not recorded; expandable segments: on" in r.out
    assert "mid-run: 320 blocks" in r.out


def test_multi_device_choice(cli, npu_dir: Path) -> None:
    path = npu_dir / "snapshot_with_multi_devices.pkl"
    d1 = cli("inspect", path, "--json", "--device", "1").json()
    assert d1["device"] == 1 and d1["peaks"]["reserved"] == 551_550_976
    assert cli("inspect", path, "--device", "5").code == EXIT_UNSUPPORTED


def test_no_frames(cli, frag_trace: Path) -> None:
    r = cli("inspect", frag_trace)
    assert r.code == 0, r.err
    assert "no stack frames recorded" in r.out
    assert cli("inspect", frag_trace, "--json").json()["sites"] == []


def test_unreadable_files_exit_4(cli, train_trace: Path, tmp_path: Path) -> None:
    data = train_trace.read_bytes()
    half = tmp_path / "half.pickle"
    half.write_bytes(data[: len(data) // 2])
    r = cli("inspect", half)
    assert r.code == EXIT_BAD_TRACE and "error" in r.err
    hostile = tmp_path / "globals.pickle"
    hostile.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]],
                                      "x": OrderedDict(a=1)}))
    assert cli("inspect", hostile).code == EXIT_BAD_TRACE
    assert cli("inspect", tmp_path / "missing.pickle").code == EXIT_BAD_TRACE


def test_bad_top_is_a_usage_error(cli, train_trace: Path) -> None:
    assert cli("inspect", train_trace, "--top", "-1").code == EXIT_USAGE
    assert cli("inspect", train_trace, "--json", "--top", "0").json()["sites"] == []
