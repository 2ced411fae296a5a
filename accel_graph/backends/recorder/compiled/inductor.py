"""Compiled replay: the recorded aten program handed to Inductor once, at instantiation.

The program becomes an FX graph (:mod:`.fx_graph`) whose placeholders are the tensors captured
by reference followed by the graph's static outputs, written with ``copy_``; in-place writes to
inputs become input mutations, which Inductor writes back into the caller's tensors. So compiled
replay has the semantics of interpreted replay: inputs read and written in place, outputs in the
same static memory. Inductor's own intermediates are allocated per call, outside the graph's
pool.

Known traps, handled here: ``compile_fx`` mutates the GraphModule it is given (it gets one made
for it, used for nothing else), its result is called unboxed although it says it is boxed, and
it needs a C++ compiler at run time (without one compilation fails and replay falls back to the
interpreted program, with the reason logged). The result is called unboxed (``f(*args)``). Random ops are compiled with
``fallback_random=True`` so draws equal eager's after the same seed.

Compiled modules are cached process-wide by *program*, not by capture (:mod:`.program_key`): two
captures with the same ops, constants and input/output layout (shape, stride, dtype, device,
storage offset, which placeholders share a storage, alignment) reuse one module, called with each
graph's own tensors. Without it every capture/replay/reset cycle recompiled and torch's code cache
kept every module (40-55 KB a cycle). The cache is an LRU of :data:`COMPILE_CACHE_SIZE` entries:
an evicted module lives on in the graphs that use it and is compiled again when next needed.
Across processes, Inductor's own FX graph cache on disk serves programs compiled before;
``compile_info()["reuse"]`` says which cache served each program (:mod:`.cache`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..pool_protocol import GraphPool, PoolRef, refs_overlap
from ..steps import InputRecord, Step
from . import settings as compile_settings
from .cache import static_kwargs, static_tracing, watch_fx_graph_cache
from .freezing import FrozenConstants
from .fx_graph import build_fx
from .program_key import program_key

log = logging.getLogger("accel_graph")

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
    (:func:`.cache.watch_fx_graph_cache`; ``{"reuse": "in-process"}`` for a hit here).
    Compilations take turns (module docstring); a failure is not cached."""
    # Imported on first compile: Inductor takes seconds to import, and most processes never
    # compile (looked up per call, so a test can stand in for compile_fx).
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
        # disk (compiled before, also by another process), or a fresh compile (.cache).
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
