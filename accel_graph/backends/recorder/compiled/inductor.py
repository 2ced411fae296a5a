"""Compiled replay: the recorded aten program handed to Inductor once, at instantiation.

The program becomes an FX graph whose placeholders are the tensors captured by reference
(inputs, parameters, constants) followed by the graph's static outputs; it keeps the view ops
interpreted replay drops, so Inductor sees how every view relates to its base. The graph ends
with ``copy_`` of each output value into its static output placeholder, which Inductor fuses
into the kernel that produces it, and in-place writes to inputs become input mutations, which
Inductor writes back into the caller's tensors. So compiled replay has the semantics of
interpreted replay: inputs read and written in place, outputs in the same static memory.
Inductor's own intermediates are allocated per call, outside the graph's pool.

Known traps, handled here: ``compile_fx`` mutates the GraphModule it is given (it gets one made
for it, used for nothing else), its result is called unboxed although it says it is boxed, and
it needs a C++ compiler at run time (without one compilation fails and replay falls back to the
interpreted program, with the reason logged). The result is called unboxed (``f(*args)``). Random ops are compiled with
``fallback_random=True`` so draws equal eager's after the same seed.

Compiled modules are cached process-wide by *program*, not by capture (:func:`program_key`): two
captures with the same ops, constants and input/output layout (shape, stride, dtype, device,
storage offset, which placeholders share a storage, alignment) reuse one module, called with each
graph's own tensors. Without it every capture/replay/reset cycle recompiled and torch's code cache
kept every module (40-55 KB a cycle). The cache is an LRU of :data:`COMPILE_CACHE_SIZE` entries:
an evicted module lives on in the graphs that use it and is compiled again when next needed.
Across processes, Inductor's own FX graph cache on disk serves programs compiled before;
``compile_info()["reuse"]`` says which cache served each program (:mod:`.compile_cache`).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import collectives
from ..capture import InputRecord, Step
from ..pool_protocol import GraphPool, PoolRef, refs_overlap
from ..pytree import tree_map
from . import settings as compile_settings
from .cache import static_kwargs, static_tracing, watch_fx_graph_cache
from .freezing import FrozenConstants

log = logging.getLogger("accel_graph")

aten = torch.ops.aten

# Inductor's compile_fx is not thread-safe (module-level config patching: two threads compiling
# at once fail with "CURRENT_PATCHER is None"), and graphs captured in different threads are
# instantiated in those threads: compilations take turns.
_COMPILE_LOCK = threading.Lock()

#: Compiled modules kept for reuse by identical programs (least recently used evicted first).
COMPILE_CACHE_SIZE = 64

# program key -> (compiled callable, objects the key names by identity: kept alive so their ids
# cannot be reused by other objects while the key exists, the attempt that compiled it).
# Guarded by _COMPILE_LOCK.
_MODULES: OrderedDict[tuple, tuple[Any, list[Any], str]] = OrderedDict()
_COUNTS = {"compiles": 0, "hits": 0}


def _extent(ref: PoolRef) -> int:
    """Bytes from ``ref.byte_offset`` to the end of the last element ``ref`` can address."""
    if any(n == 0 for n in ref.shape):
        return 0
    return (sum((n - 1) * st for n, st in zip(ref.shape, ref.stride, strict=True)) + 1) * ref.dtype.itemsize


def _same_elements_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that address exactly the same elements the same way."""
    return ("elements", t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.device, t.is_conj(), t.is_neg(), t.requires_grad)


