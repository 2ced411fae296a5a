"""Allocator profiles: where PyTorch's caching allocator differs by version and by device, as data.

A :class:`Profile` names one behaviour set: which torch versions and which device it covers, the
engine policy that simulates it (``"native"`` or ``"xpu"``), how requests are rounded (a rounding
rule id: :func:`round_request` in Python, ``EngineSettings.round_extra`` / the ``xpu`` policy in
the engine; a test keeps the two equal), which ``PYTORCH_*_ALLOC_CONF`` keys that build honours,
and behaviour flags. ``replayer.apply_profile`` turns a profile into engine settings; where the C
engine has no flag for a field, the profile's ``notes`` say so.

This module is what the package imports: the rounding rules (:func:`round_request`) and the
lookups (:func:`resolve_profile`, :func:`profile_for`, :func:`get_profile`). The rows themselves,
and the :class:`Profile` record, are data in :mod:`.profile_catalog` (re-exported here).

Sources: shared/reference/allocator-semantics.md sections 3.1 (NPU rounding), 4.2-4.4 (version
sensitivity, pytorch#193400, #161139, PR #160666) and torch-internals.md section 4 (constants,
rounding, expandable segments, XPU policy, 2.13 keys). See docs/trace-generator.md "Profiles".

The NPU rounding rule was checked on the Ascend snapshots in ``shared/traces/npu/`` (every split
live block has ``size == ceil((requested + 32) / 512) * 512``; unsplit large-pool blocks are
bigger by the un-split remainder); tests/allocator/test_profiles.py re-checks it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..devices import (
    DEVICE_KINDS,
    DeviceKind,
    find_device_kind,
    rounding_rule,
    rounding_rule_or_default,
)
from ..devices import ROUNDING_RULES as _RULES
from .profile_catalog import PROFILES, Profile

__all__ = [
    "PROFILES",
    "ROUNDING_RULES",
    "Profile",
    "get_profile",
    "profile_for",
    "resolve_profile",
    "round_request",
    "round_requests",
]

KMIN = 512

#: Rounding rule ids (:data:`accel_graph.allocator.devices.ROUNDING_RULES`): ``cuda`` (512-byte
#: multiples, minimum 512, plus roundup_power2_divisions), ``npu`` (request + 32 bytes, then as
#: cuda), ``xpu`` (512-byte multiples only).
ROUNDING_RULES: tuple[str, ...] = tuple(_RULES)


def _round_cuda(size: int, divisions: int = 0) -> int:
    if size < KMIN:
        return KMIN
    if divisions > 1 and size > KMIN * divisions:
        if size & (size - 1) == 0:
            return size
        p = 1 << (size.bit_length() - 1)
        step = p >> (divisions.bit_length() - 1)
        if step == 0:
            return 2 * p
        floor = size & ~(step - 1)
        return size if floor == size else floor + step
    return -(-size // KMIN) * KMIN


def round_request(size: int, profile: Profile | str, divisions: int = 0) -> int:
    """The block size ``profile``'s allocator gives a request of ``size`` bytes (before any
    unsplit remainder). ``divisions`` is the roundup_power2_divisions value for the size's
    interval (CUDA/ROCm only; ignored where the profile does not apply it).

    NPU: ``ceil((size + 32) / 512) * 512`` -- a 16 KiB request becomes 16.5 KiB and a 1 MiB
    request becomes 1 MiB + 512, which therefore goes to the large pool. With ``divisions`` the
    32 bytes are added first and the CUDA rule applies to ``size + 32``. The engine does the same
    with ``EngineSettings(round_extra=32)`` (tests/allocator/test_profiles.py checks they agree).
    """
    p = resolve_profile(profile)
    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    rule = rounding_rule_or_default(p.rounding)
    size += rule.extra
    if not rule.power2_divisions or not p.roundup_applied:
        return max(KMIN, -(-size // KMIN) * KMIN)
    return _round_cuda(size, divisions)


def round_requests(sizes: Any, profile: Profile | str, divisions: int = 0) -> np.ndarray:
    """:func:`round_request` over an array of sizes (int64 out), vectorised except for CUDA
    with ``divisions`` > 1, which loops."""
    p = resolve_profile(profile)
    s = np.asarray(sizes, dtype=np.int64)
    if s.size and int(s.min()) <= 0:
        raise ValueError("sizes must be > 0")
    rule = rounding_rule_or_default(p.rounding)
    if rule.extra:
        s = s + rule.extra
    if not rule.power2_divisions or not p.roundup_applied or divisions <= 1:
        return np.maximum(KMIN, ((s + KMIN - 1) // KMIN) * KMIN)
    return np.array([_round_cuda(int(x), divisions) for x in s.ravel()], np.int64).reshape(s.shape)


#: bytes torch_npu adds to a request before rounding (``EngineSettings.round_extra``).
NPU_ROUND_EXTRA = rounding_rule("npu").extra


def _kinds_in_profile_order() -> tuple[DeviceKind, ...]:
    """The device kinds in the order their first profile is defined in the catalogue (how
    messages have always listed them: cuda, rocm, npu, xpu)."""
    first = {p.device: i for i, p in reversed(list(enumerate(PROFILES.values())))}
    return tuple(sorted(DEVICE_KINDS, key=lambda k: first[k.name]))


#: Every device name and alias :func:`resolve_profile` accepts, for its message.
_DEVICE_NAMES = tuple(n for k in _kinds_in_profile_order() for n in k.names)


#: The version that picks a device's newest profile (see resolve_profile).
NEWEST = (2, 99)


def resolve_profile(profile: Profile | str | None, device_type: str | None = None) -> Profile:
    """A :class:`Profile` from a profile, a profile name (``"cuda-2.9"``, ``"rocm-6"``), or a
    device name (``"cuda"``, ``"rocm"``/``"hip"``, ``"npu"``, ``"xpu"``: that device's newest
    profile). ``None`` takes the device from ``device_type`` (default ``"cuda"``).
    Raises KeyError naming the known profiles and devices."""
    if isinstance(profile, Profile):
        return profile
    name = profile if profile is not None else (device_type or "cuda")
    if name in PROFILES:
        return PROFILES[name]
    kind = find_device_kind(str(name))
    if kind is None:
        raise KeyError(f"unknown profile or device {name!r}; profiles: "
                       f"{', '.join(sorted(PROFILES))}; devices: {', '.join(_DEVICE_NAMES)}")
    return profile_for(NEWEST, kind.name)


def get_profile(name: str) -> Profile:
    """The profile called ``name``; KeyError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def _parse_version(v: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(v, tuple):
        return (int(v[0]), int(v[1]))
    core = v.split("+")[0].split(".")
    try:
        return (int(core[0]), int("".join(ch for ch in core[1] if ch.isdigit()) or 0))
    except (IndexError, ValueError):
        raise ValueError(f"cannot read torch version {v!r}") from None


def profile_for(torch_version: str | tuple[int, int], device: str = "cuda") -> Profile:
    """The profile for a torch version (``"2.12.1+cu128"`` or ``(2, 12)``) on ``device``
    (cuda, rocm/hip, npu, xpu). Raises ValueError when none covers it."""
    kind = find_device_kind(device.lower())
    if kind is None:
        raise ValueError(f"unknown device {device!r}; expected one of {sorted(_DEVICE_NAMES)}")
    version = _parse_version(torch_version)
    for name in kind.profiles:  # newest first
        p = PROFILES[name]
        if p.covers(version):
            return p
    raise ValueError(f"no profile for torch {torch_version} on {device}")
