"""How ``accel_graph.Graph`` differs from torch's graph classes: the one table of intended
differences, and the signature comparison that finds every other one (drift).

``accel_graph.Graph`` mirrors ``torch.accelerator.Graph`` of torch 2.14.1 (the same in 2.12 and
2.13; absent in 2.11) member for member: every public method, every parameter with its kind,
position and default. ``torch.cuda.CUDAGraph`` is compared where it is useful: the members both
classes have, and the methods it has that ``Graph`` does not. :data:`GRAPH_API_DIFFERENCES` lists
each difference that is meant; ``tests/test_graph_api.py`` introspects the installed torch with
:func:`api_drift` and fails on any drift the table does not list, and on a table that disagrees
with the one in docs/torch-api.md (:func:`differences_markdown` renders it).

Nothing here imports torch: the classes are arguments.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACCELERATOR_GRAPH",
    "CUDA_GRAPH",
    "GRAPH_API_DIFFERENCES",
    "Drift",
    "api_drift",
    "differences_markdown",
    "public_members",
    "stale_differences",
]

ACCELERATOR_GRAPH = "torch.accelerator.Graph"
CUDA_GRAPH = "torch.cuda.CUDAGraph"

_PER_GRAPH_HOOK = (
    "per-graph hooks are not offered: register the module-level accel_graph."
    "register_graph_{}_hook and compare its graph argument"
)
_RAW = "a CUDA handle; the recorder has none. Native backends keep torch's graph to themselves"

#: Intended differences, ``(torch class, subject) -> what accel_graph.Graph does instead``.
#: A subject is ``"member"`` (a method torch has that Graph lacks), ``"member(param)"`` (a
#: parameter missing, extra, or of another kind, position or default) or ``"member: topic"`` (a
#: behaviour the signatures do not show). ``constructor`` is the class call.
GRAPH_API_DIFFERENCES: dict[tuple[str, str], str] = {
    (ACCELERATOR_GRAPH, "constructor(device)"):
        "extra keyword-only device=None: the device to capture on; None follows the routing "
        "rules (ACCEL_GRAPH_BACKEND, then the current accelerator, then the CPU recorder)",
    (ACCELERATOR_GRAPH, "constructor(compile)"):
        "extra keyword-only compile=None: 'inductor' compiles the recorder's replay program "
        "(native backends ignore it with a warning)",
    (ACCELERATOR_GRAPH, "constructor(compile_options)"):
        "extra keyword-only compile_options=None: options of compiled replay (with compile= only)",
    (ACCELERATOR_GRAPH, "capture_begin(pool)"):
        "extra optional pool=None, as torch.cuda.CUDAGraph.capture_begin: overrides the "
        "graph_pool attribute for this capture; None uses the attribute",
    (ACCELERATOR_GRAPH, "capture_begin(capture_error_mode)"):
        "extra optional capture_error_mode=None, as torch.cuda.CUDAGraph.capture_begin: "
        "overrides the capture_error_mode attribute for this capture; None uses the attribute",
    (ACCELERATOR_GRAPH, "__enter__: return value"):
        "returns the graph (torch returns None), so `with Graph() as g:` works too",
    (ACCELERATOR_GRAPH, "__exit__: body raised"):
        "drops the capture and leaves the graph empty and reusable (torch calls capture_end() "
        "either way)",
    (ACCELERATOR_GRAPH, "pool: return value"):
        "a PoolHandle (torch: a (int, int) tuple); pool= also takes torch's tuples and MemPools "
        "on native backends",
    (ACCELERATOR_GRAPH, "instantiate: again"):
        "a second instantiate() of an instantiated keep_graph=True graph does nothing and fires "
        "no instantiate hook (torch instantiates a fresh executable)",
    (ACCELERATOR_GRAPH, "device: extra attribute"):
        "the torch.device the graph captures on, usable where torch takes a device "
        "(torch.zeros(2, device=g.device)); torch's class has none (it captures on the current "
        "device). Graph.device_spec is the backend's DeviceSpec (backend name, arch), which "
        "g.backend's methods take",
    (CUDA_GRAPH, "capture_begin(capture_error_mode)"):
        "default None, which uses the graph's capture_error_mode ('default' unless set): "
        "torch.cuda.CUDAGraph's default is 'global', which 'default' maps to on CUDA and ROCm",
    (CUDA_GRAPH, "capture_begin(check_input_liveness)"):
        "not offered: the recorder checks its inputs itself; torch's tracker is CUDA-only",
    (CUDA_GRAPH, "debug_dump(debug_path)"):
        "named path, as torch.accelerator.Graph.debug_dump; pass it positionally for both",
    (CUDA_GRAPH, "debug_dump(verbose)"):
        "not offered: native backends write torch's default (verbose) DOT; the recorder writes "
        "its own DOT and JSON",
    (CUDA_GRAPH, "capture_end_pre"): "not offered: capture_end() ends and finalises in one step; "
        "a capture-end hook runs after both",
    (CUDA_GRAPH, "capture_end_post"): "not offered, with capture_end_pre",
    (CUDA_GRAPH, "pools"): "not offered: a graph has one pool, pool(); "
        "accel_graph.backends' pool_stats describes it",
    (CUDA_GRAPH, "raw_cuda_graph"): _RAW,
    (CUDA_GRAPH, "raw_cuda_graph_exec"): _RAW,
    (CUDA_GRAPH, "get_graph_data"): "not offered: debug_dump writes the recorder's program as "
        "DOT and JSON, and torch's DOT on native backends",
    (CUDA_GRAPH, "register_capture_start_hook"): _PER_GRAPH_HOOK.format("capture_start"),
    (CUDA_GRAPH, "register_capture_end_hook"): _PER_GRAPH_HOOK.format("capture_end"),
    (CUDA_GRAPH, "register_post_instantiate_hook"): _PER_GRAPH_HOOK.format("instantiate"),
    (CUDA_GRAPH, "register_replay_start_hook"): _PER_GRAPH_HOOK.format("replay_start"),
    (CUDA_GRAPH, "register_replay_end_hook"): _PER_GRAPH_HOOK.format("replay_end"),
    (CUDA_GRAPH, "register_destroy_callback"): "not offered: register_graph_destroy_hook hears "
        "every graph's destroy with its exec ids (Graph.exec_id)",
    (CUDA_GRAPH, "retain_object"): "not offered: keep the object referenced yourself until "
        "reset() or the destroy hook",
    (CUDA_GRAPH, "begin_capture_to_if_node"): "internal to torch.cond capture: Graph captures "
        "torch.cond and torch.while_loop itself (conditional nodes on CUDA, sub-programs on the "
        "recorder)",
    (CUDA_GRAPH, "begin_capture_to_while_node"): "internal to torch.while_loop capture, as "
        "begin_capture_to_if_node",
    (CUDA_GRAPH, "end_capture_to_conditional_node"): "internal to conditional-node capture, as "
        "begin_capture_to_if_node",
    (CUDA_GRAPH, "set_conditional_handle_for_current_node"): "internal to conditional-node "
        "capture, as begin_capture_to_if_node",
    (CUDA_GRAPH, "get_currently_capturing_graph"): "internal to conditional-node capture; "
        "accel_graph.is_current_stream_capturing() answers whether a capture is underway",
}


@dataclass(frozen=True)
class Drift:
    """One way ``Graph`` differs from a torch class: ``subject`` as in
    :data:`GRAPH_API_DIFFERENCES`, ``what`` in words."""

    reference: str
    subject: str
    what: str

    def __str__(self) -> str:
        return f"{self.reference} {self.subject}: {self.what}"


#: Dunder members compared besides the public ones: the block protocol.
_PROTOCOL = ("__enter__", "__exit__")


def public_members(cls: type) -> list[str]:
    """The members compared: ``constructor``, callable public names, ``__enter__``/``__exit__``."""
    names = ["constructor"]
    for name in sorted(dir(cls)):
        if (not name.startswith("_") or name in _PROTOCOL) and callable(getattr(cls, name, None)):
            names.append(name)
    return names


def _signature(cls: type, member: str) -> inspect.Signature | None:
    """The signature of ``member`` without ``self`` (None: a C method that has none)."""
    try:
        if member == "constructor":
            return inspect.signature(cls)
        sig = inspect.signature(getattr(cls, member))
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if isinstance(inspect.getattr_static(cls, member), (staticmethod, classmethod)):
        return sig  # no self to drop (a classmethod read off the class is bound already)
    return sig.replace(parameters=params[1:])  # self


def _same_default(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or (type(a) is type(b) and a == b))
    except Exception:  # an exotic default that cannot be compared: call it different
        return False


def _positions(sig: inspect.Signature) -> dict[str, int]:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: i for i, p in enumerate(q for q in sig.parameters.values() if q.kind in positional)}


def _param_drift(ref: str, member: str, ours: inspect.Signature, theirs: inspect.Signature,
                 extras: bool) -> list[Drift]:
    out: list[Drift] = []
    pos_o, pos_t = _positions(ours), _positions(theirs)
    for name, p in theirs.parameters.items():
        subject = f"{member}({name})"
        q = ours.parameters.get(name)
        if q is None:
            out.append(Drift(ref, subject, f"torch has parameter {p}; Graph has none"))
            continue
        if q.kind != p.kind:
            out.append(Drift(ref, subject, f"kind {q.kind.description}, torch {p.kind.description}"))
        elif pos_o.get(name) != pos_t.get(name):
            out.append(Drift(ref, subject, f"position {pos_o.get(name)}, torch {pos_t.get(name)}"))
        if not _same_default(q.default, p.default):
            out.append(Drift(ref, subject, f"default {q.default!r}, torch {p.default!r}"))
    if extras:
        for name, q in ours.parameters.items():
            if name not in theirs.parameters:
                out.append(Drift(ref, f"{member}({name})", f"Graph has extra parameter {q}"))
    return out


def api_drift(ours: type, theirs: type, reference: str, *, extras: bool = True,
              shared_only: bool = False) -> list[Drift]:
    """Every signature difference of ``ours`` from ``theirs`` (named ``reference``): a public
    method of theirs that ours lacks (unless ``shared_only``), and for each member both have
    a parameter missing, of another kind, position or default, or (with ``extras``) a parameter
    only ours has. Members whose signature cannot be read (C methods) compare by name only."""
    drift: list[Drift] = []
    mine = set(public_members(ours))
    for member in public_members(theirs):
        if member not in mine:
            if not shared_only:
                drift.append(Drift(reference, member, "torch has this method; Graph has not"))
            continue
        sig_t, sig_o = _signature(theirs, member), _signature(ours, member)
        if sig_t is None or sig_o is None:
            continue
        drift.extend(_param_drift(reference, member, sig_o, sig_t, extras))
    return drift


def stale_differences(ours: type, theirs: type, reference: str, *, extras: bool = True,
                      shared_only: bool = False) -> list[str]:
    """Subjects of :data:`GRAPH_API_DIFFERENCES` for ``reference`` that no longer differ: the
    entry's member and parameter exist here (in ``theirs``, or in ``ours`` for an extra one
    when ``extras``) and :func:`api_drift` finds nothing about it. Entries about what this
    torch lacks (another release's members) and behaviour entries (``"member: topic"``) are not
    judged."""
    found = {d.subject for d in api_drift(ours, theirs, reference, extras=extras,
                                          shared_only=shared_only)}
    members_t = set(public_members(theirs))
    stale = []
    for ref, subject in GRAPH_API_DIFFERENCES:
        if ref != reference or ":" in subject or subject in found:
            continue
        member, _, param = subject.partition("(")
        if member not in members_t:
            continue
        if param:
            param = param.rstrip(")")
            sig_t, sig_o = _signature(theirs, member), _signature(ours, member)
            in_t = sig_t is not None and param in sig_t.parameters
            in_o = extras and sig_o is not None and param in sig_o.parameters
            if not (in_t or in_o):
                continue
        stale.append(subject)
    return stale


def differences_markdown(table: dict[tuple[str, str], str] | None = None) -> str:
    """:data:`GRAPH_API_DIFFERENCES` as the markdown table of docs/torch-api.md."""
    table = GRAPH_API_DIFFERENCES if table is None else table
    lines = ["| torch class | member | accel_graph.Graph |", "|---|---|---|"]
    for (ref, subject), why in table.items():
        lines.append(f"| `{ref}` | `{subject}` | {why} |")
    return "\n".join(lines) + "\n"
