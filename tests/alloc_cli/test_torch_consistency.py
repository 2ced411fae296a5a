"""``--torch`` means the same in every ``accel-alloc`` command, and a ``--torch`` that cannot
be the trace's torch is said, never silently applied (issue 24's new-user review):

- the recorded config string of a trace holding a key the given torch refuses gets a note
  naming that key (text and JSON), in ``simulate`` and ``inspect``;
- a ``--config`` refused under ``--torch 2.11`` says that 2.11's rules refused it, and which
  torch accepts it;
- ``tune --torch 2.11`` on a trace that shows 2.13 warns (``torch-older-than-trace``, high),
  and says "torch 2.11", not "2.11-2.11";
- ``inspect`` takes ``--torch``/``--profile`` and reports the rules and profile it used.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import save_trace
from accel_graph.allocator.tune.versions import older_than_trace

#: A key torch 2.13 added (2.11.0 refuses it: tests/allocator/data/alloc_conf_torch-2.11.json).
NEW_KEY = "pinned_max_cached_size_mb"
CONFIG = f"expandable_segments:True,{NEW_KEY}:64"


@pytest.fixture(scope="module")
def serve_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The review's trace: ``generate -w serve --config CONFIG`` (records CONFIG verbatim)."""
    path = tmp_path_factory.mktemp("consistency") / "serve.json"
    save_trace(generate("serve", seed=0, steps=2, settings=CONFIG), path, format="json")
    return path


def _refusal(notes: list[str]) -> list[str]:
    return [n for n in notes if "would be refused by torch 2.11" in n]


def test_simulate_notes_a_recorded_key_the_given_torch_refuses(cli, serve_trace) -> None:
    r = cli("simulate", serve_trace, "--torch", "2.11", "--json")
    assert r.code == 0, r.err
    notes = r.json()["predicted"]["notes"]
    refused = _refusal(notes)
    assert len(refused) == 1 and NEW_KEY in refused[0]
    assert any(n.startswith("--torch 2.11 is older than the trace shows") for n in notes)
    text = cli("simulate", serve_trace, "--torch", "2.11").out
    assert f"note: the trace's recorded config {CONFIG!r} would be refused by torch 2.11" in text
    # the torch that records such a config parses it: no note
    ok = cli("simulate", serve_trace, "--torch", "2.13", "--json")
    assert ok.code == 0, ok.err
    assert not _refusal(ok.json()["predicted"]["notes"])
    assert not any("older than the trace" in n for n in ok.json()["predicted"]["notes"])


def test_config_refused_under_old_torch_names_the_rules(cli, serve_trace) -> None:
    r = cli("simulate", serve_trace, "--torch", "2.11", "--config", CONFIG)
    assert r.code == 3
    line = r.err.strip()
    assert len(line.splitlines()) == 1
    assert f"Unrecognized key '{NEW_KEY}'" in line
    assert "read with torch 2.11's PYTORCH_ALLOC_CONF rules, chosen by torch 2.11 given" in line
    assert "torch 2.12 and later accept it" in line
    # a value no torch accepts: the rules are named, no newer torch is offered
    bad = cli("simulate", serve_trace, "--config", "expandable_segments:Tru")
    assert bad.code == 3
    assert "read with torch 2.14's PYTORCH_ALLOC_CONF rules" in bad.err
    assert "accept it" not in bad.err


def test_tune_warns_when_torch_is_older_than_the_trace(cli, serve_trace) -> None:
    r = cli("tune", serve_trace, "--torch", "2.11", "--json", "--no-progress", "--budget", "6")
    assert r.code == 0, r.err
    doc = r.json()
    t = doc["recommendation"]["torch"]
    assert t["assumed"] == "2.11" and t["given"] == "2.11" and t["older_than_trace"] is True
    first = doc["warnings"][0]
    assert (first["code"], first["severity"]) == ("torch-older-than-trace", "high")
    assert "--torch 2.11 is older than the trace shows (torch 2.13 or later" in first["message"]
    text = cli("tune", serve_trace, "--torch", "2.11", "--no-progress", "--budget", "6").out
    assert "assumes torch 2.11 (profile cuda-2.11)" in text and "2.11-2.11" not in text
    assert "WARNING: --torch 2.11 is older than the trace shows" in text
    same = cli("tune", serve_trace, "--torch", "2.13", "--json", "--no-progress", "--budget", "6")
    assert same.code == 0, same.err
    assert same.json()["recommendation"]["torch"]["older_than_trace"] is False
    assert all(w["code"] != "torch-older-than-trace" for w in same.json()["warnings"])


def test_inspect_takes_torch_and_profile(cli, serve_trace) -> None:
    r = cli("inspect", serve_trace, "--torch", "2.11", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["profile"] == "cuda-2.11"
    assert doc["config_rules"] == {"torch": "2.11", "chosen_by": "torch 2.11 given"}
    assert len(_refusal(doc["notes"])) == 1
    d = cli("inspect", serve_trace, "--json").json()
    assert d["profile"] == "cuda-2.14" and d["config_rules"]["torch"] == "2.14"
    assert not _refusal(d["notes"])
    text = cli("inspect", serve_trace, "--torch", "2.13").out
    assert "rounding profile cuda-2.13" in text
    assert "config rules: torch 2.13's PYTORCH_ALLOC_CONF parser (chosen by torch 2.13 given" in text
    p = cli("inspect", serve_trace, "--profile", "cuda-2.9", "--json").json()
    assert p["profile"] == "cuda-2.9" and p["config_rules"]["torch"] == "2.11"
    assert cli("inspect", serve_trace, "--torch", "banana").code == 2
    unknown = cli("inspect", serve_trace, "--profile", "bogus")
    assert unknown.code == 5 and "cuda-2.14" in unknown.err


def test_older_than_trace_library() -> None:
    shows = {"at_least": "2.13", "evidence": ["because"], "exact": False}
    assert older_than_trace(None, shows) is None
    assert older_than_trace("2.13", shows) is None and older_than_trace("2.14.1+cu130", shows) is None
    said = older_than_trace("2.11.0+cu130", shows)
    assert said is not None and said.startswith("--torch 2.11 is older") and "because" in said
    assert older_than_trace("2.9", {"at_least": None, "evidence": []}) is None
