"""``compile_options=``: parsed at Graph construction, refused with the accepted keys."""

from __future__ import annotations

import pytest
import torch

import accel_graph
from accel_graph.errors import ConfigError
from accel_graph.foundation.compile_options import CompileOptions, parse_compile_options


def test_defaults_and_values() -> None:
    assert parse_compile_options(None) == CompileOptions(replay="auto", freeze=False)
    assert parse_compile_options({"replay": "interpreted", "freeze": True}) == CompileOptions("interpreted", True)
    opts = CompileOptions(replay="compiled")
    assert parse_compile_options(opts) is opts


@pytest.mark.parametrize(("value", "words"), [
    ({"replay": "fastest"}, "'auto', 'compiled', 'interpreted'"),
    ({"freeze": 1}, "True or False"),
    ({"frezee": True}, "unknown compile_options key(s) 'frezee'; accepted: cpp_wrapper, freeze, replay"),
    ({"cpp_wrapper": "on"}, "True or False"),
    (["replay"], "must be a dict"),
])
def test_bad_values_name_what_is_accepted(value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_compile_options(value)  # type: ignore[arg-type]


def test_graph_refuses_options_without_compile() -> None:
    with pytest.raises(ConfigError, match="compile='inductor'"):
        accel_graph.Graph(device="cpu", compile_options={"replay": "compiled"})


def test_graph_refuses_bad_options_before_capture() -> None:
    with pytest.raises(ConfigError, match="accepted"):
        accel_graph.Graph(device="cpu", compile="inductor", compile_options={"nope": 1})


def test_graph_with_options_still_replays() -> None:
    x = torch.ones(3)
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": "interpreted"})
    with g:
        y = x * 2
    x.fill_(4.0)
    g.replay()
    assert torch.equal(y, torch.full((3,), 8.0))
