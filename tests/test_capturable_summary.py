"""Issue 29 item 8: a report's count line calls baked values baked values.

Only ``level == "baked"`` findings are counted as such; ops a capture refuses keep their name,
and a report with both says both.
"""

from __future__ import annotations

import torch

from accel_graph import check_capturable


class Counter:
    """Mutable host state read as Python ints: what a graph would freeze."""

    def __init__(self) -> None:
        self.a, self.b = 5, 7


def test_only_baked_values_are_summed_up_as_baked_values() -> None:
    state = Counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = (x + state.a) * state.b  # two values a graph would bake
        state.a += 1
        state.b += 1
        return out

    rep = check_capturable(step, torch.zeros(3), steps=2)
    assert [f.level for f in rep.findings] == ["baked", "baked"]
    first = rep.format().splitlines()[0]
    assert first.startswith("2 baked value(s) (2 distinct)"), first
    assert "capture-illegal" not in first


def test_a_mixed_report_names_both_kinds() -> None:
    state = Counter()

    def step(x: torch.Tensor) -> torch.Tensor:
        out = x + state.a
        state.a += 1
        return out + x.sum().item()  # .item(): a host sync a capture refuses

    rep = check_capturable(step, torch.zeros(3), steps=2)
    levels = sorted(f.level for f in rep.findings)
    assert "baked" in levels and any(level != "baked" for level in levels), levels
    illegal = sum(level != "baked" for level in levels)
    baked = levels.count("baked")
    first = rep.format().splitlines()[0]
    assert first.startswith(
        f"{illegal} capture-illegal operation(s) and {baked} baked value(s)"
    ), first
