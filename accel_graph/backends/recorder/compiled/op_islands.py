"""Ops Inductor refuses, replayed interpreted inside a compiled program (issue 26, item 3).

Before, one op Inductor could not compile sent the whole graph back to interpreted replay
(the MoE decoders of transformers 5: ``torch._grouped_mm`` on the CPU in fp32, whose meta
kernel takes only bf16, cost the whole graph its compilation). Now such an op is an *op
island*: :mod:`.segmented` runs it interpreted, between compiled stretches, exactly as it runs a
host step, and compiles the rest. What is found where:

1. **Before compiling** (:func:`predict`): ops known to be refused for some inputs
   (:data:`PROBED_OPS`) and every op outside aten/prims (a custom op: it may have no fake
   kernel) are run on fake tensors of their recorded arguments, as Inductor's tracing runs
   them. The refusal of ``_grouped_mm`` is in its meta kernel, so the probe is the test itself,
   feature-detected on the installed torch: one that accepts fp32 compiles it. No compile is
   spent.
2. **From a compile failure** (:func:`locate`): the exception names the failing node (FX's
   ``While executing %name``, mapped back to its step through the node's
   :data:`.fx_graph.STEP_META`) or the op (Inductor's ``LoweringException``: ``target: aten.x``,
   every step of that op in the stretch). :mod:`.segmented` then splits the stretch around them
   and compiles the parts; a failure that names nothing is bisected. Failed compiles are
   counted against :class:`Budget` (:data:`MAX_FAILED_COMPILES` per graph): past it, or when
   nothing compiles at all, the whole graph falls back as before, with the first reason.

Failures that are not one op's are never split: no C++ compiler (every stretch would fail),
our own :class:`.fx_graph.CompileUnsupported` (a program shape the FX translation refuses).
Failures at the first run of the compiled code (:mod:`.first_run`) still fall back whole.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload

from ...capture_common.pytree import tree_map
from ..pool_protocol import GraphPool, PoolRef
from ..steps import Step
from .failures import compiler_hint, failure_reason
from .fx_graph import STEP_META, CompileUnsupported, build_fx

log = logging.getLogger("accel_graph")

__all__ = ["MAX_FAILED_COMPILES", "PROBED_OPS", "Budget", "Refusal", "locate", "predict",
           "splittable", "summary"]

#: aten ops (by name, any overload) whose Inductor path refuses inputs eager runs, and why;
#: each is probed on fake tensors of its recorded arguments (:func:`predict`).
PROBED_OPS: dict[str, str] = {
    # torch 2.13/2.14: eager's CPU kernel takes fp32, the meta kernel only bf16.
    "_grouped_mm": "Inductor traces it with its meta kernel, stricter than eager's on the CPU",
    "_scaled_grouped_mm": "Inductor traces it with its meta kernel, stricter than eager's",
}

#: Namespaces whose ops Inductor traces through known meta kernels (others are probed).
_KNOWN_NAMESPACES = ("aten", "prims")

#: Failed Inductor compiles one graph may spend locating refused ops (each costs seconds).
MAX_FAILED_COMPILES = 6

_EXECUTING = re.compile(r"While executing %([A-Za-z_][\w]*)")
_TARGET = re.compile(r"^\s*target: (\S+)\s*$", re.MULTILINE)


@dataclass
class Refusal:
    """Why one step replays interpreted: ``reason`` (``Type: first line`` of the error),
    ``found`` (``"probed before compiling"``, ``"named by a compile failure"`` or
    ``"bisected"``) and the error itself (re-raised when nothing compiles)."""

    reason: str
    found: str
    error: BaseException = field(repr=False)


@dataclass
class Budget:
    """Failed compiles left for locating, shared by a graph's stretches and sub-programs."""

    left: int = field(default_factory=lambda: MAX_FAILED_COMPILES)  # read now: tests patch it
    failed: int = 0

    def spend(self) -> bool:
        """Count one failed compile; False when none was left for it (give up)."""
        self.failed += 1
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def splittable(exc: BaseException) -> bool:
    """Whether a compile failure may be one op's, worth locating: not the C++ compiler, not our
    FX translation's refusal of the program's shape."""
    return not isinstance(exc, CompileUnsupported) and not compiler_hint(exc)