class CompileUnsupported(Exception):
    """The program has a shape the FX translation does not handle (falls back, logged)."""


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

    for step in steps:
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
            graph.call_function(step.func, tuple(args), kwargs)
            continue
        func = step.func
        if func is aten.lift_fresh.default:
            # A constant made in the capture (torch.tensor(...)): lift_fresh returns its argument,
            # the private source copy, which in-place writes to the constant would then change
            # for every later replay. Interpreted replay refills the constant with copy_(); so do we.
            func = aten.clone.default
        node = graph.call_function(func, tuple(args), kwargs)
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
    mutate, where :func:`.collectives.as_functional` knows one; others are not compiled."""
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


def _leaf_key(x: Any, keep: list[Any]) -> Any:
    """An exact, hashable key for one constant of the FX graph.

    Numbers carry their type (``1``, ``1.0`` and ``True`` differ) and floats their bits (``-0.0``
    and ``nan`` compare as themselves); dtypes, devices, layouts and memory formats are hashable
    values; any other object (a generator, an opaque constant) is keyed by identity and kept
    alive, so two programs share a module only if they name the very same object.
    """
    if x is None or isinstance(x, (bool, int, str)):
        return (type(x), x)
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, complex):
        return (complex, x.real.hex(), x.imag.hex())
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(x), x)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_leaf_key(y, keep) for y in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _leaf_key(v, keep)) for k, v in x.items()))
    keep.append(x)
    return ("id", id(x))


def _graph_key(graph: fx.Graph, keep: list[Any]) -> tuple:
    """The FX graph as a hashable value: every node's op, target and arguments, with nodes named
    by their position (names are positional already, but positions make it explicit)."""
    index: dict[fx.Node, int] = {}
    out = []

    def arg(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return ("node", index[x])
        if isinstance(x, (list, tuple)):
            return (type(x), tuple(arg(y) for y in x))
        if isinstance(x, dict):
            return (dict, tuple((k, arg(v)) for k, v in x.items()))
        return _leaf_key(x, keep)

    for i, node in enumerate(graph.nodes):
        index[node] = i
        target = node.target if node.op != "placeholder" else None
        out.append((node.op, target, arg(node.args), arg(node.kwargs)))
    return tuple(out)


def _tensor_key(t: torch.Tensor, storages: dict[int, int]) -> tuple:
    """What Inductor and AOT autograd may specialize a placeholder on: its metadata, its
    alignment, and which other placeholders share its storage and where (aliasing decides how
    input mutations are written back)."""
    storage = t.untyped_storage()
    sid = storages.setdefault(storage.data_ptr(), len(storages))
    return (
        type(t), t.dtype, t.device, t.layout, tuple(t.shape), t.stride(), t.storage_offset(),
        sid, storage.nbytes(), storage.data_ptr() % 64, t.requires_grad, t.is_conj(), t.is_neg(),
    )


def program_key(graph: fx.Graph, example: list[torch.Tensor]) -> tuple[tuple, list[Any]]:
    """The cache key of a compiled program: its FX graph (ops and constants) and the layout of
    every placeholder. Equal keys compile to interchangeable modules. Returns the key and the
    objects it names by identity (to be kept alive while the key is cached)."""
    keep: list[Any] = []
    storages: dict[int, int] = {}
    return (_graph_key(graph, keep), tuple(_tensor_key(t, storages) for t in example)), keep


def compile_cache_info() -> dict[str, int]:
    """Process-wide compiled-module cache counters: ``compiles`` (Inductor runs), ``hits``
    (captures that reused a module), ``size`` and ``maxsize`` (entries)."""
    with _COMPILE_LOCK:
        return {**_COUNTS, "size": len(_MODULES), "maxsize": COMPILE_CACHE_SIZE}


def clear_compile_cache() -> None:
    """Forget every cached module and zero the counters (graphs keep the modules they use)."""
    with _COMPILE_LOCK:
        _MODULES.clear()
        _COUNTS.update(compiles=0, hits=0)


def _compiled_module(graph: fx.Graph, example: list[torch.Tensor], frozen: FrozenConstants | None = None,
                     cpp_wrapper: bool = False) -> tuple[Any, bool, str, dict[str, Any]]:
    """The Inductor module for ``graph`` at ``example``'s layout (and ``frozen``'s constants, the
    ``get_attr`` targets of ``graph``), from the cache or compiled now. Returns ``(module, hit,
    attempt, reuse)``: ``attempt`` says which compile worked, ``reuse`` where the module came from
    (:func:`.compile_cache.watch_fx_graph_cache`; ``{"reuse": "in-process"}`` for a hit here).
    Compilations take turns (module docstring); a failure is not cached."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    key, keep = program_key(graph, example)
    consts = frozen.tensors if frozen is not None else {}
    # Programs with frozen constants are never shared: their values are part of the module, and
    # no cheap key sees every update (``p.data.mul_()`` leaves the version counter alone, so a
    # key of identity and version reused the old weights: 1.47 off after such an update).
    shared = not consts
    if cpp_wrapper:
        key = (key, "cpp_wrapper")

    def module() -> fx.GraphModule:
        # compile_fx mutates the GraphModule it is given: a new one for every attempt.
        return fx.GraphModule(frozen.module() if consts else torch.nn.Module(), graph)

    with _COMPILE_LOCK:
        entry = _MODULES.get(key) if shared else None
        if entry is not None:
            _MODULES.move_to_end(key)
            _COUNTS["hits"] += 1
            return entry[0], True, entry[2], {"reuse": "in-process", "fx_graph_cache": None,
                                              "bypass_reason": None}
        static = static_kwargs(compile_fx)
        with inductor_config.patch(compile_settings.inductor_settings(bool(consts), cpp_wrapper)):
            try:
                # Watched per attempt: a failed first attempt's lookup must not count.
                with torch.no_grad(), static_tracing(), watch_fx_graph_cache() as reuse:
                    compiled = compile_fx(module(), example, **static)
                attempt = "static shapes"
            except Exception as exc:
                # Any failure under the static-shape tracing context is retried without it
                # (only the FX graph cache is lost, for this program): AOT autograd's synthetic
                # bases fail there naming a shape symbol ("s29 ... is not tracked with proxy",
                # KeyError 's70'), convnets with hardswish/SE blocks with "Exponent must be
                # non-negative" (torch 2.13), and compile without it. A failure of the retry
                # propagates (its __context__ is the first one).
                log.debug("compile under the static-shape tracing context failed (%s: %s); "
                          "retrying without it", type(exc).__name__, str(exc).strip()[:200])
                with torch.no_grad(), watch_fx_graph_cache() as reuse:
                    compiled = compile_fx(module(), example, **static)
                attempt = "retried without the static-shape tracing context"
        _COUNTS["compiles"] += 1
        if not shared:
            return compiled, False, attempt, reuse
        _MODULES[key] = (compiled, keep, attempt)
        while len(_MODULES) > COMPILE_CACHE_SIZE:
            _MODULES.popitem(last=False)
        return compiled, False, attempt, reuse


