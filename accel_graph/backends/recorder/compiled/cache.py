"""What lets a restarted process reuse compiled programs, and how each program's reuse is reported.

Compiled replay keeps two caches (docs/recorder.md, "Handle lifetime and the compile cache"):

- the process-wide module cache of :mod:`.inductor` (:mod:`.program_key`): an identical program
  captured again in the same process compiles nothing;
- Inductor's FX graph cache, on disk (``TORCHINDUCTOR_CACHE_DIR``): a program Inductor compiled
  before, in this process or another, loads its generated code instead of generating it again.

The second one hits only if the key Inductor computes (``FxGraphHashDetails`` in
``torch/_inductor/codecache.py``: the FX graph's code, the example inputs' metadata, constants by
value, the Inductor config, torch's own source hash) is the same in the restarted process, and
only if Inductor does not bypass the cache. What we hand it is stable across processes (the
ops and the placeholders' layouts; parameters are placeholders, so neither their values nor
their identities enter the key; checked on Qwen2 decode steps under different
``PYTHONHASHSEED`` values). Inductor bypasses its cache without a shape environment ("No shape
env"), hence :func:`static_tracing`.
Known bypasses that remain, reported by :func:`watch_fx_graph_cache`:

- ``compile_options={"freeze": True}`` on the CPU: Inductor's freezing prepacks linear and
  convolution weights as mkldnn tensors, which its cache key cannot pickle ("mkldnn tensors
  unpickleable"); every process generates the code again (the C++ kernels themselves are still
  found in the on-disk code cache, so a second process is faster, not free);
- the retry without the static-shape tracing context (``attempt``, :mod:`.inductor`): "No shape
  env".

:func:`watch_fx_graph_cache` reads Inductor's own counters
(``torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit" / "_miss" / "_bypass"]``) around
one ``compile_fx`` call, and the bypass reason from the INFO line Inductor logs for it. It is a
probe: it never raises, and says ``"unknown"`` when torch's private counters are not there.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["REUSE_KINDS", "merge_reuse", "static_kwargs", "static_tracing", "watch_fx_graph_cache"]

# torch._inductor, torch._dynamo and torch._subclasses are imported inside the functions below,
# on first use: importing them takes seconds, and most processes never compile. Each is
# feature-detected there (torch 2.11 to 2.14 differ).

#: ``compile_info()["reuse"]`` values: the process-wide module cache, Inductor's FX graph cache
#: (code generated earlier, in this process or another, loaded from disk), or a fresh compile.
REUSE_KINDS = ("in-process", "fx-graph-cache", "compiled")

_CODECACHE_LOGGER = "torch._inductor.codecache"
_BYPASS_PREFIX = "Bypassing FX Graph Cache because"


def static_tracing() -> Any:
    """A tracing context with a static-shape fake mode, so Inductor's FX graph cache can hit.

    Without one, compile_fx logs "Bypassing FX Graph Cache because 'No shape env'" and every
    graph (every bucket, every run) pays full code generation again. Our programs are static
    by construction, so a static shape environment is exact.
    """
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        return tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)))
    except Exception:  # older torch: compile without the cache rather than not at all
        return contextlib.nullcontext()


def static_kwargs(compile_fx: Callable[..., Any]) -> dict[str, Any]:
    """``compile_fx`` keyword arguments that make the compiled program static-shaped.

    ``ignore_shape_env=True``: AOT autograd fakeifies the example inputs with
    ``fake_mode.from_tensor(x, static_shapes=ignore_shape_env)`` (``process_inputs`` in
    ``torch/_functorch/_aot_autograd/frontend_utils.py``, torch 2.11 to 2.14). That explicit
    ``False`` overrides the ``static_shapes=True`` of :func:`static_tracing`'s fake mode, so
    without it every placeholder got symbolic sizes (``s26``, ``s53``) from the shape env and
    Inductor generated dynamic-shape code. Torch 2.13's Python wrapper bound those symbols from
    the inputs' sizes at every call; torch 2.14.1's binds them only under
    ``config.size_asserts``, which :mod:`.settings` turns off, so its code named
    undefined symbols (``NameError: name 's53' is not defined`` at the first run). With it the
    inputs are static fakes while the tracing context still carries a shape env, so the FX
    graph cache keeps hitting. Feature-detected on the callable actually used (tests and tools
    replace ``compile_fx`` with wrappers that may not take it).
    """
    try:
        params = inspect.signature(compile_fx).parameters
    except (TypeError, ValueError):  # a builtin or C callable: pass nothing it may refuse
        return {}
    if "ignore_shape_env" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {"ignore_shape_env": True}
    return {}


def _fx_counts() -> dict[str, int] | None:
    """Inductor's FX graph cache counters now, or None where this torch has none."""
    try:
        from torch._dynamo.utils import counters

        c = counters["inductor"]
        return {k: int(c[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")}
    except Exception:  # a private API: a torch without it reports "unknown"
        return None


class _BypassReason(logging.Filter):
    """Catches the reason of a bypass from Inductor's INFO line, from the compiling thread only,
    and lets a record through only where the logger would have (its level is lowered only so
    the record is made at all): what the user's logging shows does not change."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold
        self.thread = threading.get_ident()
        self.reason: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread and self.reason is None:
            try:
                msg = record.getMessage()
            except Exception:  # a record that cannot format is not ours to judge
                msg = ""
            if msg.startswith(_BYPASS_PREFIX):
                self.reason = msg[len(_BYPASS_PREFIX):].strip().strip("'")
        return record.levelno >= self.threshold


@contextlib.contextmanager
def watch_fx_graph_cache() -> Iterator[dict[str, Any]]:
    """Around one ``compile_fx`` call: yields a dict filled on exit (also when it raises) with
    ``fx_graph_cache`` (``"hit"``, ``"miss"``, ``"bypass"``, ``"disabled"``: Inductor did not
    consult it, or ``"unknown"``), ``bypass_reason`` (for a bypass, Inductor's words, or None)
    and ``reuse`` (``"fx-graph-cache"`` when every lookup hit, else ``"compiled"``).

    The counters are process-wide: callers hold :mod:`.inductor`'s compile lock, so another
    compile of accel-graph cannot run meanwhile (a ``torch.compile`` in another thread at the
    same moment could still be counted with ours; that only mislabels a report, never a result).
    """
    result: dict[str, Any] = {"fx_graph_cache": "unknown", "bypass_reason": None, "reuse": "compiled"}
    before = _fx_counts()
    logger = logging.getLogger(_CODECACHE_LOGGER)
    catcher = _BypassReason(logger.getEffectiveLevel())
    old_level = logger.level
    try:
        logger.addFilter(catcher)
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
    except Exception:  # a probe never raises: without the reason we still have the counts
        pass
    try:
        yield result
    finally:
        with contextlib.suppress(Exception):
            logger.removeFilter(catcher)
            logger.setLevel(old_level)
        after = _fx_counts()
        if before is not None and after is not None:
            delta = {k: after[k] - before[k] for k in after}
            if delta["bypass"]:
                result["fx_graph_cache"] = "bypass"
                result["bypass_reason"] = catcher.reason or "unknown (Inductor logged no reason)"
            elif delta["miss"]:
                result["fx_graph_cache"] = "miss"
            elif delta["hit"]:
                result["fx_graph_cache"] = "hit"
                result["reuse"] = "fx-graph-cache"
            else:
                result["fx_graph_cache"] = "disabled"


def merge_reuse(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The reuse report of a program compiled in parts (stretches, control-flow sub-programs):
    ``reuse`` is the parts' common value, or ``"mixed"``; ``reuse_counts`` counts each kind."""
    counts = {kind: sum(1 for i in infos if i.get("reuse") == kind) for kind in REUSE_KINDS}
    kinds = {i.get("reuse") for i in infos}
    reuse = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "compiled")
    return {"reuse": reuse, "reuse_counts": counts}
