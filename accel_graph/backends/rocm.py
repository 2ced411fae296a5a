"""ROCm facts: the HIP runtime version, the gfx architecture and known HIP-graph quirks.

Pure module: parsing and a data table, no torch calls. The hip backend applies the quirks'
mitigations; ``doctor`` reports the ones that apply to the running stack.

References use the citation style of ``shared/reference/serving-anchors.md``: ``owner/repo#N``
for issues and pull requests, ``owner/repo:path`` for files. "torch-internals §2" is section 2
of ``shared/reference/torch-internals.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = [
    "HIP_QUIRKS",
    "GfxArch",
    "HipQuirk",
    "parse_gfx_arch",
    "parse_hip_version",
    "quirks_for",
]

Version = tuple[int, int, int]

_VERSION_RE = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.~][0-9A-Za-z.+~-]*)?\s*$")
_GFX_RE = re.compile(r"^gfx[0-9a-f]{3,5}$")


def parse_hip_version(text: str) -> Version:
    """``torch.version.hip`` as ``(major, minor, build)``.

    Accepts ``'7.14.12345-abcdef'`` -> ``(7, 14, 12345)``, ``'6.4.43482'``, ``'7.0.0'`` and
    ``'7.1'`` -> ``(7, 1, 0)``. The third field is HIP's build number, so ordinary tuple
    comparison orders versions correctly for the ranges below. Raises ``ConfigError`` otherwise.
    """
    if not isinstance(text, str):
        raise ConfigError(f"torch.version.hip must be a string like '7.0.0', got {text!r}")
    m = _VERSION_RE.match(text)
    if m is None:
        raise ConfigError(
            f"cannot parse HIP version {text!r}: expected 'MAJOR.MINOR[.BUILD][-HASH]', "
            f"e.g. '6.4.43482' or '7.14.12345-abcdef'"
        )
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class GfxArch:
    """A parsed ``gcnArchName``: ``'gfx942:sramecc+:xnack-'`` -> name ``gfx942`` and features.

    ``features`` maps each target feature to True (``+``) or False (``-``); features given
    without a sign are omitted (unspecified, "any").
    """

    name: str
    features: tuple[tuple[str, bool], ...] = ()

    def feature(self, name: str) -> bool | None:
        """True/False for ``+``/``-``, None when the arch string does not say."""
        return dict(self.features).get(name)

    def __str__(self) -> str:
        return self.name


def parse_gfx_arch(text: str) -> GfxArch:
    """Parse ``torch.cuda.get_device_properties(i).gcnArchName``. Raises ``ConfigError``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"gcnArchName must be a non-empty string like 'gfx942', got {text!r}")
    name, *rest = text.strip().split(":")
    name = name.lower()
    if not _GFX_RE.match(name):
        raise ConfigError(
            f"cannot parse gfx arch {text!r}: expected 'gfxNNN[:feature+|-]...', e.g. "
            f"'gfx942:sramecc+:xnack-'"
        )
    feats: list[tuple[str, bool]] = []
    for item in rest:
        if item.endswith(("+", "-")) and len(item) > 1:
            feats.append((item[:-1], item.endswith("+")))
        elif not item:
            raise ConfigError(f"empty feature in gfx arch {text!r}")
    return GfxArch(name, tuple(feats))


@dataclass(frozen=True)
class HipQuirk:
    """One known HIP-graph problem, when it applies, and what accel-graph does about it.

    Applies when the ROCm version is in ``[min_version, max_version)`` (None: unbounded) and the
    device arch is in ``archs`` (None: every arch). ``mitigation`` states what the hip backend
    does; "reported only" means nothing is done beyond ``doctor`` listing it.
    """

    id: str
    what: str
    mitigation: str
    references: tuple[str, ...]
    min_version: Version | None = None
    max_version: Version | None = None
    archs: frozenset[str] | None = None

    def applies(self, version: Version | None, arch: str | None) -> bool:
        """Whether this quirk can bite on ``version``/``arch``. Unknown (None) values are
        treated conservatively: a quirk that cannot be ruled out applies."""
        if version is not None:
            if self.min_version is not None and version < self.min_version:
                return False
            if self.max_version is not None and version >= self.max_version:
                return False
        if arch is not None and self.archs is not None:
            return arch.split(":")[0].lower() in self.archs
        return True

    def applies_when(self) -> str:
        """The applicability as text, for ``doctor`` and docs."""
        def v(x: Version) -> str:
            return ".".join(map(str, x[:2])) + (f".{x[2]}" if x[2] else "")
        parts = []
        if self.min_version is not None:
            parts.append(f"ROCm >= {v(self.min_version)}")
        if self.max_version is not None:
            parts.append(f"ROCm < {v(self.max_version)}")
        if self.archs is not None:
            parts.append("arch in " + ", ".join(sorted(self.archs)))
        return " and ".join(parts) or "all ROCm versions and archs"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, as the doctor's ``rocm.quirks`` entries."""
        return {
            "id": self.id, "what": self.what, "mitigation": self.mitigation,
            "references": list(self.references), "applies_when": self.applies_when(),
        }  # fmt: skip


