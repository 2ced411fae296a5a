"""Allocator-config parity against frozen tables: one per supported torch version, each the
outcomes a real torch build gave on :func:`alloc_conf_parity.parity_corpus` (recorded by running
``python tests/allocator/alloc_conf_parity.py`` under that torch; checked in as data).

- Every table must be reproduced by our parser under that version's rules and build kind,
  whatever torch is installed: so the 2.13 rules stay checked on a 2.14 machine and back.
- The installed torch must still give the outcomes its own table recorded (drift in torch, or
  in how the outcomes are taken, fails here).
"""

from __future__ import annotations

import pytest
from alloc_conf_compare import mismatch
from alloc_conf_parity import (
    build_device,
    load_tables,
    outcome_record,
    parity_corpus,
    table_path,
    torch_minor,
    torch_outcome,
)

from accel_graph.allocator.alloc_conf import RULES, parse_config, rules_for

TABLES = {t["rules"]: t for t in load_tables()}
SUPPORTED = ("2.11", "2.13", "2.14")


def test_a_table_for_each_supported_version() -> None:
    assert set(SUPPORTED) <= set(TABLES), f"frozen tables present: {sorted(TABLES)}"
    corpus = parity_corpus()
    assert len(corpus) > 1000
    for version, table in TABLES.items():
        assert version in RULES, f"table {version} has no rules in alloc_conf.rules"
        assert table["torch"].startswith(version + "."), table["torch"]
        assert list(table["outcomes"]) == corpus, f"table {version} is not of parity_corpus()"
        assert rules_for(table["torch"]).name == version
        assert table["torch"].split("+")[0] in " ".join(RULES[version].measured_on)
        outcomes = list(table["outcomes"].values())
        # a table that accepts or rejects everything records nothing useful
        assert 50 < sum(o is None for o in outcomes) < len(outcomes) - 50
        # a driver error is the host's outcome, not the parser's: only where torch is known to
        # ask the driver while parsing (2.11: backend:cudaMallocAsync)
        driver = [t for t, o in table["outcomes"].items() if o and o[0] == "DriverError"]
        assert set(driver) <= {"backend:cudaMallocAsync"}, driver


@pytest.mark.parametrize("version", SUPPORTED)
def test_our_rules_reproduce_the_frozen_table(version: str) -> None:
    table = TABLES[version]
    problems = [p for text, theirs in table["outcomes"].items()
                if (p := mismatch(theirs, text, table["device"], version)) is not None]
    assert not problems, f"{len(problems)} disagreements with torch {table['torch']}:\n" + "\n".join(
        problems[:20])


def test_installed_torch_still_matches_its_frozen_table() -> None:
    import torch

    version = torch_minor()
    if version not in TABLES:
        pytest.skip(f"no frozen table for torch {torch.__version__}; record one with "
                    f"`python tests/allocator/alloc_conf_parity.py` (writes {table_path(version)})")
    table = TABLES[version]
    assert table["device"] == build_device(), (
        f"the {version} table was recorded on a {table['device']} build, this torch is a "
        f"{build_device()} build: record a table for this build or install the recorded one")
    drift = {}
    for text, recorded in table["outcomes"].items():
        live = outcome_record(torch_outcome(text))
        if live != recorded:
            drift[text] = (recorded, live)
    assert not drift, (f"torch {torch.__version__} no longer gives the outcomes recorded from "
                       f"{table['torch']} on {len(drift)} strings, e.g. {list(drift.items())[:5]}")


def test_213_and_214_parse_alike_as_measured() -> None:
    """The measured fact behind rules 2.14 = rules 2.13 (docs/allocator-config.md): on every
    corpus string both rule sets give the same settings or the same error, on every device."""
    for device in ("cpu", "cuda", "hip", "xpu"):
        for text in parity_corpus():
            out = []
            for version in ("2.13", "2.14"):
                try:
                    out.append(parse_config(text, device, version))
                except ValueError as e:
                    out.append(str(e))
            assert out[0] == out[1], (device, text, out)


def test_settings_name_the_rules_they_were_parsed_with() -> None:
    assert parse_config("max_split_size_mb:64").rules == "2.14"  # the default: newest
    assert parse_config("max_split_size_mb:64", torch="2.13.0+cpu").rules == "2.13"
    assert parse_config("max_split_size_mb:64", torch=(2, 9)).rules == "2.11"
    assert parse_config("max_split_size_mb:64", torch="2.11.0+cu130").rules == "2.11"
    assert parse_config("max_split_size_mb:64", torch="2.12").rules == "2.13"
    assert parse_config("max_split_size_mb:64", torch="2.16").rules == "2.14"


@pytest.mark.parametrize("bad", ["banana", "", "2", "3.0", "1.13", "two.fourteen"])
def test_unusable_torch_versions_say_what_to_pass(bad: str) -> None:
    with pytest.raises(ValueError, match=r"2\.14|2\.x") as info:
        parse_config("", torch=bad)
    assert repr(bad) in str(info.value) or bad in str(info.value)


# The keys torch 2.11.0+cu130 refuses as unknown and 2.13/2.14 accept (measured: its table).
NEWER_THAN_211 = ("pinned_max_round_threshold_mb:64", "pinned_max_cached_size_mb:-1",
                  "pinned_free_catch_all:True", "throw_on_cudamalloc_oom:True")
IN_211 = ("large_segment_size_mb:30", "per_process_memory_fraction:0.5",
          "pinned_reserve_segment_size_mb:16", "graph_capture_record_stream_reuse:True")


@pytest.mark.parametrize("text", NEWER_THAN_211)
def test_211_rules_refuse_what_211_refuses(text: str) -> None:
    key = text.split(":")[0]
    assert TABLES["2.11"]["outcomes"][text] == [
        "ValueError", f"Unrecognized key '{key}' in Accelerator allocator config."]
    with pytest.raises(ValueError, match=f"Unrecognized key '{key}'"):
        parse_config(text, "cuda", "2.11")
    assert parse_config(text, "cuda", "2.13").rules == "2.13"
    # the CPU build skips keys it does not know, so 2.11's CPU rules accept it unchecked
    assert parse_config(text, "cpu", "2.11").rules == "2.11"


@pytest.mark.parametrize("text", IN_211)
def test_211_rules_accept_what_211_accepts(text: str) -> None:
    assert TABLES["2.11"]["outcomes"][text] is None
    assert parse_config(text, "cuda", "2.11").rules == "2.11"


def test_211_differs_from_214_only_on_the_four_keys() -> None:
    """The measured difference, in the tables themselves: every string on which torch 2.11.0
    and 2.14.1 disagree names one of the four keys 2.11 lacks (ignoring the source paths in
    internal-assert messages, and the driver check 2.11 makes)."""
    def norm(o: list[str] | None) -> object:
        if o is None:
            return None
        return "assert" if "INTERNAL ASSERT" in o[1] else tuple(o)

    old, new = TABLES["2.11"]["outcomes"], TABLES["2.14"]["outcomes"]
    differ = [t for t in old if norm(old[t]) != norm(new[t]) and old[t] != ["DriverError", old[t][1]]]
    keys = [k.split(":")[0] for k in NEWER_THAN_211]
    assert differ and all(any(k in t for k in keys) for t in differ), [
        t for t in differ if not any(k in t for k in keys)][:5]
