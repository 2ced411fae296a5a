"""Does this torch build carry code for this NVIDIA GPU? A pure function and its tables.

:func:`arch_verdict` takes a device's compute capability ``(major, minor)`` and the build's
architecture list (``torch.cuda.get_arch_list()``: ``['sm_80', 'sm_90a', 'sm_100f',
'compute_90', ...]``) and says how the build's kernels reach the device, best first:

``native``
    a cubin built for exactly this capability (``sm_XY``, ``sm_XYa`` or ``sm_XYf``).
``binary_compatible``
    a cubin of the same major and a lower minor (``sm_80`` on 8.6), including family cubins
    (``sm_100f`` on 10.3). Runs at full speed, without the newer minor's features.
``ptx_jit``
    only PTX (``compute_XY``) at or below the device: the driver JIT-compiles every kernel on
    first launch (slow first launch, minutes for a full torch build; cached afterwards).
``unsupported``
    nothing in the build runs on the device.
``unknown``
    the build lists no architectures at all (CPU build, or a build that does not report them).

Compatibility rules (NVIDIA's, as summarised in the CUDA programming guide's "binary
compatibility" notes and the CUDA 12.9 "family-specific features" announcement; the per-target
exceptions mirror torch 2.13's own ``torch.cuda.DEVICE_REQUIREMENT`` table):

* ``sm_XY`` cubin: devices ``X.Z`` with ``Z >= Y`` (same major), except integrated GPUs that
  are binary-incompatible with their dGPU siblings (5.3, 6.2, 7.2, 8.7 and Thor's 10.1).
* ``sm_XYa`` (architecture-specific, e.g. ``sm_90a``): exactly ``X.Y``, nothing else.
* ``sm_XYf`` (family-specific, CUDA 12.9+, e.g. ``sm_100f``): the same family, i.e. the same
  major with ``minor >= Y`` (``sm_100f`` runs on 10.0 and 10.3, not on 11.x or 12.x).
* ``compute_XY`` PTX: any device with capability ``>= X.Y`` (across majors), via JIT.
  ``compute_XYa`` only on exactly ``X.Y``; ``compute_XYf`` on the ``sm_XYf`` family.

sm_107 is in the tables as taken from the PyTorch 2.14 release notes; the same-major rule is
*assumed* for it (an ``sm_100`` cubin running on 10.7, ``sm_107`` running on 10.7 only) and has
not been verified on hardware. Verdicts that depend on it carry ``assumed=True``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = [
    "BINARY_COMPATIBLE",
    "KNOWN_DEVICES",
    "NATIVE",
    "PTX_JIT",
    "UNKNOWN",
    "UNSUPPORTED",
    "ArchTarget",
    "ArchVerdict",
    "arch_verdict",
    "parse_arch",
]

NATIVE = "native"
BINARY_COMPATIBLE = "binary_compatible"
PTX_JIT = "ptx_jit"
UNSUPPORTED = "unsupported"
UNKNOWN = "unknown"

#: Compute capability (as ``10 * major + minor``) -> what ships with it. For messages only.
KNOWN_DEVICES: dict[int, str] = {
    50: "Maxwell", 52: "Maxwell (GTX 900)", 53: "Jetson TX1/Nano (integrated)",
    60: "Pascal P100", 61: "Pascal (GTX 10, P4/P40)", 62: "Jetson TX2 (integrated)",
    70: "Volta V100", 72: "Jetson Xavier (integrated)", 75: "Turing (T4, RTX 20)",
    80: "Ampere A100/A30", 86: "Ampere (A10, A40, RTX 30)", 87: "Jetson Orin (integrated)",
    89: "Ada (L4, L40, RTX 40)", 90: "Hopper (H100, H200, GH200)",
    100: "Blackwell (B200, GB200)", 101: "Jetson Thor before CUDA 13 (now 11.0)",
    103: "Blackwell Ultra (B300, GB300)",
    107: "sm_107 (from the PyTorch 2.14 release notes; unverified on hardware)",
    110: "Jetson Thor", 120: "Blackwell (RTX 50, RTX PRO 6000)", 121: "GB10 (DGX Spark)",
}

#: Capabilities whose entries are assumed rather than documented by NVIDIA.
ASSUMED: frozenset[int] = frozenset({107})

# Which device capabilities a plain cubin runs on, where the same-major rule has exceptions.
# Keys are code capabilities; values are (excluded devices, extra devices). Mirrors torch 2.13's
# torch/cuda/__init__.py DEVICE_REQUIREMENT: integrated GPUs (5.3, 6.2, 7.2, 8.7, 10.1) do not
# run their dGPU siblings' cubins, and their own cubins run only on themselves (Thor's sm_101
# also on 11.0, its CUDA 13 name).
_EXCLUDED: dict[int, frozenset[int]] = {
    50: frozenset({53}), 52: frozenset({53}), 60: frozenset({62}), 61: frozenset({62}),
    70: frozenset({72}), 80: frozenset({87}), 86: frozenset({87}), 100: frozenset({101}),
}
_ONLY: dict[int, frozenset[int]] = {
    53: frozenset({53}), 62: frozenset({62}), 72: frozenset({72}), 87: frozenset({87}),
    101: frozenset({101, 110}),
}

_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


@dataclass(frozen=True)
class ArchTarget:
    """One entry of a build's arch list: ``sm_90a`` is ``ArchTarget("sm", 90, "a")``."""

    kind: str  # "sm" (cubin) or "compute" (PTX)
    cc: int  # 10 * major + minor
    suffix: str  # "", "a" (arch-specific) or "f" (family-specific)

    def __str__(self) -> str:
        return f"{self.kind}_{self.cc}{self.suffix}"

    def runs_on(self, device_cc: int) -> bool:
        """Whether code for this target can execute on a device of capability ``device_cc``."""
        if self.suffix == "a":
            return device_cc == self.cc
        if self.kind == "compute" and self.suffix == "":
            return device_cc >= self.cc
        # Plain cubins and family targets (cubin or PTX): same major, minor at least ours.
        if self.cc in _ONLY:
            return device_cc in _ONLY[self.cc]
        if device_cc in _EXCLUDED.get(self.cc, ()):
            return False
        return device_cc // 10 == self.cc // 10 and device_cc >= self.cc


