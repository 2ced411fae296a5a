"""The xpu backend: Intel GPUs through ``torch.accelerator.Graph`` or ``torch.xpu.XPUGraph``.

``torch.accelerator.Graph`` (torch 2.12+) is preferred where XPU registers an implementation
behind it (it does in 2.13); otherwise ``torch.xpu.XPUGraph`` (torch 2.11+). On stacks with
neither the probe fails with the reason, so routing sends XPU tensors to the recorder and the
API still works there.

XPU honours only ``capture_error_mode="default"`` (its GraphImpl logs and falls back for any
other mode), so other modes are accepted with a warning. XPU's allocator plug-in (a
``sycl::queue*`` ABI) is out of scope. ``intel-extension-for-pytorch`` (the ``xpu`` extra) is
never imported here; if an older stack's ``torch.xpu`` gains ``XPUGraph`` through it, it is used.
The doctor's ``xpu`` section reports the route (native graph class or recorder fallback).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from ..errors import BackendUnavailable
from .base import Capabilities
from .device_facts import NOT_CHECKED_XPU, fact, safe
from .native.backend import NativeGraphBackend, begin_params

__all__ = ["XpuBackend", "accelerator_graph_class"]


def accelerator_graph_class() -> Any:
    """``torch.accelerator.Graph`` when present and the current accelerator is XPU, else None."""
    acc = getattr(torch, "accelerator", None)
    cls = getattr(acc, "Graph", None)
    if cls is None:
        return None
    try:
        current = acc.current_accelerator()
    except Exception:
        return None
    return cls if current is not None and current.type == "xpu" else None


class XpuBackend(NativeGraphBackend):
    """Native XPU graphs (``torch.accelerator.Graph`` where registered, else ``XPUGraph``)."""

    name: ClassVar[str] = "xpu"
    device_types: ClassVar[tuple[str, ...]] = ("xpu",)
    priority: ClassVar[int] = 10
    module_name: ClassVar[str] = "xpu"
    vendor_default_mode: ClassVar[str] = "default"
    no_device_reason: ClassVar[str] = "no Intel GPU or no XPU build of torch"
    doctor_key: ClassVar[str | None] = "xpu"
    doctor_title: ClassVar[str] = "XPU"

    def __init__(self) -> None:
        super().__init__()
        # Decided on the first capture: constructing a graph is the only sure test that XPU is
        # registered behind torch.accelerator.Graph, and probes must not touch the device.
        self._graph_class: Any = None

    @classmethod
    def probe_graph_class(cls, module: Any) -> str | None:
        if accelerator_graph_class() is None and not hasattr(module, "XPUGraph"):
            return (
                f"torch {torch.__version__} has neither torch.accelerator.Graph nor "
                f"torch.xpu.XPUGraph (XPU graphs need torch 2.11+); XPU tensors use the recorder"
            )
        return None

    def capabilities(self) -> Capabilities:
        return Capabilities(
            native_graphs=True,
            capture_error_modes=("default",),
            standalone_bytes=False,
            compile=False,
            foreign_pool_handles=True,
        )

    def graph_class(self) -> Any:
        """The torch class this backend captures with (decided once, on first use)."""
        if self._graph_class is None:
            acc_cls = accelerator_graph_class()
            if acc_cls is not None:
                try:
                    acc_cls(False)  # "Graph is not supported on device type" if XPU unregistered
                    self._graph_class = acc_cls
                except RuntimeError:
                    acc_cls = None
            if acc_cls is None:
                xpu_graph = getattr(self.module, "XPUGraph", None)
                if xpu_graph is None:
                    raise BackendUnavailable(
                        "torch.accelerator.Graph has no XPU implementation on this stack and "
                        "torch.xpu.XPUGraph is missing; pass device='cpu' or force the recorder "
                        "with ACCEL_GRAPH_BACKEND=recorder"
                    )
                self._graph_class = xpu_graph
        return self._graph_class

    def new_torch_graph(self, keep_graph: bool, torch_id: tuple[int, int] | None, mode: str) -> Any:
        cls = self.graph_class()
        if cls is getattr(self.module, "XPUGraph", None):
            return cls(keep_graph)
        # torch.accelerator.Graph takes pool and mode at construction in 2.12/2.13; current main
        # moves the mode to capture_begin, so pass only what this constructor accepts.
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            params = {}
        offered = {"pool": torch_id, "capture_error_mode": mode}
        return cls(keep_graph, **{k: v for k, v in offered.items() if k in params})

    def begin_capture(self, graph: Any, torch_id: tuple[int, int] | None, mode: str) -> None:
        params = begin_params(graph)
        if "pool" in params or "capture_error_mode" in params:
            super().begin_capture(graph, torch_id, mode)  # XPUGraph(pool=); newer accelerator.Graph
            return
        # torch.accelerator.Graph in 2.12/2.13 reads these attributes in capture_begin().
        if hasattr(graph, "graph_pool"):
            graph.graph_pool = torch_id
        if hasattr(graph, "capture_error_mode"):
            graph.capture_error_mode = mode
        graph.capture_begin()

    def dump_graph(self, graph: Any, path: str) -> None:
        # XPUGraphImpl's debug_dump requires a ".dot" path (torch-internals §1).
        if path.endswith(".dot"):
            graph.debug_dump(path)
            return
        tmp = path + ".dot"
        graph.debug_dump(tmp)
        if os.path.exists(tmp):
            os.replace(tmp, path)
        else:
            warnings.warn(f"xpu debug_dump wrote nothing to {tmp}", stacklevel=3)

    def describe(self) -> Iterator[tuple[str, str]]:
        yield from super().describe()
        try:
            cls = self._graph_class
            if cls is None:  # not decided until the first capture
                cls = accelerator_graph_class() or getattr(self.module, "XPUGraph", None)
            yield "xpu graph class", getattr(cls, "__qualname__", str(cls))
            yield "allocator plug-in", "out of scope (sycl::queue* ABI)"
        except Exception as exc:  # describe must never raise
            yield "error", f"{type(exc).__name__}: {exc}"

    # -- doctor ------------------------------------------------------------------------------
    @classmethod
    def doctor_versions(cls) -> dict[str, dict[str, Any]]:
        if getattr(torch.version, "xpu", None):
            return {"xpu_build": fact(torch.version.xpu, "torch.version.xpu")}
        return {"xpu_build": fact(None, "not an XPU build of torch (torch.version.xpu is None)")}

    @classmethod
    def doctor_section(cls, probe_devices: bool, problems: list[str]) -> dict[str, Any] | None:
        """The route XPU tensors take (native graph class or recorder) and why."""
        xpu = getattr(torch, "xpu", None)
        acc_graph = getattr(getattr(torch, "accelerator", None), "Graph", None) is not None
        xpu_graph = xpu is not None and hasattr(xpu, "XPUGraph")
        out: dict[str, Any] = {
            "available": False,
            "device_count": 0,
            "graph_classes": {"torch.accelerator.Graph": acc_graph, "torch.xpu.XPUGraph": xpu_graph},
            "route": None,
            "explanation": "",
            "devices": None,
            "devices_note": None,
            "devices_error": None,
        }
        available, _ = safe(lambda: bool(xpu.is_available()) if xpu is not None else False, False)
        if not available:
            out["explanation"] = (
                "no XPU device (torch.xpu.is_available() is False); on an XPU host graphs would use "
                + ("torch.accelerator.Graph where XPU is registered behind it, else torch.xpu.XPUGraph"
                   if acc_graph or xpu_graph else "the recorder: this torch has no XPU graph class")
            )  # fmt: skip
            return out
        out["available"] = True
        out["device_count"], _ = safe(lambda: int(xpu.device_count()), 0)
        reason = cls.probe()
        if reason is not None:
            out["route"] = "recorder"
            out["explanation"] = (
                f"recorder fallback: {reason}. XPU tensors are captured and replayed by the recorder "
                f"(interpreted replay, not a device graph)"
            )
        elif accelerator_graph_class() is not None:
            out["route"] = "torch.accelerator.Graph"
            out["explanation"] = (
                "native XPU graphs through torch.accelerator.Graph (confirmed at the first capture; "
                "if XPU turns out not to be registered behind it, torch.xpu.XPUGraph is used)"
            )
        else:
            out["route"] = "torch.xpu.XPUGraph"
            out["explanation"] = "native XPU graphs through torch.xpu.XPUGraph"
        out["devices_note"] = None if probe_devices else NOT_CHECKED_XPU
        if probe_devices:
            names, err = safe(lambda: [str(xpu.get_device_name(i)) for i in range(out["device_count"])], [])
            out["devices"] = names
            out["devices_error"] = err
        return out

    @classmethod
    def doctor_lines(cls, section: Mapping[str, Any] | None) -> list[str]:
        x = section or {}
        return [f"  route: {x.get('route') or '-'}; {x.get('explanation')}"]
