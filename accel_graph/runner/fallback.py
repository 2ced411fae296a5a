"""Eager fallback of a :class:`~accel_graph.runner.GraphRunner`: how a batch runs when no graph
serves it.

A batch whose bucket is not serving (not captured yet, capture failed, over a budget, disabled
by verification) runs by default at the bucket's padded shape (``fallback="padded"``): its rows
go into the static inputs exactly as for a replay, the rest is padding, and ``fn`` runs on the
bucket's views with the bucket's state. State kept per bucket (a KV cache prefilled at bucket
size) is then read and written the same way whether a graph or the fallback serves the batch.
``fallback="live"`` calls ``fn`` with the live batch at its own size (with ``state=`` built for
that size), as before per-bucket state existed. A batch above the largest bucket always runs at
its own size, and so does a bucket disabled because ``fn`` mixes rows across the batch
(:mod:`.rows`: padding would change the live rows).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.utils._pytree as pytree

from ..errors import AccelGraphError
from .runtime import Bucket, RunnerRuntime
from .support import broadcast_outputs

__all__ = ["count_eager", "load_static", "narrow_outputs", "run_eagerly"]

log = logging.getLogger("accel_graph")

def run_eagerly(rt: RunnerRuntime, reason: str, bucket: Bucket | None, n: int,
                leaves: Sequence[Any], args: tuple, kwargs: dict) -> Any:
    """Serve one batch of ``n`` rows eagerly (logged once per reason, counted in ``stats()``).

    ``bucket`` is the bucket the batch maps to (None above the largest). Raises
    AccelGraphError with ``rt.strict``.
    """
    if rt.strict:
        raise AccelGraphError(f"GraphRunner (strict): {reason}")
    if reason not in rt.fallbacks:
        log.warning("GraphRunner: running eagerly: %s", reason)
    count_eager(rt, reason, n)
    assert rt.states is not None
    # A bucket whose padded rows change its live rows (:mod:`.rows`) must not run padded.
    if bucket is None or rt.options.fallback == "live" or bucket.mixes_rows:
        return rt.options.fn(*args, **kwargs, **rt.states.kwargs(n))
    return run_padded(rt, bucket, n, leaves)


def count_eager(rt: RunnerRuntime, reason: str, n: int) -> None:
    """Count one call of ``n`` rows served eagerly for ``reason`` (``stats()``)."""
    rt.fallbacks[reason] += 1
    rt.eager_calls += 1
    rt.eager_sizes[n] += 1


def run_padded(rt: RunnerRuntime, bucket: Bucket, n: int, leaves: Sequence[Any]) -> Any:
    """``fn`` at ``bucket``'s padded shape on the static inputs (live rows copied in, the rest
    padding, the bucket's state); its outputs narrowed to the ``n`` live rows."""
    load_static(rt, bucket.size, n, leaves)
    bargs, bkwargs = rt.bucket_args(bucket.size)
    return narrow_outputs(rt, rt.options.fn(*bargs, **bkwargs), n)


def load_static(rt: RunnerRuntime, size: int, n: int, leaves: Sequence[Any]) -> None:
    """Copy a call's ``n`` live rows into the static inputs and pad them up to ``size``."""
    for s, x in zip(rt.inputs, leaves):
        s.live[n].copy_(x)
    if n != size:
        for s in rt.batched:
            s.static.narrow(s.batch_dim, n, size - n).fill_(s.pad)


def narrow_outputs(rt: RunnerRuntime, out: Any, n: int) -> Any:
    """``out`` (at a bucket's size) with each batched output narrowed to ``n`` rows."""
    leaves, spec = pytree.tree_flatten(out)
    dims = rt.out_dims if rt.out_spec == spec else broadcast_outputs(rt.options.output_batch_dim, spec)
    sliced = [x if d is None else x.narrow(d, 0, n) for x, d in zip(leaves, dims)]
    return pytree.tree_unflatten(sliced, spec)
