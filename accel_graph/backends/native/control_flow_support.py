"""What a native backend can capture of ``torch.cond`` / ``torch.while_loop`` / ``torch.switch``:
feature detection by API (never by torch's version string), the refusal messages, and the
check ``check_capturable(target=...)`` can make from torch's Python API alone. The capture
itself is :mod:`.control_flow`; docs/backends.md "Control flow inside native graphs".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CaptureError

__all__ = [
    "RECORDER_HINT",
    "TORCH_MODULE",
    "ControlFlowSupport",
    "detect_support",
    "python_level_refusal",
    "summary",
    "torch_module",
]

#: torch's conditional-node capture module (pure Python; present in CPU builds too).
TORCH_MODULE = "torch._higher_order_ops.cudagraph_conditional_nodes"
#: What ``cond`` needs on the graph class (torch 2.13 CUDA builds have these).
IF_METHODS = ("get_currently_capturing_graph", "begin_capture_to_if_node",
              "end_capture_to_conditional_node")
#: What ``while_loop`` needs on the graph class: the methods torch 2.14.1's ``while_loop_node``
#: calls (read off the wheel; torch 2.13 has none of them).
WHILE_METHODS = ("begin_capture_to_while_node", "set_conditional_handle_for_current_node")
#: What ``switch`` needs (torch 2.14.1 ships the ``switch`` operator but no switch-node capture:
#: the names are a guess, so a torch whose API differs gets the refusal, never an unguarded call).
SWITCH_METHODS = ("begin_capture_to_switch_node",)
#: The CUDA version conditional nodes need (cudaGraphConditionalHandleCreate).
MIN_CUDA = (12, 4)

RECORDER_HINT = ("Run the same code under the recorder (accel_graph.Graph(device='cpu'), or "
                 "ACCEL_GRAPH_BACKEND=recorder), which captures torch.cond and torch.while_loop "
                 "as sub-programs, or keep this operator outside the captured region")


def torch_module() -> Any | None:
    """torch's conditional-node capture module, or None where this torch has none."""
    try:
        return importlib.import_module(TORCH_MODULE)
    except ImportError:
        return None


@dataclass(frozen=True)
class ControlFlowSupport:
    """What a native backend can capture, per operator: None when it can, else what is
    missing (a sentence fragment naming the API, build or device)."""

    backend: str
    kind: str  # "CUDA", "HIP", "XPU": the graph kind, for messages
    cond: str | None
    while_loop: str | None
    switch: str | None

    def missing(self, op: str) -> str | None:
        """What is missing for ``op`` (``"cond"``, ``"while_loop"``, ``"switch"``)."""
        return getattr(self, op, "an operator accel-graph does not capture natively")

    def refusal(self, op: str, device: object) -> CaptureError:
        """The error raised when ``op`` is called inside a capture on ``device``."""
        return CaptureError(
            f"torch.{op} cannot be captured into a {self.kind} graph on {device} with torch "
            f"{torch.__version__}: {self.missing(op)}. {RECORDER_HINT}"
        )


def summary(support: ControlFlowSupport) -> str:
    """One line for ``doctor``: per operator, captured or what is missing."""
    return "; ".join(f"{op}: {'captured natively' if not why else 'CaptureError (' + why + ')'}"
                     for op, why in (("cond", support.cond), ("while_loop", support.while_loop)))


def _parse_version(text: object) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None


