"""The cuda backend: NVIDIA GPUs through ``torch.cuda.CUDAGraph``.

A thin adapter (see :mod:`._torch_graphs`): torch 2.13 registers no CUDA implementation behind
``torch.accelerator.Graph`` (torch-internals §1), so CUDA is driven through ``torch.cuda``
directly. Usable only on CUDA builds (``torch.version.cuda`` set, ``torch.version.hip`` not);
ROCm builds, which reuse ``torch.cuda``, go to the hip backend.

Before a device gets a graph, the build's arch list is checked against the device's compute
capability (:func:`.nvidia_arch.arch_verdict`): an unsupported device is refused with the
verdict's explanation, and PTX-only devices get a one-time warning about slow first launches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import ClassVar

import torch

from ..errors import BackendUnavailable
from ._torch_graphs import CUDA_GRAPH_CAPABILITIES, TorchGraphBackend
from .base import Capabilities, DeviceSpec
from .nvidia_arch import PTX_JIT, UNSUPPORTED, ArchVerdict, arch_verdict

__all__ = ["CudaBackend"]

class CudaBackend(TorchGraphBackend):
    """CUDA graphs on NVIDIA GPUs (``torch.cuda.CUDAGraph``)."""

    name: ClassVar[str] = "cuda"
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    priority: ClassVar[int] = 10
    module_name = "cuda"
    # torch.cuda.CUDAGraph.capture_begin's own default; "default" means the vendor's default.
    vendor_default_mode = "global"

    def __init__(self) -> None:
        super().__init__()
        self._verdicts: dict[int, ArchVerdict] = {}
        self._warned: set[int] = set()

    @classmethod
    def probe(cls) -> str | None:
        version = getattr(torch, "version", None)
        hip = getattr(version, "hip", None)
        if hip:
            return f"this is a ROCm build (torch.version.hip={hip!r}): use the hip backend"
        if getattr(version, "cuda", None) is None:
            return "torch.version.cuda is None: this torch build has no CUDA support"
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_available():
            return "torch.cuda.is_available() is False (no NVIDIA driver or no visible device)"
        if not hasattr(cuda, "CUDAGraph"):
            return "torch.cuda.CUDAGraph is missing from this torch build"
        return None

    def capabilities(self) -> Capabilities:
        return CUDA_GRAPH_CAPABILITIES

    def device_arch(self, index: int) -> str | None:
        major, minor = self.module.get_device_capability(index)
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
