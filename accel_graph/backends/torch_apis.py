"""Which of torch's graph APIs the installed torch has, read from the real modules.

What the native backends can use depends on the torch *build* (and on the device), and torch
versions add these APIs one by one: conditional nodes (``cudagraph_conditional_nodes``), the
``while_loop`` node, ``torch.cuda.make_graphed_callables``, 2.14's graph lifecycle hooks. This
module answers by looking (``hasattr`` on the live modules, never the version string), so the
answer is right on every build, including CPU and GPU-less CUDA builds, where the Python API
exists without a device. ``accel-graph doctor`` reports it under ``graph_apis``.

Reading imports ``torch._higher_order_ops.cudagraph_conditional_nodes`` (pure Python, present in
CPU builds too); it touches no device. Never raises: an API whose lookup fails is reported absent
with the error.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["CONDITIONAL_NODES", "GRAPH_HOOKS", "graph_api_presence"]

#: torch's conditional-node capture module.
CONDITIONAL_NODES = "torch._higher_order_ops.cudagraph_conditional_nodes"
#: The graph lifecycle hooks of ``torch.cuda.graphs`` (new in torch 2.14).
GRAPH_HOOKS = (
    "register_graph_capture_start_hook",
    "register_graph_capture_end_hook",
    "register_graph_instantiate_hook",
    "register_graph_replay_start_hook",
    "register_graph_replay_end_hook",
    "register_graph_destroy_hook",
)
#: ``torch.cuda.CUDAGraph`` methods each conditional-node kind drives (read off torch's
#: ``cudagraph_conditional_nodes``: 2.13 has the if-node ones, 2.14 adds the while-node ones).
IF_NODE_METHODS = ("get_currently_capturing_graph", "begin_capture_to_if_node",
                   "end_capture_to_conditional_node")
WHILE_NODE_METHODS = ("begin_capture_to_while_node", "set_conditional_handle_for_current_node")


def _resolve(path: str) -> tuple[Any, str | None]:
    """The object at dotted ``path`` under ``torch`` (importing submodules as needed), or
    ``(None, why)``. Never raises."""
    parts = path.split(".")
    obj: Any = torch
    for i, name in enumerate(parts[1:], start=1):
        nxt = getattr(obj, name, None)
        if nxt is None:
            try:  # a submodule torch does not import eagerly
                nxt = importlib.import_module(".".join(parts[: i + 1]))
            except Exception as exc:
                missing = isinstance(exc, ImportError)
                why = None if missing else f"{type(exc).__name__}: {exc}"
                return None, why
        obj = nxt
    return obj, None


def _entry(path: str) -> dict[str, Any]:
    obj, error = _resolve(path)
    return {"present": obj is not None, "error": error}


def graph_api_presence() -> dict[str, dict[str, Any]]:
    """Every graph API of interest, by its full name: ``{"present": bool, "error": str|None}``.

    Names: ``torch.accelerator.Graph``, ``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``,
    ``torch.cuda.make_graphed_callables``, the ``if_else_node``/``while_loop_node`` builders of
    the conditional-node module, the ``CUDAGraph`` methods they drive, and the six
    ``torch.cuda.graphs.register_graph_*_hook`` functions. Plus two summaries:
    ``cond capture (if nodes)`` and ``while_loop capture (while nodes)``, present when the
    builder and every method it drives are (the build may still lack the CUDA version or the
    device: the backends' control-flow support says that).
    """
    names = [
        "torch.accelerator.Graph",
        "torch.cuda.CUDAGraph",
        "torch.xpu.XPUGraph",
        "torch.cuda.make_graphed_callables",
        f"{CONDITIONAL_NODES}.if_else_node",
        f"{CONDITIONAL_NODES}.while_loop_node",
        *(f"torch.cuda.CUDAGraph.{m}" for m in (*IF_NODE_METHODS, *WHILE_NODE_METHODS)),
        *(f"torch.cuda.graphs.{h}" for h in GRAPH_HOOKS),
    ]
    out = {name: _entry(name) for name in names}

    def all_present(*keys: str) -> dict[str, Any]:
        missing = [k for k in keys if not out[k]["present"]]
        return {"present": not missing, "error": None, "missing": missing}

    out["cond capture (if nodes)"] = all_present(
        f"{CONDITIONAL_NODES}.if_else_node", *(f"torch.cuda.CUDAGraph.{m}" for m in IF_NODE_METHODS)
    )
    out["while_loop capture (while nodes)"] = all_present(
        f"{CONDITIONAL_NODES}.while_loop_node",
        *(f"torch.cuda.CUDAGraph.{m}" for m in ("get_currently_capturing_graph", *WHILE_NODE_METHODS,
                                               "end_capture_to_conditional_node")),
    )
    return out
