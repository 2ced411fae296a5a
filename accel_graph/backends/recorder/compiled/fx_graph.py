"""The recorded aten program as an FX graph, for Inductor (:mod:`.inductor` compiles it).

The graph's placeholders are the tensors captured by reference (inputs, parameters, constants)
followed by the graph's static outputs; it keeps the view ops interpreted replay drops, so
Inductor sees how every view relates to its base. It ends with ``copy_`` of each output value
into its static output placeholder, which Inductor fuses into the kernel that produces it, and
in-place writes to inputs become input mutations, which Inductor writes back into the caller's
tensors. Collectives become functional collectives waited for at once. A program this
translation does not handle raises :class:`CompileUnsupported` (the graph then replays
interpreted, with the reason logged).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...capture_common.pytree import tree_map
from .. import collectives
from ..pool_protocol import PoolRef
from ..steps import Step
from .freezing import FrozenConstants

__all__ = ["STEP_META", "CompileUnsupported", "build_fx"]

aten = torch.ops.aten

#: ``node.meta`` key of an op's node: the index of its step in the ``steps`` given to
#: :func:`build_fx` (not part of any cache key; FX node names are, and are deterministic).
STEP_META = "accel_graph_step"


class CompileUnsupported(Exception):
    """The program has a shape the FX translation does not handle (falls back, logged)."""


def _extent(ref: PoolRef) -> int:
    """Bytes from ``ref.byte_offset`` to the end of the last element ``ref`` can address."""
    if any(n == 0 for n in ref.shape):
        return 0
    return (sum((n - 1) * st for n, st in zip(ref.shape, ref.stride, strict=True)) + 1) * ref.dtype.itemsize


def _same_elements_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that address exactly the same elements the same way."""
    return ("elements", t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.device, t.is_conj(), t.is_neg(), t.requires_grad)