def _probed(step: Step) -> bool:
    func = step.func
    if not isinstance(func, OpOverload) or step.kind in ("view", "none", "collective"):
        return False
    if func.namespace in _KNOWN_NAMESPACES:
        return func._opname in PROBED_OPS
    return True


def _fake_call(step: Step, pool: GraphPool, mode: Any) -> BaseException | None:
    """Run ``step``'s op on fake tensors of its arguments; its error, or None. An argument the
    probe cannot fake (a generator, an opaque object) makes no prediction (None)."""
    def fake(x: Any) -> Any:
        if isinstance(x, PoolRef):
            x = pool.materialize(x)
        if isinstance(x, torch.Tensor):
            return mode.from_tensor(x)
        if isinstance(x, torch.Generator):
            raise TypeError("generator")
        return x

    try:
        args, kwargs = tree_map(fake, (step.args, step.kwargs))
    except Exception:
        return None
    try:
        with mode:
            step.func(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def predict(steps: list[Step], pool: GraphPool) -> dict[int, Refusal]:
    """The steps (by index) that Inductor would refuse, known before compiling (module
    docstring, 1.). Never raises."""
    found: dict[int, Refusal] = {}
    candidates = [i for i, s in enumerate(steps) if _probed(s)]
    if not candidates:
        return found
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    except Exception:  # no fake tensors here: predict nothing, compile failures still locate
        return found
    for i in candidates:
        exc = _fake_call(steps[i], pool, mode)
        if exc is not None:
            found[i] = Refusal(failure_reason(exc), "probed before compiling", exc)
    return found


def locate(exc: BaseException, stretch: list[Step], written: list[PoolRef]) -> list[int]:
    """The steps of ``stretch`` (indices into it) that the compile failure ``exc`` names: the
    node of FX's ``While executing %name`` (the stretch's graph rebuilt, its names are
    deterministic), else every step of the op of Inductor's ``target: aten.x``. Empty when it
    names none of them (the caller bisects)."""
    texts = []
    cur: BaseException | None = exc
    seen: set[int] = set()
    while cur is not None and id(cur) not in seen:  # the whole chain: Inductor wraps errors
        seen.add(id(cur))
        texts.append(str(cur))
        inner = getattr(cur, "inner_exception", None)
        cur = inner if isinstance(inner, BaseException) else (cur.__cause__ or cur.__context__)
    text = "\n".join(texts)
    names = _EXECUTING.findall(text)
    if names:
        try:
            graph = build_fx(stretch, written)[0]
        except Exception:  # cannot happen for a stretch that reached the compiler; be safe
            graph = None
        if graph is not None:
            by_name = {n.name: n.meta[STEP_META] for n in graph.nodes if STEP_META in n.meta}
            hit = sorted({by_name[n] for n in names if n in by_name})
            if hit:
                return hit
    targets = set(_TARGET.findall(text))
    return [i for i, s in enumerate(stretch) if s.kind not in ("view", "none") and str(s.func) in targets]


def summary(islands: dict[int, Refusal], steps: list[Step]) -> list[dict[str, Any]]:
    """``compile_info()["interpreted_ops"]``: per op and reason, how many steps, how found and
    which (indices into ``debug_dump()``'s ``ops``; the recorder keeps no source line per op)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for i in sorted(islands):
        r = islands[i]
        key = (str(steps[i].func), r.reason)
        g = groups.setdefault(key, {"op": key[0], "count": 0, "reason": r.reason,
                                    "found": r.found, "steps": []})
        g["count"] += 1
        g["steps"].append(i)
    return list(groups.values())


def describe(items: list[dict[str, Any]]) -> str:
    """One line for the log: ``aten.x x4 (reason); ...``."""
    return "; ".join(f"{g['op']} x{g['count']} ({g['reason']})" for g in items)

