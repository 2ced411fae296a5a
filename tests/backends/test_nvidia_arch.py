"""The NVIDIA architecture verdict: hand-checked cases, then an exhaustive grid of compute
capabilities x arch lists against an independent oracle built on torch 2.13's own
``torch.cuda.DEVICE_REQUIREMENT`` table (pure functions: no GPU involved or claimed)."""

from __future__ import annotations

import itertools

import pytest
import torch

from accel_graph import ConfigError
from accel_graph.backends.nvidia_arch import (
    BINARY_COMPATIBLE,
    KNOWN_DEVICES,
    NATIVE,
    PTX_JIT,
    UNKNOWN,
    UNSUPPORTED,
    ArchTarget,
    arch_verdict,
    parse_arch,
)


@pytest.mark.parametrize(
    ("cap", "archs", "kind", "target"),
    [
        ((9, 0), ["sm_80", "sm_90", "compute_90"], NATIVE, "sm_90"),
        ((9, 0), ["sm_90a"], NATIVE, "sm_90a"),
        ((9, 0), ["sm_80"], UNSUPPORTED, None),  # cubins never cross majors
        ((8, 6), ["sm_80", "sm_75"], BINARY_COMPATIBLE, "sm_80"),
        ((8, 9), ["sm_80", "sm_86"], BINARY_COMPATIBLE, "sm_86"),
        ((10, 0), ["sm_100f"], NATIVE, "sm_100f"),
        ((10, 3), ["sm_100f"], BINARY_COMPATIBLE, "sm_100f"),  # family: same major, minor >=
        ((10, 3), ["sm_100a"], UNSUPPORTED, None),  # arch-specific: exactly 10.0
        ((10, 3), ["sm_100", "sm_100a"], BINARY_COMPATIBLE, "sm_100"),
        ((11, 0), ["sm_100f", "compute_100f"], UNSUPPORTED, None),  # another family
        ((12, 0), ["sm_100f", "compute_100f"], UNSUPPORTED, None),
        ((12, 1), ["sm_120", "compute_120"], BINARY_COMPATIBLE, "sm_120"),
        ((12, 0), ["sm_80", "sm_90", "compute_90"], PTX_JIT, "compute_90"),
        ((9, 0), ["compute_90a"], PTX_JIT, "compute_90a"),
        ((10, 0), ["compute_90a"], UNSUPPORTED, None),
        ((8, 7), ["sm_80", "sm_86"], UNSUPPORTED, None),  # Orin is not an A100
        ((8, 7), ["sm_80", "compute_80"], PTX_JIT, "compute_80"),
        ((7, 2), ["sm_70"], UNSUPPORTED, None),
        ((11, 0), ["sm_101"], BINARY_COMPATIBLE, "sm_101"),  # Thor, renamed in CUDA 13
        ((10, 1), ["sm_100"], UNSUPPORTED, None),
        ((7, 5), ["sm_80", "sm_90"], UNSUPPORTED, None),
        ((7, 5), [], UNKNOWN, None),
        ((9, 0), ["gfx942", "gfx90a"], UNKNOWN, None),
    ],
)
def test_verdict_cases(cap: tuple[int, int], archs: list[str], kind: str, target: str | None) -> None:
    v = arch_verdict(cap, archs)
    assert (v.kind, v.target) == (kind, target), v.explanation
    assert v.device == f"sm_{cap[0]}{cap[1]}"
    assert f"{cap[0]}.{cap[1]}" in v.explanation
    assert v.runs == (kind != UNSUPPORTED)


def test_sm107_is_in_the_tables_and_marked_assumed() -> None:
    assert "PyTorch 2.14 release notes" in KNOWN_DEVICES[107]
    native = arch_verdict((10, 7), ["sm_100", "sm_107"])
    assert (native.kind, native.target, native.assumed) == (NATIVE, "sm_107", True)
    compat = arch_verdict((10, 7), ["sm_90", "sm_100", "sm_120"])
    assert (compat.kind, compat.target, compat.assumed) == (BINARY_COMPATIBLE, "sm_100", True)
    assert "unverified on hardware" in compat.explanation
    assert arch_verdict((10, 3), ["sm_107"]).kind == UNSUPPORTED
    assert arch_verdict((10, 3), ["sm_103"]).assumed is False


