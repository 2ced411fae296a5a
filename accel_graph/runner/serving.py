"""The serving path of a :class:`~accel_graph.runner.GraphRunner` off the hot path, as functions
over its :class:`~accel_graph.runner.runtime.RunnerRuntime`.

The hot path (``GraphRunner._serve`` in :mod:`.core`: compare, copy, pad, replay, return
prebuilt views) sends everything else here: input validation and its error messages, lazy
capture, first-replay verification, replays between two sampled checks, and eager fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError
from .capture import capture_lazily
from .checked import check_due, checked_replay
from .fallback import load_static, run_eagerly
from .runtime import Bucket, RunnerRuntime
from .support import fits

__all__ = ["bad_inputs", "copied", "handed_out", "serve_slow"]


def bad_inputs(rt: RunnerRuntime, leaves: Sequence[Any], n: int) -> ConfigError:
    """The error for a call whose inputs (``leaves``, ``n`` rows) do not fit the runner: the
    first input that does not fit its static buffer, else the batch sizes that disagree."""
    inputs = rt.inputs
    for s, x in zip(inputs, leaves):
        if not fits(s, x):
            return ConfigError(s.mismatch(x, n))
    sizes = {s.name: x.shape[s.batch_dim] for s, x in zip(inputs, leaves) if s.batch_dim is not None}
    return ConfigError(f"batched inputs disagree on the batch size: {sizes}")


def serve_slow(rt: RunnerRuntime, n: int, leaves: Sequence[Any], args: tuple, kwargs: dict) -> Any:
    """Serve a call the hot path does not: validation, lazy capture, first-replay verification,
    eager fallback."""
    for s, x in zip(rt.inputs, leaves):
        if not fits(s, x):
            raise bad_inputs(rt, leaves, max(n, 1))
    if n < 1:
        raise ConfigError(
            f"batch of size {n} (input {rt.inputs[rt.lead].name}): a batch needs at least one row"
        )
    for s, x in zip(rt.inputs, leaves):
        if s.batch_dim is not None and x.shape[s.batch_dim] != n:
            raise bad_inputs(rt, leaves, n)
    if n > rt.max_bucket:
        return run_eagerly(rt, f"batch {n} is above the largest bucket ({rt.max_bucket})",
                           None, n, leaves, args, kwargs)
    bucket = rt.bucket_for(n)
    assert bucket is not None
    if rt.options.capture_mode == "lazy" and bucket.status == "pending":
        capture_lazily(rt, bucket)
    if not rt.captured:
        return run_eagerly(rt, "capture() has not run yet", bucket, n, leaves, args, kwargs)
    if bucket.replay is None:
        return run_eagerly(rt, f"bucket {bucket.size} {bucket.reason}", bucket, n, leaves, args, kwargs)
    if not check_due(rt, bucket, n):
        # Served as the hot path does: verify=0 after a lazy capture, or a replay between
        # two sampled checks (checks fall on replays 1, 2, 4, ...).
        load_static(rt, bucket.size, n, leaves)
        bucket.replay()
        return handed_out(rt, bucket, n)
    return checked_replay(rt, bucket, n, leaves, lambda b, k: handed_out(rt, b, k))


def handed_out(rt: RunnerRuntime, bucket: Bucket, n: int) -> Any:
    """Count a replay of ``bucket`` for ``n`` live rows and return its outputs (as the hot
    path does, inline)."""
    bucket.replays += 1
    bucket.live_rows += n
    rt.graph_sizes[n] += 1
    out = rt.outs[n]
    return copied(out) if rt.copy_outputs else out


def copied(out: Any) -> Any:
    """A copy of a runner's outputs (``copy_outputs=True``)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    return pytree.tree_map(torch.clone, out)
