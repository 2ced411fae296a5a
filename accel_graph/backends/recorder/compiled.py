"""Compiled replay: the recorded aten program handed to Inductor once, at instantiation.

The program becomes an FX graph whose placeholders are the tensors captured by reference
(inputs, parameters, constants) followed by the graph's static outputs; it keeps the view ops
interpreted replay drops, so Inductor sees how every view relates to its base. The graph ends
with ``copy_`` of each output value into its static output placeholder, which Inductor fuses
into the kernel that produces it, and in-place writes to inputs become input mutations, which
Inductor writes back into the caller's tensors. So compiled replay has the semantics of
interpreted replay: inputs read and written in place, outputs in the same static memory.
Inductor's own intermediates are allocated per call, outside the graph's pool.

Known traps, handled here: ``compile_fx`` mutates the GraphModule it is given (we pass a copy
and keep the original for the fallback), its result is called unboxed although it says it is boxed, and
it needs a C++ compiler at run time (without one compilation fails and replay falls back to the
interpreted program, with the reason logged). The result is called unboxed (``f(*args)``). Random ops are compiled with
``fallback_random=True`` so draws equal eager's after the same seed.
"""

from __future__ import annotations

import copy
import logging
import operator
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .capture import InputRecord, Step, tree_map
from .pool import PoolRef, RecorderPool

log = logging.getLogger("accel_graph")

aten = torch.ops.aten


class CompileUnsupported(Exception):
    """The program has a shape the FX translation does not handle (falls back, logged)."""


def build_fx(steps: list[Step], outputs: list[PoolRef]) -> tuple[fx.GraphModule, list[torch.Tensor], list[PoolRef]]:
    """The FX graph of a captured program.

    Returns the GraphModule, the tensors captured by reference (its leading placeholders, in
    order) and the output locations (its trailing placeholders, written with ``copy_``).
    """
    graph = fx.Graph()
    ext_nodes: dict[int, fx.Node] = {}
    ext_tensors: list[torch.Tensor] = []
    by_ref: dict[PoolRef, fx.Node] = {}
    # Latest whole allocation written at each (segment, offset): base for views we never saw.
    allocations: dict[tuple[int, int], tuple[PoolRef, fx.Node]] = {}

    placeholders: list[fx.Node] = []

    def external(t: torch.Tensor) -> fx.Node:
        node = ext_nodes.get(id(t))
        if node is None:
            node = graph.placeholder(f"in{len(ext_tensors)}")
            ext_nodes[id(t)] = node
            placeholders.append(node)
            ext_tensors.append(t)
        return node

    def resolve(ref: PoolRef) -> fx.Node:
        node = by_ref.get(ref)
        if node is not None:
            return node
        for (seg, off), (base_ref, base_node) in allocations.items():
            itemsize = base_ref.dtype.itemsize
            if seg == ref.segment and base_ref.dtype == ref.dtype and off <= ref.byte_offset:
                delta = ref.byte_offset - off
                if delta % itemsize == 0:
                    return graph.call_function(
                        aten.as_strided.default, (base_node, list(ref.shape), list(ref.stride), delta // itemsize)
                    )
        raise CompileUnsupported(f"no producer for pool location {ref}")

    def arg(x: Any) -> Any:
        if isinstance(x, PoolRef):
            return resolve(x)
        if isinstance(x, torch.Tensor):
            return external(x)
        return x

    for step in steps:
        args = tree_map(arg, step.args)
        kwargs = tree_map(arg, step.kwargs)
        if step.kind == "mutate":
            graph.call_function(step.func, tuple(args), kwargs)
            continue
        node = graph.call_function(step.func, tuple(args), kwargs)
        n_results = len(step.func._schema.returns)
        is_list = n_results == 1 and isinstance(step.func._schema.returns[0].type, torch.ListType)
        for pos, out in zip(step.positions, step.outputs):
            value = node if (n_results == 1 and not is_list) else graph.call_function(operator.getitem, (node, pos))
            if isinstance(out, PoolRef):
                by_ref[out] = value
                if step.kind != "view":
                    allocations[(out.segment, out.byte_offset)] = (out, value)
            else:  # a view of an input, made during capture
                ext_nodes[id(out)] = value
    out_nodes = []
    for ref in outputs:
        value = resolve(ref)
        static = graph.placeholder(f"out{len(out_nodes)}")
        graph.call_function(aten.copy_.default, (static, value))
        out_nodes.append(static)
    # Placeholders must lead the graph, inputs first then outputs, in the order of the call.
    anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if anchor is not None:
        for n in placeholders + out_nodes:
            anchor.prepend(n)
    graph.output(())
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph), ext_tensors, outputs


def compile_program(
    steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef], pool: RecorderPool
) -> tuple[Callable[[], None], dict[str, Any]]:
    """Compile with Inductor. Returns ``(replay_fn, info)``; raises on any failure."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    t0 = time.perf_counter()
    gm, ext, out_refs = build_fx(steps, outputs)
    statics = [pool.materialize(r) for r in out_refs]
    example = [*ext, *statics]
    with torch.no_grad(), inductor_config.patch(fallback_random=True):
        compiled = compile_fx(copy.deepcopy(gm), example)
    compile_s = time.perf_counter() - t0
    args = tuple(example)

    # compile_fx's result for a plain GraphModule is called unboxed, f(*args), even though it
    # carries _boxed_call=True (calling it with a list fails inside the AOT runtime wrapper).
    def run() -> None:
        compiled(*args)

    info = {
        "backend": "inductor",
        "compile_s": compile_s,
        "fx_nodes": len(gm.graph.nodes),
        "placeholders": len(example),
        "intermediates": "allocated per call by Inductor, outside the graph's pool",
    }
    return run, info
