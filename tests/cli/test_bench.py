"""``accel-graph bench`` and the subcommand registry: run in-process with tiny counts and no
compile; check the report's schema and that every number present is positive and finite. No
timing assertions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accel_graph.bench import decode as bench_decode
from accel_graph.bench.timing import (
    count_allocations,
    interleaved_samples,
    percentile,
    summarize_ns,
)
from accel_graph.cli.bench import format_report
from accel_graph.cli.main import COMMANDS, main
from accel_graph.errors import BackendUnavailable

TINY = ["--iters", "6", "--warmup", "1", "--calls-per-round", "3", "--alloc-calls", "2"]
ROW_KEYS = {
    "variant",
    "batch",
    "status",
    "reason",
    "median_us",
    "p10_us",
    "p90_us",
    "samples",
    "ratio_vs_eager",
    "ratio_vs_torch_compile",
    "allocs_per_call",
    "max_abs_diff_vs_eager",
}
NUMBERS = ("median_us", "p10_us", "p90_us", "ratio_vs_eager")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--no-compile", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_bench_report_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    report = _run(tmp_path)
    assert torch.get_num_threads() == threads  # restored after the run
    table = capsys.readouterr().out
    assert "eager" in table and "replay" in table and "compile" in table

    assert report["schema_version"] == bench_decode.SCHEMA_VERSION
    assert {
        "tool",
        "created_utc",
        "hardware",
        "load_avg",
        "model",
        "settings",
        "rows",
        "capture",
        "compile",
    } <= report.keys()
    hw = report["hardware"]
    assert {"cpu", "nproc", "torch", "threads"} <= hw.keys()
    assert hw["threads"] == 1 and hw["nproc"] >= 1 and hw["torch"] == torch.__version__
    assert report["model"]["parameters"] > 0
    assert report["settings"]["batches"] == [1, 8] and report["settings"]["compile"] is False

    rows = {(r["variant"], r["batch"]): r for r in report["rows"]}
    variants = ("eager", "replay", "replay_compiled", "compile")
    assert set(rows) == {(v, b) for v in variants for b in (1, 8)}
    for row in report["rows"]:
        assert set(row) == ROW_KEYS
        if row["status"] == "ok":
            assert all(_positive(row[k]) for k in NUMBERS), row
            assert row["samples"] == 6
            assert row["allocs_per_call"] is None or row["allocs_per_call"] >= 0
        else:  # never a number for a variant that did not run
            assert row["status"] in {"unavailable", "failed", "skipped"} and row["reason"]
            assert all(row[k] is None for k in NUMBERS)
    for b in (1, 8):
        assert rows[("eager", b)]["status"] == "ok"
        assert rows[("eager", b)]["ratio_vs_eager"] == 1.0
        assert rows[("compile", b)]["status"] == "skipped"
        assert rows[("replay_compiled", b)]["status"] == "skipped"

    for cap in report["capture"]["batches"]:
        row = rows[("replay", cap["batch"])]
        assert cap["status"] == row["status"]
        if cap["status"] == "ok":
            assert _positive(cap["capture_ms"]) and _positive(cap["capture_vs_eager_call"])
            assert cap["bitwise_equal_to_eager"] is True
            assert cap["ops_per_graph"] is None or cap["ops_per_graph"] > 0
            # The recorder's memory columns: what the graph added, alone, and the pool total.
            assert cap["graph_memory_bytes"] > 0 and cap["standalone_bytes"] > 0
            assert cap["pool_reserved_bytes"] >= cap["graph_memory_bytes"]
    for comp in report["compile"]["batches"]:
        assert comp["status"] == "skipped" and comp["compile_s"] is None


def test_unavailable_recorder_is_reported_not_faked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise BackendUnavailable("recorder not built yet")

    monkeypatch.setattr(bench_decode, "_capture", refuse)
    report = _run(tmp_path, "--batch", "2")
    replay = next(r for r in report["rows"] if r["variant"] == "replay")
    assert replay["status"] == "unavailable"
    assert "recorder not built yet" in replay["reason"]
    assert replay["median_us"] is None and replay["ratio_vs_eager"] is None
    table = format_report(report)
    assert "unavailable: BackendUnavailable: recorder not built yet" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--batch", "9"],
        ["bench", "--batch", "1", "1"],
        ["bench", "--iters", "0"],
        ["bench", "--threads", "0"],
    ],
)
def test_bad_settings_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "accel-graph bench: error:" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_help_is_lazy() -> None:
    """``accel-graph --help`` lists every registered command without importing any of them."""
    code = (
        "import sys\n"
        "from accel_graph.cli.main import COMMANDS, main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = [m for m, _ in COMMANDS.values() if m in sys.modules]\n"
        "print('LOADED', loaded)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert "LOADED []" in proc.stdout
    for name in COMMANDS:
        assert name in proc.stdout


def test_interleaved_samples_round_robin() -> None:
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    samples = interleaved_samples(fns, rounds=4, calls_per_round=2, warmup=1)
    assert {k: len(v) for k, v in samples.items()} == {"a": 8, "b": 8, "c": 8}
    assert all(t >= 0 for v in samples.values() for t in v)
    timed = calls[3:]  # after one warm-up call each
    for r in range(4):  # every round runs every variant calls_per_round times in a row
        chunk = timed[r * 6 : (r + 1) * 6]
        assert sorted(chunk) == ["a", "a", "b", "b", "c", "c"]
        assert chunk[0] == chunk[1] and chunk[2] == chunk[3] and chunk[4] == chunk[5]


def test_percentiles_and_summary() -> None:
    assert percentile([1, 2, 3, 4, 5], 50) == 3.0
    assert percentile([0, 10], 10) == 1.0
    summary = summarize_ns([1000, 2000, 3000])
    assert summary == {"median_us": 2.0, "p10_us": 1.2, "p90_us": 2.8, "samples": 3}


def test_count_allocations() -> None:
    a, b, out = torch.ones(64), torch.ones(64), torch.empty(64)
    fresh = count_allocations(lambda: torch.empty(256), 5)
    into_out = count_allocations(lambda: torch.add(a, b, out=out), 5)
    if fresh is None:
        pytest.skip("this torch's profiler does not expose raw memory events")
    assert fresh >= 1.0
    assert into_out == 0.0