def test_unsupported_explanation_says_what_to_do() -> None:
    v = arch_verdict((12, 0), ["sm_80", "sm_90"])
    assert "sm_80 sm_90" in v.explanation and "install a torch build compiled for sm_120" in v.explanation
    a = arch_verdict((10, 3), ["sm_100a"])
    assert "arch-specific 'a' targets" in a.explanation


@pytest.mark.parametrize("bad", [(9, 10), (0, 0), (-1, 0), ("9", 0), (9.0, 0)])
def test_bad_capability(bad: tuple) -> None:
    with pytest.raises(ConfigError, match="compute capability"):
        arch_verdict(bad, ["sm_90"])


def test_parse_arch() -> None:
    assert parse_arch("sm_100f") == ArchTarget("sm", 100, "f")
    assert parse_arch(" SM_90A ") == ArchTarget("sm", 90, "a")
    assert parse_arch("compute_90") == ArchTarget("compute", 90, "")
    assert str(parse_arch("compute_120a")) == "compute_120a"
    for junk in ("gfx942", "sm_", "sm_90x", "compute", "", "lto_90"):
        assert parse_arch(junk) is None


# -- exhaustive grid against an oracle from torch's own table --------------------------------
REQUIREMENT = getattr(torch.cuda, "DEVICE_REQUIREMENT", None)

CAPS = sorted(
    {(cc // 10, cc % 10) for cc in KNOWN_DEVICES}
    | {(3, 5), (6, 1), (8, 8), (9, 9), (10, 9), (11, 1), (12, 2), (13, 0), (15, 5)}
)
POOL = (
    "sm_50", "sm_53", "sm_70", "sm_80", "sm_87", "sm_90", "sm_90a", "sm_100", "sm_100a",
    "sm_100f", "sm_101", "sm_103f", "sm_107", "sm_120", "compute_80", "compute_90a",
    "compute_100f", "compute_120", "gfx942",
)
ARCH_LISTS = [list(c) for k in range(4) for c in itertools.combinations(POOL, k)]


def oracle_runs(entry: str, device_cc: int) -> bool:
    """Runs-on per the rules stated in nvidia_arch's docstring, with torch's table for cubins."""
    t = parse_arch(entry)
    assert t is not None
    if t.suffix == "a":
        return device_cc == t.cc
    if t.kind == "compute" and not t.suffix:
        return device_cc >= t.cc
    req = REQUIREMENT.get(t.cc) if REQUIREMENT is not None else None
    if req is None:  # torch's own fallback for codes missing from its table (sm_107 in 2.13)
        return device_cc // 10 == t.cc // 10 and device_cc >= t.cc
    return device_cc in req


def oracle_kind(cap: tuple[int, int], archs: list[str]) -> str:
    cc = 10 * cap[0] + cap[1]
    nv = [a for a in archs if a.startswith(("sm_", "compute_"))]
    if not nv:
        return UNKNOWN
    runs = [a for a in nv if oracle_runs(a, cc)]
    if any(a.startswith("sm_") and parse_arch(a).cc == cc for a in runs):  # type: ignore[union-attr]
        return NATIVE
    if any(a.startswith("sm_") for a in runs):
        return BINARY_COMPATIBLE
    if runs:
        return PTX_JIT
    return UNSUPPORTED


@pytest.mark.skipif(REQUIREMENT is None, reason="this torch has no torch.cuda.DEVICE_REQUIREMENT")
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"cc{c[0]}.{c[1]}")
def test_exhaustive_grid_matches_oracle(cap: tuple[int, int]) -> None:
    cc = 10 * cap[0] + cap[1]
    for archs in ARCH_LISTS:
        v = arch_verdict(cap, archs)
        assert v.kind == oracle_kind(cap, archs), (cap, archs, v)
        if v.target is None:
            assert v.kind in (UNSUPPORTED, UNKNOWN)
            continue
        assert v.target in archs and oracle_runs(v.target, cc)
        if v.kind == NATIVE:
            assert v.target.startswith("sm_") and parse_arch(v.target).cc == cc  # type: ignore[union-attr]
        elif v.kind == PTX_JIT:
            assert v.target.startswith("compute_")
        assert v.assumed == (cc == 107 or parse_arch(v.target).cc == 107)  # type: ignore[union-attr]


def test_grid_is_large() -> None:
    assert len(CAPS) * len(ARCH_LISTS) > 20_000