HIP_QUIRKS: tuple[HipQuirk, ...] = (
    HipQuirk(
        id="warmup-same-stream",
        what="hipBLASLt (and AITER workspaces) cache handles per (device, stream); a handle "
        "created lazily inside capture fails or hangs, so warm-up and capture must run on the "
        "same stream",
        mitigation="accel_graph.graph() on hip captures on the current stream when it is not the "
        "default stream; otherwise it uses the backend's per-device capture stream and warns "
        "once that warm-up should run on backend.capture_stream(device) too",
        references=("ROCm/pytorch#3354", "pytorch/pytorch#187745", "pytorch/pytorch#179961",
                    "vllm-project/vllm#53818"),
    ),
    HipQuirk(
        id="no-conditional-nodes",
        what="HIP graphs have no conditional nodes: torch's begin_capture_to_if_node errors on "
        "ROCm as if CUDA < 12.4, so torch.cond cannot become an in-graph branch",
        mitigation="torch.cond / torch.while_loop inside a HIP capture raise CaptureError saying so "
        "(native_cf_support); run them under the recorder (device='cpu') or outside the capture",
        references=("pytorch/pytorch:aten/src/ATen/cuda/CUDAGraph.cpp@00cbb1f",
                    "torch-internals §2 (ROCm), §7"),
    ),
    HipQuirk(
        id="expandable-segments-rocm7",
        what="expandable_segments needs ROCm >= 7.0; older ROCm logs 'expandable_segments not "
        "supported on this platform' and keeps the feature off",
        mitigation="the setting is reported as ineffective; memory accounting assumes "
        "fixed segments",
        references=("pytorch/pytorch:c10/cuda/CUDAAllocatorConfig.h (torch 2.13)",
                    "torch-internals §2 (ROCm)"),
        max_version=(7, 0, 0),
    ),
    HipQuirk(
        id="lazy-graph-exec-destroy",
        what="since ROCm 6.2 hipGraphExecDestroy frees lazily at the next sync point; torch's "
        "~CUDAGraph synchronizes on ROCm but CUDAGraph.reset() does not",
        mitigation="the hip backend synchronizes the graph's device before reset() drops a "
        "graph executable (torch's destructor covers garbage-collected graphs)",
        references=("pytorch/pytorch:aten/src/ATen/cuda/CUDAGraph.cpp@00cbb1f (~CUDAGraph)",
                    "torch-internals §2 (ROCm)"),
        min_version=(6, 2, 0),
    ),
    HipQuirk(
        id="captured-event-rocm-7.2.0",
        what="hipErrorCapturedEvent during graph capture (reported as a ROCm 7.2.0 HIP runtime "
        "bug); the fixed release is not known to us",
        mitigation="reported only",
        references=("sgl-project/sglang#24011",),
        min_version=(7, 2, 0),
        max_version=(7, 3, 0),
    ),
    HipQuirk(
        id="replay-corruption-mi300x",
        what="nondeterministic output corruption of HIP graph capture/replay on MI300X "
        "(correct eagerly, wrong on replay in some processes); affected versions not stated",
        mitigation="reported only; compare one replay against eager at startup",
        references=("ROCm/clr#279",),
        archs=frozenset({"gfx942"}),
    ),
    HipQuirk(
        id="stale-external-write-gfx950",
        what="HIP graph replay reads stale device memory for a buffer written outside the graph "
        "on gfx950 (MI355X); affected versions not stated",
        mitigation="reported only; synchronize after external writes to graph inputs",
        references=("ROCm/hip#3902",),
        archs=frozenset({"gfx950"}),
    ),
)


def quirks_for(
    version: Version | str | None, arch: GfxArch | str | None = None
) -> list[HipQuirk]:
    """The quirks of :data:`HIP_QUIRKS` that apply to ``version`` (tuple or ``torch.version.hip``
    string) on ``arch`` (``GfxArch`` or a gcnArchName string); None means unknown."""
    v = parse_hip_version(version) if isinstance(version, str) else version
    a = arch.name if isinstance(arch, GfxArch) else (parse_gfx_arch(arch).name if arch else None)
    return [q for q in HIP_QUIRKS if q.applies(v, a)]
