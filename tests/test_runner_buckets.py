"""Bucket ladders: vLLM's default, and suggest_buckets against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from accel_graph import ConfigError, suggest_buckets
from accel_graph.runner import default_ladder


def test_default_ladder_matches_vllm() -> None:
    ladder = default_ladder(512)
    assert ladder[:5] == [1, 2, 4, 8, 16]
    assert ladder[ladder.index(248) + 1] == 256  # steps of 8 up to 248, then 16
    assert ladder[-2:] == [496, 512]
    assert default_ladder(1) == [1]
    assert default_ladder(3) == [1, 2, 3]
    assert default_ladder(30) == [1, 2, 4, 8, 16, 24, 30]


def _waste(ladder, hist):
    return sum(c * (min(b for b in ladder if b >= s) - s) for s, c in hist.items())


@pytest.mark.parametrize("seed", range(8))
def test_suggest_buckets_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    hist = {s: rng.randint(1, 20) for s in rng.sample(range(1, 40), 7)}
    top = max(hist)
    for m in (1, 2, 3, 4):
        got = suggest_buckets(hist, max_graphs=m)
        assert top in got.buckets and len(got.buckets) <= m
        best = min(
            _waste([*c, top], hist)
            for c in itertools.combinations(sorted(hist)[:-1], m - 1)
        )
        total = sum(hist.values())
        assert got.expected_waste == pytest.approx(best / total)
        assert got.expected_waste == pytest.approx(_waste(got.buckets, hist) / total)


def test_suggest_buckets_samples_and_limits() -> None:
    ladder, waste = suggest_buckets([1, 1, 2, 3, 3, 3])
    assert ladder == [1, 2, 3] and waste == 0
    got = suggest_buckets([1, 2, 3, 4], memory_per_graph=100, memory_budget=250)
    assert len(got.buckets) == 2 and got.buckets[-1] == 4
    assert 0 < got.waste_fraction < 1


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([],), {}, "empty"),
        (([0, 1],), {}, "positive"),
        (({1: -1},), {}, ">= 0"),
        (([1, 2],), {"max_graphs": 0}, "max_graphs"),
        (([1, 2],), {"memory_per_graph": 10}, "together"),
        (([1, 2],), {"memory_per_graph": 10, "memory_budget": 5}, "holds no graph"),
    ],
)
def test_suggest_buckets_bad_input(args, kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        suggest_buckets(*args, **kwargs)
