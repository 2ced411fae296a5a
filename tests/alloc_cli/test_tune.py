"""``accel-alloc tune``: the search over a trace, the tables, the paste line, JSON and exit codes."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from accel_graph.allocator.alloc_conf import parse_config
from accel_graph.allocator.sim.scenario import largest_request
from accel_graph.allocator.traces import load_trace
from accel_graph.cli.alloc.main import main
from accel_graph.cli.alloc.validate import validate_payload

MIB = 1 << 20

TOP_KEYS = {
    "schema", "trace", "device_type", "device", "profile", "policy", "objective", "cap",
    "budget", "evaluated", "distinct_results", "alternatives_evaluated", "rejected",
    "space_size", "stages", "skipped_knobs", "baseline", "ranked", "pareto",
    "alternative_policies", "recommendation", "warnings", "uses", "private_pools", "accuracy",
    "seconds", "floor", "peak_scope",
}
ROW_KEYS = {
    "config", "label", "policy", "stage", "peak_reserved", "peak_allocated", "device_mallocs",
    "device_frees", "segment_maps", "segment_unmaps", "device_calls", "retries", "ooms", "oom",
    "fragmentation_at_peak", "changed_entries", "notes", "delta", "peak_reserved_recording",
    "start_reserved",
}
REC_KEYS = ROW_KEYS | {"same_as_baseline", "env_var", "env_line", "also", "snippet", "note",
                       "expected_peak_error_pct", "best_without_expandable_segments",
                       "passed_over", "torch"}


@pytest.fixture(scope="module")
def frag_json(frag_trace):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["tune", str(frag_trace), "--json"])
    assert code == 0
    return json.loads(buf.getvalue())


def test_json_schema(frag_json):
    p = frag_json
    assert p["schema"] == "accel-alloc/tune/1"
    assert set(p) == TOP_KEYS
    assert set(p["recommendation"]) == REC_KEYS
    for row in p["ranked"] + p["pareto"] + p["alternative_policies"] + [p["baseline"]]:
        assert ROW_KEYS <= set(row)
    assert {"rank", "equivalent", "equivalent_configs"} <= set(p["ranked"][0])
    assert set(p["ranked"][0]["delta"]) == {"peak_reserved", "peak_reserved_relative",
                                            "peak_reserved_recording",
                                            "peak_reserved_recording_relative",
                                            "start_reserved", "device_calls", "ooms"}
    assert [r["rank"] for r in p["ranked"]] == list(range(1, len(p["ranked"]) + 1))
    assert len(p["ranked"]) == 10  # --top default
    for w in p["warnings"]:
        assert set(w) == {"code", "severity", "message", "reference"} and w["reference"]
    assert set(p["accuracy"]) >= {"metrics", "peak_error_pct", "exact"}
    assert p["profile"] == "cuda-2.14" and p["policy"] == "native"


def test_frag_recommendation_removes_the_fragmentation(frag_json):
    p = frag_json
    assert p["evaluated"] >= 200
    base, rec = p["baseline"], p["recommendation"]
    assert base["peak_reserved"] > 1000 * MIB
    assert rec["peak_reserved"] < base["peak_reserved"] / 10
    assert rec["config"] == "expandable_segments:True"
    assert rec["delta"]["peak_reserved"] == rec["peak_reserved"] - base["peak_reserved"]
    assert rec["env_var"] == "PYTORCH_ALLOC_CONF"
    assert rec["env_line"] == "export PYTORCH_ALLOC_CONF=expandable_segments:True"
    assert rec["also"] == ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert rec["expected_peak_error_pct"] == 0.0
    assert rec["best_without_expandable_segments"]["config"]
    parse_config(rec["config"])  # torch accepts it
    assert "es-compat" in [w["code"] for w in p["warnings"]]
    assert p["ranked"][0]["config"] == rec["config"]


def test_pareto_is_non_dominated(frag_json):
    front = [(r["peak_reserved"], r["device_calls"]) for r in frag_json["pareto"]]
    assert front
    for pk, calls in front:
        for r in frag_json["ranked"]:
            dominated = (r["peak_reserved"] <= pk and r["device_calls"] <= calls
                         and (r["peak_reserved"], r["device_calls"]) != (pk, calls))
            assert not (dominated and not r["oom"])
    assert front == sorted(front)
    assert len({c for _, c in front}) == len(front)


def test_text_output(cli, frag_trace):
    r = cli("tune", frag_trace, "--no-progress", "--top", "3", "--budget", "40")
    assert r.code == 0, r.err
    assert "ranked by peak" in r.out and "Pareto front" in r.out
    assert "expected accuracy: peak error 0.00%" in r.out
    assert "export PYTORCH_ALLOC_CONF=expandable_segments:True" in r.out
    assert "_accelerator_setAllocatorSettings" in r.out
    assert "baseline (recorded settings" in r.out
    assert "warnings:" in r.out and "pytorch/pytorch#130330" in r.out
    assert "skipped garbage_collection_threshold" in r.out  # no --cap, and says why
    assert r.err == ""  # --no-progress: nothing on stderr


@pytest.mark.parametrize("objective", ["mallocs", "pareto"])
def test_objectives(cli, frag_trace, objective):
    r = cli("tune", frag_trace, "--json", "--objective", objective, "--budget", "40")
    assert r.code == 0, r.err
    p = r.json()
    assert p["objective"] == objective
    fronts = [x["config"] for x in p["pareto"]]
    if objective == "pareto":
        assert p["recommendation"]["config"] in fronts


def test_uses_and_env_override(cli, frag_trace, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    r = cli("tune", frag_trace, "--json", "--budget", "20", "--uses", "ipc,mempool")
    assert r.code == 0, r.err
    ws = {w["code"]: w for w in r.json()["warnings"]}
    assert ws["env-override"]["severity"] == "high"
    assert ws["es-ipc"]["severity"] == "high" and "#130330" in ws["es-ipc"]["reference"]
    assert "es-mempool" in ws and "es-compat" not in ws
    assert r.json()["uses"] == ["ipc", "mempool"]


def test_profile_cuda_29(cli, frag_trace):
    r = cli("tune", frag_trace, "--json", "--profile", "cuda-2.9", "--budget", "30")
    assert r.code == 0, r.err
    p = r.json()
    assert p["recommendation"]["env_var"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert "large_segment_size_mb" in [s["knob"] for s in p["skipped_knobs"]]
    assert not any("large_segment_size_mb" in (x["config"] or "") for x in p["ranked"])


def test_cap_and_oom_flags(cli, frag_trace):
    r = cli("tune", frag_trace, "--json", "--cap", "300MiB", "--budget", "120", "--top", "0")
    assert r.code == 0, r.err
    p = r.json()
    assert p["cap"] == 300 * MIB
    assert not any(s["knob"] == "garbage_collection_threshold" for s in p["skipped_knobs"])
    ooms = [x["oom"] for x in p["ranked"]]
    assert ooms == sorted(ooms)  # flagged, and last
    assert not p["recommendation"]["oom"]


def test_exit_codes(cli, frag_trace, tmp_path):
    need = largest_request(load_trace(frag_trace))
    r = cli("tune", frag_trace, "--cap", str(need - 1))
    assert r.code == 6 and "largest allocation" in r.err
    r = cli("tune", frag_trace, "--profile", "cuda-1.0")
    assert r.code == 5 and "unknown profile" in r.err
    r = cli("tune", frag_trace, "--uses", "telepathy")
    assert r.code == 2
    r = cli("tune", frag_trace, "--budget", "1")
    assert r.code == 2
    r = cli("tune", frag_trace, "--objective", "speed")
    assert r.code == 2
    r = cli("tune", tmp_path / "missing.pickle")
    assert r.code == 4


def test_npu_accuracy_matches_validate(cli, npu_dir):
    path = npu_dir / "snapshot_with_empty_cache.pkl"
    r = cli("tune", path, "--json", "--budget", "30")
    assert r.code == 0, r.err
    p = r.json()
    assert p["profile"] == "npu"
    assert p["recommendation"]["env_var"] == "PYTORCH_NPU_ALLOC_CONF"
    v = validate_payload(load_trace(path), p["device"], None)
    rel = v["metrics"]["peak_reserved"]["relative_error"]
    assert p["accuracy"]["peak_error_pct"] == pytest.approx(abs(rel) * 100, abs=1e-3)
    assert p["accuracy"]["metrics"]["peak_reserved"]["recorded"] == \
        v["metrics"]["peak_reserved"]["recorded"]


def test_private_pools_strengthen_the_es_warning(cli, tmp_path):
    from accel_graph.allocator.sim.generate import generate
    from accel_graph.allocator.traces import save_trace

    path = tmp_path / "serve.agtrace"  # CUDA-graph capture into a private pool
    save_trace(generate("serve", seed=0), path, format="compact")
    r = cli("tune", path, "--json", "--budget", "40")
    assert r.code == 0, r.err
    p = r.json()
    assert p["private_pools"] is True
    assert "expandable_segments:True" in p["recommendation"]["config"]
    ws = {w["code"]: w for w in p["warnings"]}
    assert ws["es-private-pools"]["severity"] == "high"


def test_floor_is_the_live_peak_and_below_every_candidate(frag_json):
    from accel_graph.allocator.analysis.inspect import inspect_trace
    from accel_graph.allocator.sim.generate import generate

    fl = frag_json["floor"]
    assert fl["peak_requested"] == inspect_trace(generate("frag", seed=0))["peaks"]["requested"]
    assert all(r["peak_reserved"] >= fl["peak_requested"] for r in frag_json["ranked"])
    rec = frag_json["recommendation"]["peak_reserved"]
    assert fl["recommended_over_floor"] == rec - fl["peak_requested"] >= 0
