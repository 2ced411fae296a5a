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
SUPPORTED = ("2.13", "2.14")


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
    assert parse_config("max_split_size_mb:64", torch=(2, 9)).rules == "2.13"
    assert parse_config("max_split_size_mb:64", torch="2.16").rules == "2.14"


@pytest.mark.parametrize("bad", ["banana", "", "2", "3.0", "1.13", "two.fourteen"])
def test_unusable_torch_versions_say_what_to_pass(bad: str) -> None:
    with pytest.raises(ValueError, match=r"2\.14|2\.x") as info:
        parse_config("", torch=bad)
    assert repr(bad) in str(info.value) or bad in str(info.value)
