"""Regression tests for problems found by using ``accel-alloc`` as a user would: RMM logs and
legacy snapshots in every command, the validation gate, config words, deterministic plots,
generator inputs that used to crash, sizes, multi-device warnings and help texts."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest

from accel_graph.cli.alloc import options

RMM_ROWS = [
    "Thread,Time,Action,Pointer,Size,Stream",
    "1,10:00:00.000001,allocate,0x7f0000000000,1048576,0x0",
    "1,10:00:00.000002,allocate,0x7f0000100000,4194304,0x0",
    "1,10:00:00.000003,free,0x7f0000000000,1048576,0x0",
    "1,10:00:00.000004,allocate,0x7f0000200000,33554432,0x0",
    "1,10:00:00.000005,free,0x7f0000100000,4194304,0x0",
    "1,10:00:00.000007,free,0x7f0000200000,33554432,0x0",
]


@pytest.fixture
def rmm_log(tmp_path: Path) -> Path:
    path = tmp_path / "rmm.csv"
    path.write_text("\n".join(RMM_ROWS) + "\n")
    return path


@pytest.fixture
def legacy_list(tmp_path: Path, npu_dir: Path) -> Path:
    """torch.cuda.memory_snapshot()'s legacy format: the bare list of segments, no events."""
    with open(npu_dir / "snapshot_with_empty_cache.pkl", "rb") as f:
        snap = pickle.load(f)
    path = tmp_path / "legacy.pkl"
    with open(path, "wb") as f:
        pickle.dump(snap["segments"], f)
    return path


def test_inspect_rmm_log_is_a_clear_error_not_a_traceback(cli, rmm_log):
    r = cli("inspect", rmm_log)
    assert r.code == options.EXIT_UNSUPPORTED, r.err
    assert "Traceback" not in r.err and "internal error" not in r.err
    assert "no segments" in r.err and "accel-alloc simulate" in r.err


def test_validate_without_segment_events_cannot_pass_the_gate(cli, rmm_log):
    r = cli("validate", rmm_log, "--json")
    assert r.code == 0
    out = r.json()
    assert out["comparable"] is False and out["exact"] is False
    assert any("no segment events" in n for n in out["notes"])
    r = cli("validate", rmm_log, "--max-error", "50", "--json")
    assert r.code == options.EXIT_CHECK_FAILED
    assert r.json()["passed"] is False
    assert "cannot be validated" in cli("validate", rmm_log).out


def test_validate_gate_still_passes_on_an_exact_trace(cli, frag_trace):
    r = cli("validate", frag_trace, "--max-error", "0", "--json")
    assert r.code == 0 and r.json()["comparable"] is True and r.json()["passed"] is True


def test_inspect_legacy_list_reports_the_snapshot_state(cli, legacy_list):
    r = cli("inspect", legacy_list, "--json")
    assert r.code == 0, r.err
    out = r.json()
    assert out["events"]["total"] == 0
    assert out["peaks"]["reserved"] == out["peaks"]["final_reserved"] == 486 << 20
    waste = out["waste_at_peak"]
    assert sum(waste.values()) == out["at_peak"]["reserved"] - out["at_peak"]["requested"]
    assert any("no event history" in n for n in out["notes"])
    text = cli("inspect", legacy_list).out
    assert "at the snapshot" in text and "after event -1" not in text
    assert cli("inspect", legacy_list, "--device", "3").code == options.EXIT_UNSUPPORTED


@pytest.mark.parametrize("command", ["simulate", "validate", "tune"])
def test_replaying_a_legacy_list_says_why_it_cannot(cli, legacy_list, command):
    r = cli(command, legacy_list)
    assert r.code == options.EXIT_UNSUPPORTED
    assert "legacy list format" in r.err and "accel-alloc inspect" in r.err


def test_recorded_word_is_read_alike_by_every_command(cli, frag_trace, tmp_path):
    r = cli("diff", frag_trace, "--config", "expandable_segments:True", "--config-b",
            " Recorded ", "--json")
    assert r.code == 0, r.err
    assert r.json()["b"]["scenario"]["config"] is None
    pytest.importorskip("matplotlib")
    r = cli("plot", frag_trace, "--config", "RECORDED", "-o", tmp_path / "p.png", "--json")
    assert r.code == 0, r.err
    assert r.json()["series"][0]["config"] is None