def _driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the driver supports, where this torch exposes it (else None)."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        return None
    try:
        v = int(get())
    except Exception:
        return None
    return (v // 1000, (v % 1000) // 10) if v > 0 else None


def _missing_methods(cls: Any, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not hasattr(cls, n)]


def detect_support(backend_name: str, module_name: str, module: Any) -> ControlFlowSupport:
    """Feature-detect what the native backend ``backend_name`` (vendor module ``module``,
    ``torch.<module_name>``) can capture. Never touches a device; cheap (called per capture);
    never raises (it runs right after torch's capture began): a failure refuses everything."""
    try:
        return _detect(backend_name, module_name, module)
    except Exception as exc:  # an odd torch build: refuse rather than guess
        why = f"detecting conditional-node support failed ({type(exc).__name__}: {exc})"
        return ControlFlowSupport(backend_name, module_name.upper(), why, why, why)


def _detect(backend_name: str, module_name: str, module: Any) -> ControlFlowSupport:
    hip = getattr(getattr(torch, "version", None), "hip", None)
    if module_name != "cuda":
        why = (f"torch.{module_name} graphs have no conditional nodes (torch's conditional-node "
               f"capture, {TORCH_MODULE}, drives torch.cuda.CUDAGraph only)")
        return ControlFlowSupport(backend_name, module_name.upper(), why, why, why)
    if hip:
        why = (f"ROCm builds of torch have no conditional-node capture (HIP graphs have no "
               f"conditional nodes; torch.cuda.CUDAGraph.begin_capture_to_if_node errors on "
               f"ROCm {hip}; hip quirk no-conditional-nodes)")
        return ControlFlowSupport(backend_name, "HIP", why, why, why)
    api = torch_module()
    graph_cls = getattr(module, "CUDAGraph", None)
    cond = _cond_missing(api, graph_cls)
    while_ = cond or _extra_missing(api, graph_cls, "while_loop_node", WHILE_METHODS,
                                    "torch's while-node capture (torch 2.14+)")
    switch = cond or _extra_missing(api, graph_cls, "switch_node", SWITCH_METHODS,
                                    "torch's switch-node capture (in no torch release yet)")
    if not hasattr(torch, "switch") and not hasattr(torch.ops.higher_order, "switch"):
        switch = f"this torch has no torch.switch; {switch}" if switch else None
    return ControlFlowSupport(backend_name, "CUDA", cond, while_, switch)


def _cond_missing(api: Any, graph_cls: Any) -> str | None:
    if api is None or not hasattr(api, "if_else_node"):
        return f"this torch has no conditional-node capture ({TORCH_MODULE}.if_else_node)"
    if graph_cls is None:
        return "torch.cuda.CUDAGraph is missing"
    lacking = _missing_methods(graph_cls, IF_METHODS)
    if lacking:
        return f"torch.cuda.CUDAGraph lacks {', '.join(lacking)} (conditional-node capture)"
    built = _parse_version(getattr(torch.version, "cuda", None))
    if built is not None and built < MIN_CUDA:
        return (f"this torch was built with CUDA {built[0]}.{built[1]}; conditional nodes need "
                f"CUDA {MIN_CUDA[0]}.{MIN_CUDA[1]}+")
    driver = _driver_cuda_version()
    if driver is not None and driver < MIN_CUDA:
        return (f"the NVIDIA driver supports CUDA {driver[0]}.{driver[1]}; conditional nodes "
                f"need a driver for CUDA {MIN_CUDA[0]}.{MIN_CUDA[1]}+")
    return None


def _extra_missing(api: Any, graph_cls: Any, fn: str, methods: tuple[str, ...],
                   what: str) -> str | None:
    lacking = ([] if hasattr(api, fn) else [f"{TORCH_MODULE}.{fn}"])
    lacking += [f"torch.cuda.CUDAGraph.{m}" for m in _missing_methods(graph_cls, methods)]
    return f"it needs {what}, and this build lacks {', '.join(lacking)}" if lacking else None


def python_level_refusal(op: str, target: str) -> str | None:
    """Why ``op`` cannot be captured natively on device type ``target`` with this torch
    *version*, judged from its Python API alone (the same in every build of it, so a CPU box
    can tell): None when some build could capture it. Used by ``check_capturable(target=)``."""
    if target in ("cpu", "meta"):
        return None
    if target != "cuda":
        return (f"torch.{op} cannot be captured into a {target} graph: torch's conditional-node "
                f"capture drives CUDA graphs only")
    api = torch_module()
    need = {"cond": "if_else_node", "while_loop": "while_loop_node", "switch": "switch_node"}.get(op)
    if need is None or (api is not None and hasattr(api, need)):
        return None
    return (f"torch {torch.__version__} cannot capture torch.{op} into a CUDA graph ({TORCH_MODULE} "
            f"has no {need}); the recorder (device='cpu') can")
