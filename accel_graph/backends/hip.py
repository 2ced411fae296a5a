"""The hip backend: AMD GPUs through ``torch.cuda.CUDAGraph`` on ROCm builds (HIP graphs).

ROCm builds reuse the whole ``torch.cuda`` API with device type ``"cuda"`` (torch-internals §2),
so this is the cuda adapter with ROCm's differences: it serves only builds with
``torch.version.hip`` set, reports the ROCm version and gfx arch, and applies the quirks of
:data:`.rocm.HIP_QUIRKS` where they bite:

* ``lazy-graph-exec-destroy``: synchronize the device before ``reset()`` drops an executable.
* ``warmup-same-stream``: ``accel_graph.graph`` captures on the current stream when it is a side
  stream (vLLM #53818), so warm-up run there shares its library handles with the capture.
* ``no-conditional-nodes``: ``torch.cond`` in a capture is refused with ``CaptureError``
  (:mod:`.native.control_flow_support`);
* the allocator quirks are reported (``describe`` and the doctor's
  ``rocm`` section, with the gfx arch per device).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..errors import BackendUnavailable
from .base import DeviceSpec
from .device_facts import cuda_device_name, cuda_devices, fact, read_text, runtime_version, safe
from .native.backend import NativeGraphBackend
from .rocm import HipQuirk, parse_gfx_arch, parse_hip_version, quirks_for

__all__ = ["HipBackend"]


class HipBackend(NativeGraphBackend):
    """HIP graphs on AMD GPUs (ROCm builds of torch, ``torch.cuda.CUDAGraph``)."""

    name: ClassVar[str] = "hip"
    aliases: ClassVar[tuple[str, ...]] = ("rocm",)
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    priority: ClassVar[int] = 10
    module_name: ClassVar[str] = "cuda"
    vendor_default_mode: ClassVar[str] = "global"  # hipStreamCaptureModeGlobal, as torch passes on CUDA
    no_device_reason: ClassVar[str] = "no AMD GPU visible to ROCm"
    doctor_key: ClassVar[str | None] = "rocm"
    doctor_title: ClassVar[str] = "ROCm"

    def __init__(self) -> None:
        super().__init__()
        self._warned_stream = False
        self._warned_arch: set[int | None] = set()

    @classmethod
    def probe_build(cls) -> str | None:
        if not getattr(getattr(torch, "version", None), "hip", None):
            return "torch.version.hip is None: this is not a ROCm build of torch"
        return None

    @staticmethod
    def rocm_version() -> tuple[int, int, int] | None:
        """``torch.version.hip`` parsed, or None when absent or unparsable."""
        try:
            return parse_hip_version(torch.version.hip)  # type: ignore[arg-type]
        except Exception:
            return None

    def device_arch(self, index: int) -> str | None:
        try:
            props = self.module.get_device_properties(index)
        except RuntimeError as exc:  # a driver that enumerates devices but cannot open them
            raise BackendUnavailable(
                f"cannot read the properties of cuda:{index} ({exc}): the ROCm driver failed; "
                f"check that rocm-smi lists the GPU, or pass device='cpu'"
            ) from exc
        name = getattr(props, "gcnArchName", None)
        try:
            return parse_gfx_arch(name).name if name else None
        except Exception:
            return None

    def check_device_usable(self, spec: DeviceSpec) -> None:
        # ROCm has no PTX-like JIT: code objects must match the gfx arch. Warn (not refuse):
        # HSA_OVERRIDE_GFX_VERSION and compatible targets can still make it work.
        arch_list = self.module.get_arch_list() if hasattr(self.module, "get_arch_list") else []
        built = {a.split(":")[0].lower() for a in arch_list}
        if spec.arch and built and spec.arch not in built and spec.index not in self._warned_arch:
            self._warned_arch.add(spec.index)
            warnings.warn(
                f"{spec}: this ROCm build of torch has no code objects for {spec.arch} (built "
                f"for {' '.join(sorted(built))}); kernels may fail with 'invalid device "
                f"function'. Install a build for {spec.arch}, or set HSA_OVERRIDE_GFX_VERSION "
                f"to a compatible target",
                RuntimeWarning,
                stacklevel=4,
            )

    def quirks(self, device: DeviceSpec | None = None) -> list[HipQuirk]:
        """The known HIP-graph quirks that apply here (to ``device``'s arch when given)."""
        return quirks_for(self.rocm_version(), device.arch if device is not None else None)

    def before_reset(self, device: DeviceSpec) -> None:
        # Quirk lazy-graph-exec-destroy: hipGraphExecDestroy frees at the next sync point, and
        # torch's reset() (unlike its destructor) does not sync. Never sync inside a capture:
        # that would invalidate it.
        if not self.module.is_current_stream_capturing():
            self.module.synchronize(device.index)

    def capture_stream(self, device: DeviceSpec) -> Any:
        # Quirk warmup-same-stream: library handles are per (device, stream), so capture where
        # the warm-up ran. The default stream cannot capture; use ours and say where to warm up.
        mod = self.module
        current = mod.current_stream(device.index)
        if current != mod.default_stream(device.index):
            return current
        if not self._warned_stream:
            self._warned_stream = True
            warnings.warn(
                "hip: accel_graph.graph() is capturing on the backend's side stream because the "
                "current stream is the default stream; run warm-up on the same stream "
                "(`with torch.cuda.stream(backend.capture_stream(device))`) or capture from a "
                "side stream, since hipBLASLt handles are per stream (ROCm/pytorch#3354)",
                stacklevel=4,
            )
        return super().capture_stream(device)

    def describe(self) -> Iterator[tuple[str, str]]:
        yield from super().describe()
        try:
            yield "torch.version.hip", str(torch.version.hip)
            yield "arch_list", " ".join(self.module.get_arch_list())
            for q in self.quirks():
                yield f"quirk {q.id}", f"{q.applies_when()}: {q.mitigation}"
        except Exception as exc:  # describe must never raise
            yield "error", f"{type(exc).__name__}: {exc}"

    # -- doctor ------------------------------------------------------------------------------
    @classmethod
    def doctor_versions(cls) -> dict[str, dict[str, Any]]:
        if getattr(torch.version, "hip", None):
            amd = read_text("/sys/module/amdgpu/version")
            return {
                "hip_build": fact(torch.version.hip, "torch.version.hip"),
                "hip_runtime": fact(*runtime_version("libamdhip64.so", "hipRuntimeGetVersion")),
                "amdgpu_driver": fact(
                    amd.strip() if amd else None,
                    "/sys/module/amdgpu/version" if amd else "not reported (/sys/module/amdgpu/version is absent)",
                ),
            }
        why = "not a ROCm build of torch (torch.version.hip is None)"
        return {k: fact(None, why) for k in ("hip_build", "hip_runtime", "amdgpu_driver")}

    @classmethod
    def doctor_section(cls, probe_devices: bool, problems: list[str]) -> dict[str, Any] | None:
        """The ROCm version, the gfx arch per device and the quirks that apply (null unless
        this is a ROCm build)."""
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return None
        parsed, parse_err = safe(lambda: parse_hip_version(hip))
        arch_list, _ = safe(lambda: list(torch.cuda.get_arch_list()), [])

        def one(i: int) -> dict[str, Any]:
            name = getattr(torch.cuda.get_device_properties(i), "gcnArchName", None)
            gfx, err = safe(lambda: parse_gfx_arch(name)) if name else (None, "no gcnArchName")
            quirks = quirks_for(parsed, gfx) if gfx is not None else quirks_for(parsed)
            return {
                "index": i,
                "name": cuda_device_name(i),
                "gcn_arch": name,
                "gfx": gfx.name if gfx else None,
                "features": {k: v for k, v in gfx.features} if gfx else {},
                "in_build": (gfx.name in {a.split(":")[0] for a in arch_list}) if gfx and arch_list else None,
                "quirks": [q.id for q in quirks],
                "error": err,
            }

        devices, note = cuda_devices(probe_devices, one)
        applicable = quirks_for(parsed)  # by version alone: arch-specific ones cannot be ruled out
        if devices:
            ids = {q for d in devices for q in d.get("quirks", [])}
            applicable = [q for q in applicable if q.id in ids]
        return {
            "hip_version": hip,
            "parsed": list(parsed) if parsed else None,
            "parse_error": parse_err,
            "arch_list": arch_list,
            "devices": devices,
            "note": note,
            "quirks_scope": "these devices" if devices else "this ROCm version, any arch (devices not checked)",
            "quirks": [q.as_dict() for q in applicable],
        }

    @classmethod
    def doctor_lines(cls, section: Mapping[str, Any] | None) -> list[str]:
        if section is None:
            return ["  not a ROCm build of torch: no HIP version, gfx arch or quirks"]
        out = [f"  HIP {section.get('hip_version')} (parsed {section.get('parsed') or section.get('parse_error')})"]
        if section.get("devices") is None:
            out.append(f"  gfx arch: {section.get('note')}")
        for d in section.get("devices") or []:
            out.append(f"  cuda:{d['index']} {d.get('gfx') or d.get('error')} ({d.get('gcn_arch')}); "
                       f"in build: {d.get('in_build')}")
        out.append(f"  quirks that apply ({section.get('quirks_scope')}):")
        for q in section.get("quirks") or []:
            out.append(f"    {q['id']} [{q['applies_when']}]: {q['mitigation']} ({', '.join(q['references'])})")
        return out
