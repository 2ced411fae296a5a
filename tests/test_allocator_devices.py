"""The allocator's one device table (accel_graph/allocator/devices.py) and its readers.

Checks that every row is complete (its profiles exist and agree with it, its config dialect
parses, its aliases resolve everywhere a device name is accepted), and that no other module of
the allocator or of ``accel-alloc`` keeps its own map from device names (an AST scan, which a
self-test shows can fail).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from accel_graph.allocator import devices
from accel_graph.allocator.alloc_conf import CONFIG_VARIABLES as READ_ORDER
from accel_graph.allocator.alloc_conf import parse_config
from accel_graph.allocator.core.settings import POLICIES
from accel_graph.allocator.devices import (
    CONFIG_DIALECTS,
    DEVICE_KINDS,
    DEVICE_TYPES,
    ROUNDING_RULES,
    canonical_kind,
    config_dialect,
    config_dialect_of,
    device_kind,
    device_kind_or_default,
    find_device_kind,
    runtime_device_kind,
)
from accel_graph.allocator.sim.profiles import (
    NEWEST,
    PROFILES,
    profile_for,
    resolve_profile,
    round_request,
)
from accel_graph.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1] / "accel_graph"
SCANNED = (ROOT / "allocator", ROOT / "cli" / "alloc")
#: Every spelling of a device family the allocator knows, canonical names and aliases.
DEVICE_WORDS = frozenset(n for k in DEVICE_KINDS for n in k.names)
#: Modules allowed to spell a device-name map, with the reason. devices.py is the table itself.
ALLOWED: dict[str, str] = {
    "allocator/devices.py": "the device table",
}


@pytest.mark.parametrize("kind", DEVICE_KINDS, ids=lambda k: k.name)
def test_each_kind_has_its_profiles(kind: devices.DeviceKind) -> None:
    assert kind.profiles, f"{kind.name} names no profiles"
    for name in kind.profiles:
        p = PROFILES[name]  # KeyError: the row names a profile sim/profiles.py lacks
        assert p.device == kind.name
        assert p.policy == kind.engine_policy
        assert p.rounding == kind.rounding
        assert p.expandable_large_align == kind.expandable_large_align
    assert PROFILES[kind.newest_profile].covers(NEWEST)
    assert resolve_profile(kind.name) is PROFILES[kind.newest_profile]
    # every profile of the device that profile_for may pick is listed, newest first
    assert profile_for(NEWEST, kind.name) is PROFILES[kind.newest_profile]


def test_every_profile_device_is_a_kind() -> None:
    assert {p.device for p in PROFILES.values()} == set(DEVICE_TYPES)
    assert DEVICE_TYPES == tuple(k.name for k in DEVICE_KINDS)
    assert len(set(DEVICE_WORDS)) == sum(len(k.names) for k in DEVICE_KINDS), "a name is reused"


@pytest.mark.parametrize("name", sorted(DEVICE_WORDS))
def test_every_name_and_alias_resolves(name: str) -> None:
    kind = device_kind(name)
    assert find_device_kind(name.upper()) is kind
    assert name in kind.names
    assert resolve_profile(name) is PROFILES[kind.newest_profile]
    assert resolve_profile(name.upper()) is PROFILES[kind.newest_profile]
    assert profile_for("2.13", name) is profile_for("2.13", kind.name)


def test_rocm_answers_to_hip_in_config_and_rocm_in_traces() -> None:
    rocm = device_kind("hip")
    assert rocm.name == "rocm" and rocm.config == "hip"
    assert canonical_kind("hip") is None  # traces spell it "rocm" only
    assert config_dialect_of("rocm") == "hip"
    assert config_dialect_of("npu") == "cuda"  # torch_npu parses like a CUDA build
    assert config_dialect_of(None) == config_dialect_of("nonsense") == "cuda"
    assert device_kind_or_default(None) is devices.DEFAULT_DEVICE_KIND


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"accepted: cuda, rocm \(hip\), xpu, npu"):
        device_kind("tpu")
    assert find_device_kind("tpu") is None and find_device_kind(None) is None
    with pytest.raises(KeyError, match="devices: cuda, rocm, hip, npu, xpu"):
        resolve_profile("tpu")
    with pytest.raises(ValueError, match=r"expected one of \['cuda', 'hip', 'npu', 'rocm', "):
        profile_for("2.13", "tpu")
    with pytest.raises(ConfigError, match="device must be one of cuda, hip, xpu, cpu"):
        parse_config("", "rocm")


@pytest.mark.parametrize("kind", DEVICE_KINDS, ids=lambda k: k.name)
def test_each_kind_config_parses(kind: devices.DeviceKind) -> None:
    dialect = config_dialect(kind.config)
    s = parse_config("expandable_segments:True,max_split_size_mb:64", kind.config)
    assert s.device == kind.config and s.expandable_segments
    if dialect.backends:
        assert parse_config(f"backend:{dialect.backends[-1]}", kind.config).backend \
            == dialect.backends[-1]


@pytest.mark.parametrize("dialect", list(CONFIG_DIALECTS.values()), ids=lambda d: d.name)
def test_each_dialect(dialect: devices.ConfigDialect) -> None:
    assert parse_config("", dialect.name).device == dialect.name
    if dialect.refuses_unknown_keys:
        with pytest.raises(ConfigError):
            parse_config("no_such_key:1", dialect.name)
    else:
        parse_config("no_such_key:1", dialect.name)
    if dialect.cuda_hook:
        with pytest.raises(ConfigError, match="Unknown allocator backend, options are native"):
            parse_config("backend:nope", dialect.name)


def test_rounding_rules_and_runtimes() -> None:
    for kind in DEVICE_KINDS:
        rule = ROUNDING_RULES[kind.rounding]
        p = PROFILES[kind.newest_profile]
        assert round_request(1000, p) == max(512, -(-(1000 + rule.extra) // 512) * 512)
    assert devices.RUNTIME_KINDS == ("cuda", "hip")
    codes = [k.runtime_code for k in DEVICE_KINDS if k.runtime_library]
    assert codes == list(range(len(codes)))  # _core.h: 0 = CUDA runtime, 1 = HIP
    assert runtime_device_kind("hip").display == "HIP"
    assert runtime_device_kind("cuda").runtime_library == "libcudart.so"
    for kind in DEVICE_KINDS:
        assert kind.engine_policy in POLICIES
        assert kind.config_variable in devices.CONFIG_VARIABLES
    assert READ_ORDER == ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
                          "PYTORCH_ALLOC_CONF")


def test_a_hand_made_profile_with_an_unknown_rule_rounds_as_cuda() -> None:
    odd = dataclasses.replace(PROFILES["cuda-2.13"], name="odd", rounding="odd")
    assert devices.rounding_rule_or_default("odd") is ROUNDING_RULES["cuda"]
    for size in (1, 1000, 3 << 20):
        assert round_request(size, odd, 4) == round_request(size, "cuda-2.13", 4)
    with pytest.raises(ConfigError, match="unknown rounding rule 'odd'"):
        devices.rounding_rule("odd")


# -- no other module keeps a device-name map


def _literal_words(node: ast.AST) -> list[str]:
    """The device words among a literal's string constants."""
    return [e.value for e in ast.iter_child_nodes(node)
            if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in DEVICE_WORDS]


