"""``GraphRunner(dynamic=...)``: the bucket ladder from a declarative dynamic-shape spec.

torch's ``torch.fx.experimental.dynamic_spec`` declares what is dynamic once, for
``torch.compile`` and ``torch.export`` (``ShapesSpec({"x": TensorSpec([batch, 3])})`` with
``batch = ShapeVar("batch", min=1, max=64)``). Passing the same ``batch`` (or the ``TensorSpec``
of the first batched input) to the runner makes its ladder the runner's ladder rule over the
spec's range: :func:`~accel_graph.runner.buckets.default_ladder` up to ``max``, without the
buckets below ``min`` (no batch in the spec's range would use them). One spec then sizes the
compiled or exported program and the captured graphs alike.

Feature-detected: the module is imported when ``dynamic=`` is given, never at import of
accel-graph. A torch without it (2.11) gets a ConfigError naming its version and ``max_batch=``
as what to pass instead; torch 2.13 has the spec types (``torch.export`` takes them from 2.14).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError
from .buckets import default_ladder, validate_ladder

__all__ = ["check_spec_dim", "resolve_ladder", "spec_range"]

_MODULE = "torch.fx.experimental.dynamic_spec"


def _spec_module() -> Any:
    """torch's dynamic-spec module; ConfigError, saying what to pass instead, where absent."""
    import importlib

    try:
        return importlib.import_module(_MODULE)
    except ImportError:
        raise ConfigError(
            f"dynamic= needs {_MODULE} (ShapeVar/IntVar), which torch {torch.__version__} does "
            f"not have; pass max_batch=N (or buckets=[...]) instead"
        ) from None


def _batch_var(dynamic: Any, mod: Any) -> Any:
    """The IntVar/ShapeVar ``dynamic`` names: itself, or the one dim of a TensorSpec holding one."""
    if isinstance(dynamic, mod.IntVar):
        return dynamic
    if isinstance(dynamic, mod.TensorSpec):
        found = [d for d in dynamic if d is not None and not isinstance(d, int)]
        if len(found) != 1 or not isinstance(found[0], mod.IntVar):
            raise ConfigError(
                f"dynamic=TensorSpec(...) must hold exactly one dynamic dim, a ShapeVar/IntVar "
                f"itself (the batch dim), got {list(dynamic)}; the runner pads one dimension, so "
                f"derived expressions (batch * 2) and second variables cannot be served"
            )
        return found[0]
    raise ConfigError(
        f"dynamic= takes a ShapeVar/IntVar with min and max (dynamic=ShapeVar('batch', min=1, "
        f"max=64)) or the TensorSpec of the first batched input, got {type(dynamic).__name__}: "
        f"{dynamic!r}; for a plain size pass max_batch=N"
    )


def spec_range(dynamic: Any) -> tuple[int, int]:
    """``(lo, hi)``: the batch sizes ``dynamic`` allows that a runner can serve (``min`` 0 or
    unset is 1: a batch has at least one row). ConfigError for a spec without ``max``, with
    ``min > max``, or with a negative ``min``."""
    var = _batch_var(dynamic, _spec_module())
    lo, hi = var.min, var.max
    name = getattr(var, "name", "?")
    if hi is None:
        raise ConfigError(
            f"dynamic={var!r} has no max: the runner sizes its static inputs for the largest "
            f"batch, so give {type(var).__name__}({name!r}, min=..., max=N)"
        )
    for what, v in (("min", lo), ("max", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"dynamic={var!r}: {what} must be an int, got {v!r}")
    if lo is not None and lo < 0:
        raise ConfigError(f"dynamic={var!r}: min={lo} is negative; a batch size is at least 1")
    if lo is not None and lo > hi:
        raise ConfigError(f"dynamic={var!r}: min={lo} is above max={hi}; give min <= max")
    if hi < 1:
        raise ConfigError(f"dynamic={var!r}: max={hi} allows no batch of at least one row")
    return max(lo or 1, 1), hi


def resolve_ladder(buckets: Sequence[int] | None, max_batch: int | None, dynamic: Any) -> list[int]:
    """The runner's ladder from ``buckets=``, ``max_batch=`` and ``dynamic=`` (see the module
    docstring); ConfigError for a missing size or a conflict between them."""
    if dynamic is None:
        if buckets is None:
            if max_batch is None:
                raise ConfigError(
                    "give buckets=[...], max_batch=N or dynamic=ShapeVar(..., max=N) (the default "
                    "ladder is 1, 2, 4, 8, 16, 24, ... up to N, as vLLM's)"
                )
            return default_ladder(max_batch)
        return validate_ladder(buckets, max_batch)
    lo, hi = spec_range(dynamic)
    if max_batch is not None and max_batch != hi:
        raise ConfigError(
            f"max_batch={max_batch} disagrees with dynamic= (max={hi}); give one of them (the "
            f"spec's max is the largest batch)"
        )
    if buckets is None:
        return [b for b in default_ladder(hi) if b >= lo]
    ladder = validate_ladder(buckets)
    outside = [b for b in ladder if not lo <= b <= hi]
    if outside:
        raise ConfigError(f"buckets {outside} lie outside dynamic='s range {lo}..{hi}")
    if ladder[-1] != hi:
        raise ConfigError(
            f"the largest bucket ({ladder[-1]}) is below dynamic='s max ({hi}): batches up to {hi} "
            f"are in the spec, so add a bucket of {hi} (or lower the spec's max)"
        )
    return ladder


def check_spec_dim(dynamic: Any, inputs: Sequence[Any]) -> None:
    """With ``dynamic=TensorSpec(...)``: its rank and dynamic dim must be those of the first
    batched input (``inputs``: the runner's InputSpecs). ConfigError naming both otherwise."""
    if dynamic is None:
        return
    mod = _spec_module()
    if not isinstance(dynamic, mod.TensorSpec):
        return
    lead = next((s for s in inputs if s.batch_dim is not None), None)
    dims = list(dynamic)
    at = next(i for i, d in enumerate(dims) if d is not None and not isinstance(d, int))
    if lead is None:
        raise ConfigError("dynamic=TensorSpec(...) names a batch dim, but no input has one (batch_dim=None)")
    rank = lead.static.dim()
    if len(dims) != rank or at != lead.batch_dim:
        raise ConfigError(
            f"dynamic=TensorSpec with {len(dims)} dims, dynamic dim {at}, does not match input "
            f"{lead.name} (rank {rank}, batch_dim={lead.batch_dim}): the spec names another "
            f"dimension; set batch_dim={at} or put the ShapeVar at dim {lead.batch_dim}"
        )