@dataclass(frozen=True)
class ArchVerdict:
    """How (and whether) the build's kernels reach one device. Frozen, JSON-friendly fields."""

    kind: str
    device: str  # "sm_90"
    target: str | None  # the arch-list entry that decided it, None when nothing runs
    explanation: str
    assumed: bool = False  # True when an unverified table entry (sm_107) decided the verdict

    @property
    def runs(self) -> bool:
        """True unless the verdict is ``unsupported`` (``unknown`` is given the benefit of the doubt)."""
        return self.kind != UNSUPPORTED


@functools.lru_cache(maxsize=512)
def parse_arch(entry: str) -> ArchTarget | None:
    """Parse one arch-list entry (``'sm_100f'``, ``'compute_90'``); None if it is not NVIDIA's."""
    m = _ARCH_RE.match(entry.strip().lower())
    if m is None:
        return None
    return ArchTarget(m.group(1), int(m.group(2)), m.group(3))


def _cc_str(cc: int) -> str:
    return f"{cc // 10}.{cc % 10}"


def _device_name(cc: int) -> str:
    known = KNOWN_DEVICES.get(cc)
    return f"compute capability {_cc_str(cc)}" + (f" ({known})" if known else "")


def arch_verdict(capability: tuple[int, int], arch_list: Iterable[str]) -> ArchVerdict:
    """Decide how the kernels of a build with ``arch_list`` run on a ``capability`` device.

    Pure: no torch calls. ``capability`` is ``torch.cuda.get_device_capability(i)``; minors
    above 9 are rejected (capabilities are encoded as ``10 * major + minor``, as NVIDIA does).
    Entries that are not ``sm_*``/``compute_*`` (e.g. ROCm ``gfx*``) are ignored.
    """
    major, minor = capability
    if not (isinstance(major, int) and isinstance(minor, int)) or major < 1 or not 0 <= minor <= 9:
        raise ConfigError(
            f"compute capability must be (major, minor) with major >= 1 and 0 <= minor <= 9, "
            f"got {capability!r}"
        )
    cc = 10 * major + minor
    device = f"sm_{cc}"
    entries = [str(e) for e in arch_list]
    targets = [t for t in (parse_arch(e) for e in entries) if t is not None]
    name = _device_name(cc)
    listed = " ".join(entries) if entries else "(none)"
    if not targets:
        return ArchVerdict(
            UNKNOWN, device, None,
            f"the torch build lists no NVIDIA architectures ({listed}); cannot tell whether "
            f"its kernels run on {name}",
            assumed=cc in ASSUMED,
        )

    def pick(cands: list[ArchTarget]) -> ArchTarget:
        # Prefer the closest capability, then plain over family over arch-specific (stable).
        return max(cands, key=lambda t: (t.cc, {"": 2, "f": 1, "a": 0}[t.suffix]))

    runnable = [t for t in targets if t.runs_on(cc)]
    cubins = [t for t in runnable if t.kind == "sm"]
    exact = [t for t in cubins if t.cc == cc]
    if exact:
        t = pick(exact)
        return ArchVerdict(
            NATIVE, device, str(t),
            f"{name}: the build has a native cubin ({t})", assumed=cc in ASSUMED,
        )
    if cubins:
        t = pick(cubins)
        family = " (family-specific cubin)" if t.suffix == "f" else ""
        return ArchVerdict(
            BINARY_COMPATIBLE, device, str(t),
            f"{name}: no {device} cubin, but {t}{family} is binary-compatible with it; kernels "
            f"run at full speed without {_cc_str(cc)}-only features",
            assumed=cc in ASSUMED or t.cc in ASSUMED,
        )
    ptx = [t for t in runnable if t.kind == "compute"]
    if ptx:
        t = pick(ptx)
        return ArchVerdict(
            PTX_JIT, device, str(t),
            f"{name}: no compatible cubin in the build ({listed}); the driver will JIT-compile "
            f"the {t} PTX on first launch of every kernel (slow first launch, cached "
            f"afterwards; set CUDA_CACHE_MAXSIZE high enough to keep it)",
            assumed=cc in ASSUMED or t.cc in ASSUMED,
        )
    near = [t for t in targets if t.cc // 10 == major]
    why = ""
    if any(t.suffix == "a" for t in near):
        why = " (arch-specific 'a' targets run only on exactly their own capability)"
    elif near:
        why = " (same-major targets here have a higher minor, or exclude this device)"
    return ArchVerdict(
        UNSUPPORTED, device, None,
        f"{name} is not supported by this torch build: no cubin of major {major} at or below "
        f"{_cc_str(cc)} and no PTX at or below it in the build's arch list ({listed}){why}; "
        f"install a torch build compiled for {device} (see https://pytorch.org/get-started/locally/)",
        assumed=cc in ASSUMED,
    )
