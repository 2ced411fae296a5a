"""ROCm parsing and the HIP-graph quirk table (pure functions: no GPU involved or claimed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accel_graph import ConfigError
from accel_graph.backends.rocm import (
    HIP_QUIRKS,
    GfxArch,
    parse_gfx_arch,
    parse_hip_version,
    quirks_for,
)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("7.14.12345-abcdef", (7, 14, 12345)),
        ("6.4.43482", (6, 4, 43482)),
        ("7.0.0", (7, 0, 0)),
        ("6.2.41133-dd7f95766", (6, 2, 41133)),
        ("7.1", (7, 1, 0)),
        (" 7.2.53211 ", (7, 2, 53211)),
    ],
)
def test_parse_hip_version(text: str, version: tuple[int, int, int]) -> None:
    assert parse_hip_version(text) == version


@pytest.mark.parametrize("bad", ["", "7", "rocm-7.0", "7.x.1", "7.0.0.0.0 junk", None, 7.0])
def test_parse_hip_version_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="HIP version|torch.version.hip"):
        parse_hip_version(bad)  # type: ignore[arg-type]


@given(
    st.integers(0, 99), st.integers(0, 99), st.integers(0, 10**6),
    st.one_of(st.just(""), st.from_regex(r"-[0-9a-f]{6,12}", fullmatch=True)),
)
def test_parse_hip_version_roundtrip(major: int, minor: int, build: int, suffix: str) -> None:
    assert parse_hip_version(f"{major}.{minor}.{build}{suffix}") == (major, minor, build)


def test_versions_order_as_tuples() -> None:
    assert parse_hip_version("6.4.43482") < parse_hip_version("7.0.0") < parse_hip_version("7.14.1-ab")


@pytest.mark.parametrize(
    ("text", "name", "features"),
    [
        ("gfx942:sramecc+:xnack-", "gfx942", (("sramecc", True), ("xnack", False))),
        ("gfx90a", "gfx90a", ()),
        ("gfx1100", "gfx1100", ()),
        ("GFX950:xnack+", "gfx950", (("xnack", True),)),
        ("gfx1201:xnack", "gfx1201", ()),  # a feature without a sign is unspecified
    ],
)
def test_parse_gfx_arch(text: str, name: str, features: tuple) -> None:
    arch = parse_gfx_arch(text)
    assert arch == GfxArch(name, features) and str(arch) == name


def test_gfx_feature_lookup() -> None:
    arch = parse_gfx_arch("gfx942:sramecc+:xnack-")
    assert arch.feature("sramecc") is True and arch.feature("xnack") is False
    assert arch.feature("tgsplit") is None


@pytest.mark.parametrize("bad", ["", "sm_90", "gfx", "gfx9z2", "gfx942::xnack-", None])
def test_parse_gfx_arch_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_gfx_arch(bad)  # type: ignore[arg-type]


def test_quirk_table_is_well_formed() -> None:
    ids = [q.id for q in HIP_QUIRKS]
    assert len(ids) == len(set(ids))
    for q in HIP_QUIRKS:
        assert q.what and q.mitigation and q.references
        if q.min_version and q.max_version:
            assert q.min_version < q.max_version
    required = {"warmup-same-stream", "no-conditional-nodes", "expandable-segments-rocm7",
                "lazy-graph-exec-destroy"}
    assert required <= set(ids)


def ids(version: object, arch: object = None) -> set[str]:
    return {q.id for q in quirks_for(version, arch)}  # type: ignore[arg-type]


def test_quirks_by_version() -> None:
    assert "expandable-segments-rocm7" in ids("6.4.43482")
    assert "expandable-segments-rocm7" not in ids("7.0.0")
    assert "lazy-graph-exec-destroy" not in ids("6.1.40091")
    assert "lazy-graph-exec-destroy" in ids("6.2.0")
    assert "captured-event-rocm-7.2.0" in ids("7.2.0")
    assert "captured-event-rocm-7.2.0" not in ids("7.3.0") | ids("7.1.9")
    always = {"warmup-same-stream", "no-conditional-nodes"}
    for v in ("5.7.1", "6.4.43482", "7.14.12345-abcdef"):
        assert always <= ids(v)


def test_quirks_by_arch() -> None:
    assert "replay-corruption-mi300x" in ids("7.0.0", "gfx942:sramecc+:xnack-")
    assert "replay-corruption-mi300x" not in ids("7.0.0", "gfx90a")
    assert "stale-external-write-gfx950" in ids((7, 0, 0), GfxArch("gfx950"))
    assert "stale-external-write-gfx950" not in ids((7, 0, 0), "gfx942")


def test_unknown_version_and_arch_are_conservative() -> None:
    assert ids(None, None) == {q.id for q in HIP_QUIRKS}


def test_applies_when_text() -> None:
    by_id = {q.id: q for q in HIP_QUIRKS}
    assert by_id["expandable-segments-rocm7"].applies_when() == "ROCm < 7.0"
    assert by_id["lazy-graph-exec-destroy"].applies_when() == "ROCm >= 6.2"
    assert by_id["replay-corruption-mi300x"].applies_when() == "arch in gfx942"
    assert by_id["warmup-same-stream"].applies_when() == "all ROCm versions and archs"
