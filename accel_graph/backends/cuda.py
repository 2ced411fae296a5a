"""The cuda backend: NVIDIA GPUs through ``torch.cuda.CUDAGraph``.

A thin adapter over :class:`.native.NativeGraphBackend`: torch 2.13 registers no CUDA
implementation behind ``torch.accelerator.Graph`` (torch-internals §1), so CUDA is driven
through ``torch.cuda`` directly. Usable only on CUDA builds (``torch.version.cuda`` set,
``torch.version.hip`` not); ROCm builds, which reuse ``torch.cuda``, go to the hip backend.

Before a device gets a graph, the build's arch list is checked against the device's compute
capability (:func:`.nvidia_arch.arch_verdict`): an unsupported device is refused with the
verdict's explanation, and PTX-only devices get a one-time warning about slow first launches.
The doctor's ``nvidia`` section reports the same verdicts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..errors import BackendUnavailable
from .base import DeviceSpec
from .device_facts import (
    cuda_device_name,
    cuda_devices,
    fact,
    nvidia_driver_version,
    runtime_version,
    safe,
)
from .native.backend import NativeGraphBackend
from .nvidia_arch import PTX_JIT, UNSUPPORTED, ArchVerdict, arch_verdict

__all__ = ["CudaBackend"]


def _is_cuda_build() -> bool:
    version = getattr(torch, "version", None)
    return bool(getattr(version, "cuda", None)) and not getattr(version, "hip", None)


class CudaBackend(NativeGraphBackend):
    """CUDA graphs on NVIDIA GPUs (``torch.cuda.CUDAGraph``)."""

    name: ClassVar[str] = "cuda"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    priority: ClassVar[int] = 10
    module_name: ClassVar[str] = "cuda"
    # torch.cuda.CUDAGraph.capture_begin's own default; "default" means the vendor's default.
    vendor_default_mode: ClassVar[str] = "global"
    no_device_reason: ClassVar[str] = "no NVIDIA driver or no visible device"
    doctor_key: ClassVar[str | None] = "nvidia"
    doctor_title: ClassVar[str] = "NVIDIA"

    def __init__(self) -> None:
        super().__init__()
        self._verdicts: dict[int, ArchVerdict] = {}
        self._warned: set[int] = set()

    @classmethod
    def probe_build(cls) -> str | None:
        version = getattr(torch, "version", None)
        hip = getattr(version, "hip", None)
        if hip:
            return f"this is a ROCm build (torch.version.hip={hip!r}): use the hip backend"
        if getattr(version, "cuda", None) is None:
            return "torch.version.cuda is None: this torch build has no CUDA support"
        return None

    def device_arch(self, index: int) -> str | None:
        try:
            major, minor = self.module.get_device_capability(index)
        except RuntimeError as exc:  # a driver that enumerates devices but cannot open them
            raise BackendUnavailable(
                f"cannot read the compute capability of cuda:{index} ({exc}): the NVIDIA driver "
                f"failed; check that nvidia-smi lists the GPU, or pass device='cpu'"
            ) from exc
        return f"sm_{major}{minor}"

    def arch_verdict(self, index: int) -> ArchVerdict:
        """The (cached) verdict for device ``index`` against this build's arch list."""
        verdict = self._verdicts.get(index)
        if verdict is None:
            mod = self.module
            capability = tuple(mod.get_device_capability(index))
            arch_list = mod.get_arch_list() if hasattr(mod, "get_arch_list") else []
            verdict = self._verdicts[index] = arch_verdict(capability, arch_list)  # type: ignore[arg-type]
        return verdict

    def check_device_usable(self, spec: DeviceSpec) -> None:
        assert spec.index is not None
        verdict = self.arch_verdict(spec.index)
        if verdict.kind == UNSUPPORTED:
            raise BackendUnavailable(f"cannot capture graphs on {spec}: {verdict.explanation}")
        if verdict.kind == PTX_JIT and spec.index not in self._warned:
            self._warned.add(spec.index)  # once per device per process
            warnings.warn(f"{spec}: {verdict.explanation}", RuntimeWarning, stacklevel=4)

    def describe(self) -> Iterator[tuple[str, str]]:
        yield from super().describe()
        try:
            yield "torch.version.cuda", str(torch.version.cuda)
            yield "arch_list", " ".join(self.module.get_arch_list())
            for i, verdict in sorted(self._verdicts.items()):
                yield f"cuda:{i} arch", f"{verdict.kind}: {verdict.explanation}"
        except Exception as exc:  # describe must never raise
            yield "error", f"{type(exc).__name__}: {exc}"

    # -- doctor ------------------------------------------------------------------------------
    @classmethod
    def doctor_versions(cls) -> dict[str, dict[str, Any]]:
        if _is_cuda_build():
            return {
                "cuda_build": fact(torch.version.cuda, "torch.version.cuda (the toolkit torch was built with)"),
                "cuda_runtime": fact(*runtime_version("libcudart.so", "cudaRuntimeGetVersion")),
                "cuda_driver": fact(*nvidia_driver_version()),
            }
        why = fact(None, "not a CUDA build of torch (torch.version.cuda is None)")
        return {"cuda_build": why, "cuda_runtime": dict(why), "cuda_driver": fact(*nvidia_driver_version())}

    @classmethod
    def doctor_section(cls, probe_devices: bool, problems: list[str]) -> dict[str, Any] | None:
        """The arch list and, per device, the arch verdict (null unless this is a CUDA build)."""
        if not _is_cuda_build():
            return None
        arch_list, err = safe(lambda: list(torch.cuda.get_arch_list()), [])

        def one(i: int) -> dict[str, Any]:
            cap = tuple(int(x) for x in torch.cuda.get_device_capability(i))
            v = arch_verdict(cap, arch_list)  # type: ignore[arg-type]
            if v.kind == UNSUPPORTED:
                problems.append(f"cuda:{i}: {v.explanation}")
            return {
                "index": i,
                "name": cuda_device_name(i),
                "capability": f"{cap[0]}.{cap[1]}",
                "verdict": {"kind": v.kind, "target": v.target, "explanation": v.explanation, "assumed": v.assumed},
            }

        devices, note = cuda_devices(probe_devices, one)
        return {"arch_list": arch_list, "arch_list_error": err, "devices": devices, "note": note}

    @classmethod
    def doctor_lines(cls, section: Mapping[str, Any] | None) -> list[str]:
        if section is None:
            return ["  not a CUDA build of torch: no arch verdicts"]
        out = [f"  arch list: {' '.join(section.get('arch_list') or []) or '(none)'}"]
        if section.get("devices") is None:
            out.append(f"  per-device verdict: {section.get('note')}")
        for d in section.get("devices") or []:
            v = d.get("verdict") or {}
            out.append(f"  cuda:{d['index']} {d.get('name')} sm {d.get('capability')}: {v.get('kind')}"
                       f"{' (assumed)' if v.get('assumed') else ''} - {v.get('explanation') or d.get('error')}")
        return out