def build_fx(steps: list[Step], outputs: list[PoolRef], frozen: FrozenConstants | None = None
             ) -> tuple[fx.Graph, list[torch.Tensor], list[PoolRef]]:
    """The FX graph of a captured program.

    Returns the graph (a plain ``fx.Graph``: wrapping it in a GraphModule generates Python source
    that torch.fx keeps in its loader and ``linecache`` forever, about 0.8 KB a module, so that is
    done only when Inductor must compile it), the tensors captured by reference (its leading placeholders, in
    order) and the output locations (its trailing placeholders, written with ``copy_``). Among the
    leading placeholders, pool locations no step of this program produced (outputs of an earlier
    graph in a shared pool) appear as their :class:`PoolRef`; the caller materializes them.
    With ``frozen``, the tensors it accepts (:mod:`.freezing`) become ``get_attr`` constants
    instead of placeholders, collected in ``frozen.tensors``.
    """
    graph = fx.Graph()
    ext_nodes: dict[int, fx.Node] = {}
    ext_tensors: list[Any] = []  # tensors captured by reference, and PoolRefs of pool inputs
    by_ref: dict[PoolRef, fx.Node] = {}
    pool_inputs: dict[PoolRef, fx.Node] = {}
    # Whole allocations of this program, newest last: bases for views we never saw (in-place
    # view ops such as t_() and unsqueeze_() are not recorded).
    allocations: dict[tuple[int, int], tuple[PoolRef, fx.Node]] = {}

    placeholders: list[fx.Node] = []

    def external(t: torch.Tensor) -> fx.Node:
        node = ext_nodes.get(id(t))
        if node is None:
            # Two tensor objects over the very same elements (two equal views kept alive) are
            # one placeholder: as two, AOT autograd did not order a read of one after an
            # in-place write through the other (compiled replay read the written value).
            node = ext_nodes.get(_same_elements_key(t))
            if node is not None:
                ext_nodes[id(t)] = node
        if node is None and frozen is not None:
            name = frozen.add(t)
            if name is not None:
                node = ext_nodes[id(t)] = graph.get_attr(name)
        if node is None:
            node = graph.placeholder(f"in{len(ext_tensors)}")
            ext_nodes[id(t)] = ext_nodes[_same_elements_key(t)] = node
            placeholders.append(node)
            ext_tensors.append(t)
        return node

    def resolve(ref: PoolRef) -> fx.Node:
        node = by_ref.get(ref)
        if node is not None:
            return node
        # The newest allocation that contains every byte ``ref`` addresses: an older one at an
        # overlapping place died before the newer one took its memory.
        for (seg, off), (base_ref, base_node) in reversed(allocations.items()):
            itemsize = base_ref.dtype.itemsize
            if seg != ref.segment or off > ref.byte_offset:
                continue
            if ref.byte_offset + _extent(ref) > off + _extent(base_ref):
                continue
            delta = ref.byte_offset - off
            if base_ref.dtype != ref.dtype or delta % itemsize:
                raise CompileUnsupported(f"pool location {ref} reinterprets {base_ref}")
            return graph.call_function(
                aten.as_strided.default, (base_node, list(ref.shape), list(ref.stride), delta // itemsize)
            )
        # Produced by no step here: memory of an earlier graph in the same pool, read (or
        # written) in place like a tensor captured by reference.
        node = pool_inputs.get(ref)
        if node is None:
            node = graph.placeholder(f"in{len(ext_tensors)}")
            pool_inputs[ref] = node
            placeholders.append(node)
            ext_tensors.append(ref)
        return node

    def arg(x: Any) -> Any:
        if isinstance(x, PoolRef):
            return resolve(x)
        if isinstance(x, torch.Tensor):
            return external(x)
        if isinstance(x, torch.Generator):
            raise CompileUnsupported(
                "a random op draws from an explicit generator (generator=...), which an FX graph "
                "cannot carry as an argument")
        return x

    for index, step in enumerate(steps):
        if step.kind == "host":
            raise CompileUnsupported(
                f"{step.func}: a generator-state step ({step.strategy.why if step.strategy else 'host call'}) "
                f"is a Python call between kernels, which an FX graph cannot order against Inductor's "
                f"random kernels")
        if step.kind in ("cond", "while"):  # segmented.py runs these between compiled stretches
            raise CompileUnsupported(
                f"control flow ({step.func}) is replayed by the interpreter: its predicate is read "
                f"on the host at replay"
            )
        if step.grad:
            # Inductor runs the kernel as its meta kernel describes it, and not under the grad
            # mode this kernel's outputs depend on (mkldnn_rnn_layer's workspace with grad on).
            raise CompileUnsupported(f"{step.func} depends on grad mode, which Inductor does not keep")
        args = tree_map(arg, step.args)
        kwargs = tree_map(arg, step.kwargs)
        if step.kind == "collective":
            _collective_node(graph, step, args, kwargs, by_ref, allocations)
            continue
        if step.kind == "mutate":
            graph.call_function(step.func, tuple(args), kwargs).meta[STEP_META] = index
            continue
        func = step.func
        if func is aten.lift_fresh.default:
            # A constant made in the capture (torch.tensor(...)): lift_fresh returns its argument,
            # the private source copy, which in-place writes to the constant would then change
            # for every later replay. Interpreted replay refills the constant with copy_(); so do we.
            func = aten.clone.default
        node = graph.call_function(func, tuple(args), kwargs)
        node.meta[STEP_META] = index  # which step a failure names (.op_islands.locate)
        n_results = len(step.func._schema.returns)
        is_list = n_results == 1 and isinstance(step.func._schema.returns[0].type, torch.ListType)
        for pos, out in zip(step.positions, step.outputs):
            value = node if (n_results == 1 and not is_list) else graph.call_function(operator.getitem, (node, pos))
            if isinstance(out, PoolRef):
                by_ref[out] = value
                if step.kind != "view":
                    key = (out.segment, out.byte_offset)
                    allocations.pop(key, None)  # re-inserted last: the newest at this place
                    allocations[key] = (out, value)
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
    return graph, ext_tensors, outputs


def _collective_node(graph: fx.Graph, step: Step, args: Any, kwargs: Any,
                     by_ref: dict[PoolRef, fx.Node], allocations: dict) -> None:
    """A collective as Inductor expects it: a functional op, then ``wait_tensor`` of each result.
    c10d in-place ops (``dist.all_reduce``, ...; their process group is a script object Inductor
    does not take) become their functional twin plus a ``copy_`` back into the tensor they
    mutate, where :func:`..collectives.as_functional` knows one; others are not compiled."""
    functional = collectives.as_functional(step.func, args, kwargs)
    if functional is not None:
        # An in-place c10d op as its functional twin, waited for and copied back into the
        # tensor it mutates (AOT functionalization refuses the in-place functional ops).
        op, fargs, target = functional
        value = graph.call_function(torch.ops._c10d_functional.wait_tensor.default,
                                    (graph.call_function(op, fargs),))
        graph.call_function(aten.copy_.default, (target, value))
        return
    if collectives.role(step.func) != collectives.ISSUE:
        raise CompileUnsupported(
            f"{step.func} is an in-place collective without a functional equivalent here (only "
            f"single-tensor all_reduce, broadcast, all_gather_into_tensor and "
            f"reduce_scatter_tensor are translated); use the functional collectives "
            f"(torch.distributed._functional_collectives) for compiled replay"
        )
    wait = torch.ops._c10d_functional.wait_tensor.default
    node = graph.call_function(step.func, tuple(args), kwargs)
    single = isinstance(step.func._schema.returns[0].type, torch.TensorType)
    for pos, out in zip(step.positions, step.outputs):
        value = node if single else graph.call_function(operator.getitem, (node, pos))
        value = graph.call_function(wait, (value,))
        by_ref[out] = value
        key = (out.segment, out.byte_offset)
        allocations.pop(key, None)
        allocations[key] = (out, value)
