"""The generator's ``pin`` workload (the pytorch#193400 pattern) through the CLI: a torch
upgrade's effect shown by ``diff --profile/--profile-b``, and ``tune`` leaving the combination."""

from __future__ import annotations

MIB = 1 << 20


def test_upgrade_diff_and_tune_on_the_pin_pattern(cli, tmp_path):
    path = tmp_path / "pin.agtrace"
    r = cli("generate", "--workload", "pin", "--steps", "50",
            "--config", "max_split_size_mb:128,expandable_segments:True", "-o", path)
    assert r.code == 0, r.err
    r = cli("diff", path, "--profile", "cuda-2.9", "--profile-b", "cuda-2.13", "--json",
            "--fail-above", "10")
    assert r.code == 1, r.err  # the upgrade grows reserved: the gate trips
    d = r.json()
    peak = d["metrics"]["peak_reserved"]
    assert (peak["a"], peak["b"]) == (240 * MIB, 6_940 * MIB)  # as test_replay_profiles.py
    assert not d["passed"]
    r = cli("tune", path, "--json", "--no-progress", "--budget", "64")
    assert r.code == 0, r.err
    rec = r.json()["recommendation"]
    assert rec["peak_reserved"] < 300 * MIB
    assert not ("max_split_size_mb" in rec["config"] and "expandable_segments:True" in rec["config"])
