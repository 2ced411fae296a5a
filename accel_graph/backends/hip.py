"""The hip backend: AMD GPUs through ``torch.cuda.CUDAGraph`` on ROCm builds (HIP graphs).

ROCm builds reuse the whole ``torch.cuda`` API with device type ``"cuda"`` (torch-internals §2),
so this is the cuda adapter with ROCm's differences: it serves only builds with
``torch.version.hip`` set, reports the ROCm version and gfx arch, and applies the quirks of
:data:`.rocm.HIP_QUIRKS` where they bite:

* ``lazy-graph-exec-destroy``: synchronize the device before ``reset()`` drops an executable.
* ``warmup-same-stream``: ``accel_graph.graph`` captures on the current stream when it is a side
  stream (vLLM #53818), so warm-up run there shares its library handles with the capture.
* ``no-conditional-nodes`` and the allocator quirks are reported (``describe``/doctor).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ._torch_graphs import CUDA_GRAPH_CAPABILITIES, TorchGraphBackend
from .base import Capabilities, DeviceSpec
from .rocm import HipQuirk, parse_gfx_arch, parse_hip_version, quirks_for

__all__ = ["HipBackend"]


class HipBackend(TorchGraphBackend):
    """HIP graphs on AMD GPUs (ROCm builds of torch, ``torch.cuda.CUDAGraph``)."""

    name: ClassVar[str] = "hip"
    aliases: ClassVar[tuple[str, ...]] = ("rocm",)
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    priority: ClassVar[int] = 10
    module_name = "cuda"
    vendor_default_mode = "global"  # hipStreamCaptureModeGlobal, as torch passes on CUDA

    def __init__(self) -> None:
        super().__init__()
        self._warned_stream = False
        self._warned_arch: set[int | None] = set()

    @classmethod
    def probe(cls) -> str | None:
        hip = getattr(getattr(torch, "version", None), "hip", None)
        if not hip:
            return "torch.version.hip is None: this is not a ROCm build of torch"
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_available():
            return "torch.cuda.is_available() is False (no AMD GPU visible to ROCm)"
        if not hasattr(cuda, "CUDAGraph"):
            return "torch.cuda.CUDAGraph is missing from this torch build"
        return None

    def capabilities(self) -> Capabilities:
        return CUDA_GRAPH_CAPABILITIES

    @staticmethod
    def rocm_version() -> tuple[int, int, int] | None:
        """``torch.version.hip`` parsed, or None when absent or unparsable."""
        try:
            return parse_hip_version(torch.version.hip)  # type: ignore[arg-type]
        except Exception:
            return None

    def device_arch(self, index: int) -> str | None:
        props = self.module.get_device_properties(index)
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

    def before_release(self, device: DeviceSpec) -> None:
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
