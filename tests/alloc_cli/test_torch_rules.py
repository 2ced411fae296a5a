"""``--torch X.Y``: the config-parser rules and default profile follow the trace's torch, and
every command says which rules it used (text and JSON); bad values are usage errors (exit 2)."""

from __future__ import annotations

import pytest

from accel_graph.allocator.sim.scenario import make_scenario
from accel_graph.allocator.traces import load_trace


def _rules(doc: dict) -> dict:
    return doc["predicted"]["config_rules"]


def test_simulate_defaults_to_the_newest_rules(cli, frag_trace) -> None:
    r = cli("simulate", frag_trace, "--config", "max_split_size_mb:256", "--json")
    assert r.code == 0, r.err
    p = r.json()["predicted"]
    assert p["profile"] == "cuda-2.14"
    assert _rules(r.json()) == {"torch": "2.14",
                                "chosen_by": "profile cuda-2.14 (torch 2.14 or later)"}


@pytest.mark.parametrize("given, profile, rules", [
    ("2.13", "cuda-2.13", "2.13"), ("2.13.0+cpu", "cuda-2.13", "2.13"),
    ("2.14.1+cu130", "cuda-2.14", "2.14"), ("2.12", "cuda-2.12", "2.13"),
    ("2.11.0+cu130", "cuda-2.11", "2.11"), ("2.9", "cuda-2.9", "2.11"),
    ("2.15", "cuda-2.14", "2.14"),
])  # fmt: skip
def test_torch_picks_rules_and_profile(cli, frag_trace, given, profile, rules) -> None:
    r = cli("simulate", frag_trace, "--config", "max_split_size_mb:256", "--torch", given,
            "--json")
    assert r.code == 0, r.err
    p = r.json()["predicted"]
    assert p["profile"] == profile
    want = given.split("+")[0].split(".")
    assert _rules(r.json()) == {"torch": rules,
                                "chosen_by": f"torch {want[0]}.{want[1]} given"}


def test_text_output_names_the_rules(cli, frag_trace) -> None:
    r = cli("simulate", frag_trace, "--torch", "2.13")
    assert r.code == 0, r.err
    assert "config rules: torch 2.13's PYTORCH_ALLOC_CONF parser (chosen by torch 2.13 given" in r.out
    r = cli("simulate", frag_trace)
    assert "config rules: torch 2.14's PYTORCH_ALLOC_CONF parser (chosen by profile cuda-2.14" in r.out


@pytest.mark.parametrize("bad", ["banana", "3.0", "1.13", "2", ""])
def test_bad_torch_is_a_usage_error(cli, frag_trace, bad) -> None:
    r = cli("simulate", frag_trace, "--torch", bad)
    assert r.code == 2
    assert "--torch" in r.err and ("MAJOR.MINOR" in r.err or "torch 2.x" in r.err)
    assert len(r.err.strip().splitlines()) == 1


def test_explicit_profile_wins_and_a_mismatch_is_noted(cli, frag_trace) -> None:
    r = cli("simulate", frag_trace, "--torch", "2.14", "--profile", "cuda-2.9", "--json")
    assert r.code == 0, r.err
    p = r.json()["predicted"]
    assert p["profile"] == "cuda-2.9" and p["config_rules"]["torch"] == "2.14"
    assert any("describes torch 2.0-2.10, not the torch 2.14 given" in n for n in p["notes"])


def test_every_scenario_command_reports_the_rules(cli, frag_trace, tmp_path) -> None:
    v = cli("validate", frag_trace, "--torch", "2.13", "--json")
    assert v.code in (0, 1), v.err
    assert "2.13" in v.out and "config_rules" in v.out
    d = cli("diff", frag_trace, "--config-b", "expandable_segments:True", "--torch", "2.13",
            "--json")
    assert d.code == 0, d.err
    body = d.json()
    assert body["a"]["scenario"]["config_rules"]["torch"] == "2.13"
    assert body["b"]["scenario"]["config_rules"]["torch"] == "2.13"
    assert "torch 2.13 config rules" in cli("diff", frag_trace, "--config-b",
                                            "expandable_segments:True", "--torch", "2.13").out
    assert "config rules: torch 2.13's" in cli("validate", frag_trace, "--torch", "2.13").out
    pl = cli("plot", frag_trace, "--config", "expandable_segments:True", "--torch", "2.13",
             "--html", tmp_path / "view.html", "--json")
    assert pl.code == 0, pl.err
    series = pl.json()["series"]
    assert series[0]["config_rules"] == {"torch": "2.13", "chosen_by": "torch 2.13 given"}


def test_tune_reports_the_rules(cli, frag_trace) -> None:
    r = cli("tune", frag_trace, "--json", "--no-progress", "--budget", "6", "--torch", "2.13")
    assert r.code == 0, r.err
    t = r.json()["recommendation"]["torch"]
    assert t["profile"] == "cuda-2.13"
    assert t["config_rules"] == {"torch": "2.13", "chosen_by": "torch 2.13 given"}
    text = cli("tune", frag_trace, "--no-progress", "--budget", "6").out
    assert "configs read with torch 2.14's PYTORCH_ALLOC_CONF rules" in text


def test_library_scenario_rules(frag_trace) -> None:
    trace = load_trace(frag_trace)
    sc = make_scenario(trace, "max_split_size_mb:64", torch="2.13")
    assert (sc.profile.name, sc.rules, sc.settings.rules) == ("cuda-2.13", "2.13", "2.13")
    sc = make_scenario(trace, None)
    assert (sc.profile.name, sc.rules, sc.settings.rules) == ("cuda-2.14", "2.14", "2.14")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        make_scenario(trace, None, torch="latest")
