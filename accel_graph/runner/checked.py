"""A checked replay: one bucket's replay compared with eager on the same padded inputs.

Called by ``GraphRunner`` on the replays its ``verify`` setting samples (1, 2, 4, ...). A
mismatch disables the bucket (its batches then run as fallback) and the call returns eager's
result, with eager's side effects kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.utils._pytree as pytree

from .capture import disable_bucket
from .fallback import count_eager, load_static, narrow_outputs
from .runtime import Bucket, RunnerRuntime
from .verify import UndoLog, compare

__all__ = ["checked_replay"]


def checked_replay(rt: RunnerRuntime, bucket: Bucket, n: int, leaves: Sequence[Any],
                   hand_out: Callable[[Bucket, int], Any]) -> Any:
    """Replay ``bucket`` for ``n`` live rows (``leaves``) after running ``rt.fn`` eagerly on the
    same padded inputs, and compare. Equal: the call's outputs, from ``hand_out(bucket, n)``.
    Different: the bucket is disabled and eager's outputs (narrowed to ``n`` rows) returned."""
    load_static(rt, bucket.size, n, leaves)
    bargs, bkwargs = rt.bucket_args(bucket.size)
    undo = UndoLog()
    with undo:
        expected = rt.fn(*bargs, **bkwargs)
    undo.snapshot_post()
    undo.restore()  # eager's writes undone: replay starts from the same state
    assert bucket.replay is not None
    bucket.replay()
    actual = pytree.tree_unflatten(bucket.out_leaves, rt.out_spec)
    diff = compare(actual, expected, rt.group)  # with a group: agreed by every rank
    bucket.verified = True
    if diff is not None:
        undo.reapply()  # keep eager's side effects: its result is the one returned
        bucket.verify_diff = diff
        disable_bucket(rt, bucket, "disabled", f"disabled by verification: {diff}", None)
        rt.build_routes()
        count_eager(rt, f"bucket {bucket.size} {bucket.reason}", n)
        return narrow_outputs(rt, expected, n)
    bucket.checks += 1
    bucket.ready = bucket.checks >= rt.verify
    return hand_out(bucket, n)
