"""``accel-graph demo --tp 2``: two real gloo processes on loopback, tiny counts; the report's
checks and schema; bad options. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accel_graph.bench.tp import SCHEMA, TPSettings
from accel_graph.cli.main import main
from accel_graph.errors import ConfigError


def test_demo_tp_runs_and_checks_tokens(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "tp.json"
    argv = ["demo", "--tp", "2", "--buckets", "1", "2", "--new-tokens", "3", "--bench-iters", "10",
            "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "check: OK" in text and "replay tp: equal" in text and "tokens/s" in text
    report = json.loads(out.read_text())
    assert report["schema"] == SCHEMA and report["check"]["ok"]
    assert report["check"]["same_buckets_on_every_rank"]
    assert len(report["ranks"]) == 2
    for r in report["ranks"]:
        assert [b["status"] for b in r["buckets"]] == ["captured", "captured"], r["buckets"]
        assert r["eager_calls"] == 0  # the replay variant really replayed
        for name in ("eager_tp", "replay_tp"):
            assert r["tokens"][name]["compared"] == (1 + 2) * 3
            assert r["tokens"][name]["mismatches"] == []
            assert r["logits"][name]["close"]
    assert set(report["step_us"]) == {"eager_tp", "replay_tp", "allreduce_only",
                                      "eager_compute_only", "replay_compute_only"}
    assert report["single_process"]["step_us"]["eager"] > 0


def test_demo_tp_bad_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--tp", "0"]) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        TPSettings(world=1).validate()
    with pytest.raises(ConfigError, match="max_seq"):
        TPSettings(new_tokens=126).validate()
