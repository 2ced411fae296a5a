"""``accel-graph serve-bench`` on a tiny stream (interpreted replay, one round): the table, the
JSON schema, tokens equal between the engines, the KV cache sized from a memory budget, bad
options. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accel_graph.cli.main import COMMANDS, main
from accel_graph.serving.engine_bench import FIGURES

TINY = ["--requests", "5", "--rate", "inf", "--prompt-lens", "2:20", "--max-new-tokens", "2:5",
        "--slots", "3", "--max-tokens", "16", "--rounds", "1", "--no-compile", "--no-progress",
        "--threads", "1"]


def test_serve_bench_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert COMMANDS["serve-bench"][0] == "accel_graph.cli.serve_bench"
    out = tmp_path / "sb.json"
    assert main(["serve-bench", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TPOT p50 ms" in text and "tokens_equal: true" in text and "graph replays per bucket" in text
    r = json.loads(out.read_text())
    assert r["schema"] == "accel_graph.serve-bench/1"
    assert r["requests"] == 5 and r["tokens_equal"] is True
    assert r["prefill_tokens"] >= 5 * 2 and 5 * 2 <= r["decode_tokens"] <= 5 * 5
    for name in ("eager", "graph"):
        assert set(FIGURES) <= set(r[name]) and r[name]["served"] == 5
        assert r[name]["tokens_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["graph"]["tokens_per_s"] / r["eager"]["tokens_per_s"])
    # every graph step of the timed round replayed: at most one decode graph, one chunk graph
    # per prompt chunk (graphs="full", the default); steps are counted per round
    use = r["bucket_use"]
    decode = sum(n for b, n in use.items() if b.startswith("decode "))
    chunk = sum(n for b, n in use.items() if b.startswith("chunk "))
    assert decode <= r["graph"]["steps"] <= decode + chunk and decode and chunk
    assert sum(use.values()) == decode + chunk  # no token-bucket replay in this mode
    kv = r["kv_cache"]
    assert kv["slots"] == 3 and kv["source"] == "measured" and kv["bytes"] == 3 * kv["bytes_per_slot"]


def test_serve_bench_memory_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sb.json"
    # weights ~2.2 MB + pool + slots of 512 KiB (max_seq 256): 6 MB leaves a few slots
    assert main(["serve-bench", *TINY, "--memory-budget", str(6 * 2**20), "--json", str(out)]) == 0
    kv = json.loads(out.read_text())["kv_cache"]
    assert kv["source"] in ("plan", "measured") and kv["budget_bytes"] == 6 * 2**20
    assert kv["slots"] == (kv["budget_bytes"] - kv["weights_bytes"] - kv["pool_bytes"]
                           - kv["warmup_peak_bytes"]) // kv["bytes_per_slot"] >= 1
    assert f"KV cache: {kv['slots']} slots" in capsys.readouterr().out


@pytest.mark.parametrize("bad, words", [
    (["--prompt-lens", "9:3"], "--prompt-lens must be A:B"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--memory-budget", "1000"], "raise the budget to at least"),
])
def test_serve_bench_bad_options(bad: list[str], words: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-bench", *TINY, *bad]) == 2
    assert words in capsys.readouterr().err