def compile_program(
    steps: list[Step], inputs: list[InputRecord], outputs: list[PoolRef], pool: GraphPool,
    *, written: set | None = None, cpp_wrapper: bool = False,
) -> tuple[Callable[[], None], dict[str, Any]]:
    """Compile with Inductor, or reuse the module of an identical program (module docstring).
    Returns ``(replay_fn, info)``; raises on any failure. ``written`` (the storages the whole
    captured program writes, :func:`.freezing.written_storages`) turns on freezing: captured
    parameters outside it are compiled as constants. ``cpp_wrapper`` asks for Inductor's C++
    wrapper; a program it cannot build is compiled with the Python wrapper (logged)."""
    t0 = time.perf_counter()
    frozen = FrozenConstants(written) if written is not None else None
    graph, ext, out_refs = build_fx(steps, outputs, frozen)
    # An input over pool memory the program also writes as an output (a backward graph writing
    # a gradient where an activation it read lived, memory reused within the capture): the
    # compiled program reads a private copy of it, made before each run, since AOT autograd's
    # synthetic bases do not keep the read-before-write order exact (gradients came out wrong).
    clash = {i for i, x in enumerate(ext)
             if isinstance(x, PoolRef) and any(refs_overlap(x, o) for o in out_refs)}
    ext = [pool.materialize(x) if isinstance(x, PoolRef) else x for x in ext]
    staged = [(ext[i], ext[i].clone()) for i in sorted(clash)]
    for i, (_, copy) in zip(sorted(clash), staged):
        ext[i] = copy
    statics = [pool.materialize(r) for r in out_refs]
    example = [*ext, *statics]
    wrapper = "cpp" if cpp_wrapper else "python"
    try:
        compiled, hit, attempt, reuse = _compiled_module(graph, example, frozen, cpp_wrapper)
    except Exception as exc:
        if not cpp_wrapper:
            raise
        wrapper = f"python (the C++ wrapper failed: {type(exc).__name__})"
        log.info("compile='inductor': the C++ wrapper failed for a graph (%s: %s); compiling "
                 "with the Python wrapper", type(exc).__name__, str(exc).strip()[:200])
        compiled, hit, attempt, reuse = _compiled_module(graph, example, frozen, False)
    compile_s = time.perf_counter() - t0
    args = tuple(example)

    # compile_fx's result for a plain GraphModule is called unboxed, f(*args), even though it
    # carries _boxed_call=True (calling it with a list fails inside the AOT runtime wrapper).
    if staged:
        pairs = tuple(staged)

        def run() -> None:
            for src, copy in pairs:
                copy.copy_(src)
            compiled(*args)
    else:
        def run() -> None:
            compiled(*args)

    info = {
        "backend": "inductor",
        "compile_s": compile_s,
        "cache": "hit" if hit else "miss",
        # Where the module came from: this process's module cache, Inductor's FX graph cache on
        # disk (compiled before, also by another process), or a fresh compile (.compile_cache).
        "reuse": reuse["reuse"],
        "fx_graph_cache": reuse["fx_graph_cache"],
        "attempt": attempt,
        "fx_nodes": len(graph.nodes),
        "placeholders": len(example),
        "intermediates": "allocated per call by Inductor, outside the graph's pool",
        "staged_inputs": len(staged),
        "wrapper": wrapper,
    }
    if reuse["bypass_reason"] is not None:
        info["fx_graph_cache_bypass"] = reuse["bypass_reason"]
    if frozen is not None:
        info["frozen"] = len(frozen.tensors)
    return run, info
