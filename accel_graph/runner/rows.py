"""The live-rows check of verification: padded rows must not influence live rows.

A runner pads a batch of ``n`` rows up to its bucket and replays the bucket's graph. That is
only right when ``fn`` treats rows independently: a reduction or normalisation over the batch
dimension (``softmax(0)``, ``x - x.mean(0)``, batch-norm in training mode, a sum over the batch)
mixes the padded rows into the live ones, and the sliced result is silently wrong. Comparing the
replay with eager on the *same padded* inputs cannot see it (both mix the same padding), so a
checked call whose live batch is smaller than its bucket also runs ``fn`` eagerly on the live
rows alone and compares the replay's live rows with it, within the per-dtype tolerances of
:mod:`accel_graph.foundation.tolerances` (a padded matmul is never bitwise equal to an unpadded one).

Skipped, and why:

- with per-bucket ``state=``: ``fn`` reads and writes the bucket's state at the bucket's size,
  and running it at another size would use (or need) another state object;
- with ``verify=False`` (no check at all) and with ``rows_independent=True`` (the caller
  declares the rows independent, for example when an integer output such as an argmax flips on
  a near-tie between the padded and the unpadded matmul);
- for a bucket no batch is ever padded into (the previous bucket is one smaller, or it is 1).

Tensors the live run writes in place are recorded by an :class:`~.verify.UndoLog` and put back,
so the call's side effects happen once; Python-side effects of ``fn`` (a counter in an
attribute) happen once more, as for the padded eager run of every checked call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .runtime import Bucket, RunnerRuntime
from .support import reason_of
from .verify import UndoLog

__all__ = ["LiveRun", "mixes_rows_reason", "rows_apply", "rows_pending", "run_live", "wants_rows_check"]

log = logging.getLogger("accel_graph")


@dataclass
class LiveRun:
    """``fn`` run eagerly on a call's live rows: its outputs (cloned, so state restored after
    it cannot change them) and the undo log of what it wrote (already restored)."""

    outputs: Any
    undo: UndoLog


def rows_apply(rt: RunnerRuntime, bucket: Bucket) -> bool:
    """Whether ``bucket`` gets a live-rows check at all: verification is on, the runner has no
    ``state=`` and no ``rows_independent=True``, and a batch can be padded into the bucket."""
    assert rt.states is not None
    if rt.verify == 0 or rt.states.enabled or rt.rows_independent:
        return False
    below = [b for b in rt.ladder if b < bucket.size]
    return bucket.size - (below[-1] if below else 0) > 1


def rows_pending(rt: RunnerRuntime, bucket: Bucket) -> bool:
    """Whether ``bucket``'s live-rows check applies and has not run yet. While it is pending
    the routes of its padded batch sizes are empty (:meth:`RunnerRuntime.build_routes`), so
    those calls take the slow path, where the first one is checked; full batches do not wait."""
    return not bucket.rows_checked and rows_apply(rt, bucket)


def wants_rows_check(rt: RunnerRuntime, bucket: Bucket, n: int) -> bool:
    """Whether a call of ``n`` live rows into ``bucket`` runs the live-rows check."""
    return n < bucket.size and rows_pending(rt, bucket)


def run_live(rt: RunnerRuntime, bucket: Bucket, n: int, leaves: Sequence[Any]) -> LiveRun | None:
    """Run ``rt.fn`` eagerly on the call's live inputs (``leaves``, ``n`` rows), undoing its
    in-place writes. None when ``fn`` raised at that size: the check is then skipped for the
    bucket with a warning (the runner served such a call before this check existed, and a
    check never raises: it reports)."""
    args, kwargs = pytree.tree_unflatten(list(leaves), rt.in_spec)
    undo = UndoLog()
    try:
        with undo:
            out = rt.fn(*args, **kwargs)
        # Clone before restoring: an output that is a view of state would otherwise show the
        # restored values, not the ones this run computed.
        out = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        undo.snapshot_post()
    except Exception as exc:  # noqa: BLE001 - fn's own failure at the live size is reported
        why = (f"bucket {bucket.size}: cannot check that padded rows leave live rows alone: fn "
               f"raised on the {n} live rows alone ({reason_of(exc)})")
        log.warning("GraphRunner: %s; the check is skipped for this bucket", why)
        bucket.rows_checked = True
        return None
    finally:
        undo.restore()
    return LiveRun(out, undo)


def mixes_rows_reason(bucket: Bucket, n: int, diff: str) -> str:
    """The reason a bucket is disabled when its live rows differ from ``fn`` on them alone:
    what happened, where (``diff`` names the output and the largest difference) and what to
    do."""
    return (
        f"disabled by verification: fn mixes rows across the batch dimension: the live rows of "
        f"a batch of {n} padded to bucket {bucket.size} differ from fn on the {n} live rows "
        f"alone ({diff}). Padded rows must not influence live rows: no softmax, sum, mean or "
        f"normalisation over the batch dimension. Make fn row-independent, or use buckets equal "
        f"to the batch sizes served (a bucket {n}), or, if the rows are independent and the "
        f"difference is rounding (an argmax near-tie), pass rows_independent=True. Batches of "
        f"this bucket now run fn eagerly on their live rows"
    )
