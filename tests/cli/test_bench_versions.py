"""tools/bench_versions.py lines up bench --models reports by torch version, ratios untouched."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_versions.py"


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("bench_versions_tool", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(torch_version: str, compiled: float, vs_compile: float, mode: str) -> dict:
    row = {"model": "decoder", "batch": 1, "status": "ok", "median_us": 100.0}
    return {
        "hardware": {"torch": torch_version},
        "rows": [
            {**row, "variant": "eager", "ratio_vs_eager": 1.0, "ratio_vs_torch_compile": 2.0},
            {**row, "variant": "replay", "ratio_vs_eager": 0.9, "ratio_vs_torch_compile": 1.8},
            {**row, "variant": "replay_compiled", "ratio_vs_eager": compiled,
             "ratio_vs_torch_compile": vs_compile, "replay_mode": {"mode": mode}},
            # A failed variant never supplies a figure.
            {**row, "batch": 8, "variant": "replay_compiled", "status": "error",
             "ratio_vs_eager": 0.1, "ratio_vs_torch_compile": 0.1},
        ],
    }


def test_side_by_side_keeps_each_reports_own_ratios(tmp_path: Path) -> None:
    tool = _tool()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report("2.13.0+cpu", 0.3, 0.6, "compiled")))
    b.write_text(json.dumps(_report("2.14.1+cu130", 0.4, 0.8, "interpreted")))
    out = tmp_path / "side.json"
    assert tool.main(["--from", str(a), "--from", str(b), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "accel_graph.bench.versions/1"
    assert [r["torch"] for r in doc["reports"]] == ["2.13.0+cpu", "2.14.1+cu130"]
    one = next(r for r in doc["rows"] if r["batch"] == 1)["by_torch"]
    assert one["2.13.0+cpu"]["compiled_vs_eager"] == 0.3
    assert one["2.14.1+cu130"]["compiled_vs_torch_compile"] == 0.8
    assert one["2.14.1+cu130"]["replay_mode"] == "interpreted"
    assert one["2.13.0+cpu"]["interpreted_vs_eager"] == 0.9
    eight = next(r for r in doc["rows"] if r["batch"] == 8)["by_torch"]
    assert eight["2.13.0+cpu"]["compiled_vs_eager"] is None


def test_one_report_is_refused(tmp_path: Path) -> None:
    tool = _tool()
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_report("2.13.0+cpu", 0.3, 0.6, "compiled")))
    with pytest.raises(SystemExit):
        tool.main(["--from", str(a), "--json", str(tmp_path / "x.json")])