@pytest.mark.parametrize("ext", ["svg", "html"])
def test_plot_files_are_byte_for_byte_reproducible(cli, frag_trace, tmp_path, ext):
    pytest.importorskip("matplotlib")
    a, b = tmp_path / f"a.{ext}", tmp_path / f"b.{ext}"
    assert cli("plot", frag_trace, "-o", a).code == 0
    assert cli("plot", frag_trace, "-o", b).code == 0
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("argv, code, words", [
    (["--config", "per_process_memory_fraction:0.9"], options.EXIT_CAP, "fraction"),
    (["--config", "backend:cudaMallocAsync"], options.EXIT_UNSUPPORTED, "cudaMallocAsync"),
    (["--scale", "inf"], options.EXIT_USAGE, "finite"),
    (["--scale", "nan"], options.EXIT_USAGE, "finite"),
])
def test_generate_refuses_what_it_cannot_run(cli, tmp_path, argv, code, words):
    out = tmp_path / "g.pkl"
    r = cli("generate", "-w", "frag", "-o", out, *argv)
    assert r.code == code, r.err
    assert words in r.err and "Traceback" not in r.err
    assert not out.exists()


def test_generate_output_mode_follows_the_umask(cli, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = tmp_path / "g.agt"
        assert cli("generate", "-w", "frag", "-o", out).code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


@pytest.mark.parametrize("text", ["0.5", "1.5", "0.9"])
def test_fractional_bytes_are_not_a_size(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        options.parse_size(text)


def test_sizes_with_units_may_be_fractional():
    assert options.parse_size("1.5GiB") == 3 << 29
    assert options.parse_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        options.parse_size("infGiB")


def test_cap_as_a_fraction_is_a_usage_error(cli, frag_trace):
    r = cli("simulate", frag_trace, "--cap", "0.9")
    assert r.code == options.EXIT_USAGE and "per_process_memory_fraction" in r.err


def test_busiest_device_is_chosen_with_a_warning_naming_the_others(cli, npu_dir):
    path = npu_dir / "snapshot_with_multi_devices.pkl"
    r = cli("simulate", path, "--json")
    assert r.code == 0
    assert r.json()["predicted"]["device"] == 1
    assert "warning" in r.err and "devices 0, 1" in r.err and "--device" in r.err
    r = cli("simulate", path, "--device", "1", "--json")
    assert r.code == 0 and r.err == ""


def test_tune_pre_212_profile_labels_the_extra_variable_as_the_newer_name(cli, frag_trace):
    r = cli("tune", frag_trace, "--profile", "cuda-2.9", "--budget", "8", "--no-progress")
    assert r.code == 0, r.err
    line = next(ln for ln in r.out.splitlines() if ln.strip().startswith("export PYTORCH_ALLOC_CONF"))
    assert "newer name" in line and "older name" not in line
    best = next((ln for ln in r.out.splitlines() if "best without expandable" in ln), None)
    assert best is None or "device calls" in best


@pytest.mark.parametrize("command, doc", [
    ("inspect", "accel-alloc-inspect.md"), ("tune", "accel-alloc-tune.md"),
    ("plot", "accel-alloc-plot-diff-generate.md"), ("diff", "accel-alloc-plot-diff-generate.md"),
    ("generate", "accel-alloc-plot-diff-generate.md"), ("simulate", "accel-alloc.md"),
])
def test_help_points_at_the_page_with_the_schema(cli, command, doc):
    r = cli(command, "--help")
    assert r.code == 0
    flat = " ".join(r.out.split())
    assert doc in flat.replace("- ", "-")


def test_policy_help_names_every_engine_policy(cli):
    from accel_graph.allocator.core.settings import POLICIES

    flat = " ".join(cli("simulate", "--help").out.split())
    for name in POLICIES:
        assert name in flat