def device_maps(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every literal in ``source`` that maps or lists device names: a dict
    with two or more device-word keys, or a tuple/list/set of two or more device words. A
    single comparison (``rounding == "npu"``) or a policy table with one device-like key
    (``"xpu"`` among the engine policies) is not a device map."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            words = [k.value for k in node.keys if isinstance(k, ast.Constant)
                     and isinstance(k.value, str) and k.value in DEVICE_WORDS]
            if len(words) >= 2:
                found.append((node.lineno, f"dict keyed by {words}"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            words = _literal_words(node)
            if len(words) >= 2:
                found.append((node.lineno, f"{type(node).__name__.lower()} of {words}"))
    return found


def test_the_scan_finds_device_maps() -> None:
    bad = (
        'ENV = {"cuda": "A", "npu": "B"}\n'
        'if dev in ("cuda", "hip"):\n    pass\n'
        'choices = ["cuda", "rocm", "xpu"]\n'
        'x = {"hip", "xpu"}\n'
    )
    assert sorted(line for line, _ in device_maps(bad)) == [1, 2, 4, 5]
    fine = (
        'if p.rounding == "npu":\n    pass\n'
        'POLICIES = ("native", "xpu", "bfc")\n'
        'KEYS = {"native": 1, "xpu": 2}\n'
        '"""docs name cuda, rocm, xpu and npu"""\n'
    )
    assert device_maps(fine) == []


def test_only_the_device_table_maps_device_names() -> None:
    offenders = []
    for top in SCANNED:
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            offenders += [f"{rel}:{line}: {what}"
                          for line, what in device_maps(path.read_text(encoding="utf-8"))]
    assert not offenders, (
        "device names mapped outside accel_graph/allocator/devices.py (read DEVICE_KINDS "
        "instead):\n" + "\n".join(offenders))


def test_allowlist_is_current() -> None:
    for rel in ALLOWED:
        assert (ROOT / rel).is_file(), f"ALLOWED names a missing module {rel}"
    assert re.search(r"^DEVICE_KINDS\b", (ROOT / "allocator/devices.py").read_text(), re.M)
