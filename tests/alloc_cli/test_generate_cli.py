"""``accel-alloc generate``: the calibrated generator on the command line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accel_graph.allocator.sim.generate import WORKLOADS, generate, trace_stats
from accel_graph.allocator.traces import load_trace
from accel_graph.cli.alloc.generate import WORKLOAD_NAMES

SMALL = ("--steps", "1", "--scale", "0.125", "--layers", "2")


def test_workload_names_match_the_library() -> None:
    assert WORKLOAD_NAMES == tuple(WORKLOADS)


@pytest.mark.parametrize(("name", "fmt", "head"), [
    ("t.pkl", "pickle", b"\x80"),
    ("t.pickle", "pickle", b"\x80"),
    ("t.json", "json", b"{"),
    ("t.agt", "compact", b"\x89AGTRACE"),
    ("t.trace", "compact", b"\x89AGTRACE"),
])  # fmt: skip
def test_round_trip_every_format(cli, tmp_path: Path, name: str, fmt: str, head: bytes) -> None:
    out = tmp_path / name
    r = cli("generate", "--workload", "train", "--seed", "3", *SMALL, "-o", out, "--json")
    assert r.code == 0, r.err
    body = r.json()
    assert body["schema"] == "accel-alloc/generate/1" and body["format"] == fmt
    assert out.read_bytes().startswith(head)
    assert body["bytes"] == out.stat().st_size
    want = generate("train", seed=3, steps=1, scale=0.125, layers=2)
    got = load_trace(out)
    assert got.num_events == want.num_events == body["events"]
    assert np.array_equal(got.events(0)["size"], want.events(0)["size"])
    assert np.array_equal(got.events(0)["action"], want.events(0)["action"])
    assert body["stats"] == pytest.approx(trace_stats(want))


def test_format_option_overrides_extension(cli, tmp_path: Path) -> None:
    out = tmp_path / "t.pkl"
    r = cli("generate", "-w", "frag", "-o", out, "--format", "json")
    assert r.code == 0, r.err
    assert out.read_bytes().startswith(b"{")
    assert "wrote" in r.out and "events" in r.out and "peak reserved" in r.out


def test_config_changes_the_trace(cli, tmp_path: Path) -> None:
    r = cli("generate", "-w", "frag", "--config", "expandable_segments:True", "-o",
            tmp_path / "f.agt", "--json")
    assert r.code == 0, r.err
    body = r.json()
    assert body["config"] == "expandable_segments:True"
    base = trace_stats(generate("frag"))
    assert body["stats"]["peak_reserved"] * 5 < base["peak_reserved"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_pickle_opens_in_torch_memory_viz(cli, tmp_path: Path) -> None:
    out = tmp_path / "t.pickle"
    assert cli("generate", "-w", "train", *SMALL, "-o", out).code == 0
    p = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "segments" in p.stdout


def test_generate_errors(cli, tmp_path: Path) -> None:
    out = tmp_path / "x.pkl"
    r = cli("generate", "-w", "frag", "--config", "bogus:1", "-o", out)
    assert r.code == 3 and "bogus" in r.err
    r = cli("generate", "-w", "nope", "-o", out)
    assert r.code == 2 and "invalid choice" in r.err
    assert cli("generate", "-w", "frag", "--steps", "0", "-o", out).code == 2
    assert cli("generate", "-w", "frag", "--scale", "0", "-o", out).code == 2
    assert cli("generate", "-w", "frag").code == 2  # -o is required
    assert cli("generate", "-w", "frag", "-o", out, "--format", "xml").code == 2
    assert not out.exists()
