"""``accel-graph demo``: runs end to end (no compile, tiny counts), JSON schema, exit codes.
No timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from accel_graph.cli import demo
from accel_graph.cli.main import COMMANDS, main

FAST = ["--no-compile", "--buckets", "1", "2", "--requests", "3", "--new-tokens", "4",
        "--bench-iters", "10"]


def test_registered() -> None:
    assert COMMANDS["demo"][0] == "accel_graph.cli.demo"


def test_demo_runs_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demo.json"
    assert main(["demo", *FAST, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "OK" in text and "runner overhead" in text
    report = json.loads(out.read_text())
    assert report["schema"] == demo.SCHEMA
    assert report["check"] == {"ok": True, "near_ties": 0, "mismatches": 0}
    assert [b["bucket"] for b in report["buckets"]] == [1, 2]
    for row in report["buckets"]:
        assert row["status"] == "captured"
        for key in ("capture_ms", "standalone_bytes", "graph_step_us", "eager_step_us", "speedup"):
            assert row[key] > 0 and math.isfinite(row[key])
    sv = report["serving"]
    assert sv["requests"] == 3 and sv["batch_sizes"][:2] == [1, 2]
    assert sv["generated_tokens"] == sum(sv["batch_sizes"]) * 4
    assert sv["graph_tokens_per_s"] > 0 and sv["eager_tokens_per_s"] > 0
    assert set(report["overhead"]) >= {"tiny_overhead_us", "decoder_overhead_us"}
    b1 = report["batch1"]
    assert b1["batch"] == 1 and b1["graph_tokens_per_s"] > 0 and b1["eager_tokens_per_s"] > 0
    assert report["runner_stats"]["eager_calls"] == 0


def test_mismatch_fails_the_demo(monkeypatch, capsys) -> None:
    def fake(prompt_len, eager, graph, logits):
        return 1, 0, [{"row": 0, "position": prompt_len, "eager": 1, "graph": 2, "top2_gap": 0.5}]

    monkeypatch.setattr(demo, "_check_tokens", fake)
    assert main(["demo", *FAST, "--bench-iters", "0"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_near_tie_is_not_a_failure() -> None:
    import torch

    eager = torch.tensor([[5, 1, 2]])
    graph = torch.tensor([[5, 1, 3]])
    tie = torch.zeros(3, 1, 8)
    tie[1, 0, 2] = tie[1, 0, 3] = 1.0  # step 1 (predicting position 2): exact tie
    compared, ties, bad = demo._check_tokens(1, eager, graph, list(tie))
    assert (ties, bad) == (1, [])
    far = torch.zeros(3, 1, 8)
    far[1, 0, 2] = 1.0
    _, ties, bad = demo._check_tokens(1, eager, graph, list(far))
    assert ties == 0 and bad[0]["position"] == 2


@pytest.mark.parametrize(
    "argv",
    [["--buckets", "0"], ["--requests", "0"], ["--new-tokens", "500"], ["--bench-iters", "-1"]],
)
def test_bad_arguments_exit_2(argv, capsys) -> None:
    assert main(["demo", "--no-compile", *argv]) == 2
    assert "error" in capsys.readouterr().err


def test_request_stream_is_deterministic() -> None:
    a = demo.make_requests(3, 10, 4, 512)
    b = demo.make_requests(3, 10, 4, 512)
    assert all((x == y).all() for x, y in zip(a, b))
    assert sorted({int(x.shape[0]) for x in a}) == [1, 2, 3, 4]
