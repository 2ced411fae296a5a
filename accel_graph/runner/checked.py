"""A checked replay: one bucket's replay compared with eager on the same padded inputs and,
when the call is padded, its live rows with ``fn`` on the live rows alone (:mod:`.rows`).

Called by ``GraphRunner`` on the replays its ``verify`` setting samples (1, 2, 4, ...) and on
the first padded call of a bucket whose live-rows check is still pending. A mismatch disables
the bucket (its batches then run as fallback) and the call returns eager's result, with eager's
side effects kept. So does a checked replay that raises ``ReplayError`` (an eager island whose
output shape follows the data): what it wrote before it stopped is put back with eager's writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.utils._pytree as pytree

from ..errors import ReplayError
from .capture import disable_bucket
from .fallback import count_eager, load_static, narrow_outputs
from .rows import mixes_rows_reason, rows_apply, run_live, wants_rows_check
from .runtime import Bucket, RunnerRuntime
from .support import reason_of
from .verify import UndoLog, compare

__all__ = ["check_due", "checked_replay"]


def check_due(rt: RunnerRuntime, bucket: Bucket, n: int) -> bool:
    """Whether this call of ``bucket`` (``n`` live rows, the bucket serving) is a checked one:
    a replay ``verify`` samples (1, 2, 4, ...) or a padded call while the bucket's live-rows
    check is pending. Sets ``bucket.ready`` (the hot path) once the sampled checks are done."""
    if not bucket.rows_checked and not rows_apply(rt, bucket):  # verify lowered since capture
        bucket.rows_checked = True
        rt.build_routes()
    if bucket.checks >= rt.verify:  # sampled checks done (or verify lowered since)
        bucket.ready = True
    nxt = bucket.replays + 1
    sampled = not bucket.ready and not nxt & (nxt - 1)
    return sampled or wants_rows_check(rt, bucket, n)


def checked_replay(rt: RunnerRuntime, bucket: Bucket, n: int, leaves: Sequence[Any],
                   hand_out: Callable[[Bucket, int], Any]) -> Any:
    """Replay ``bucket`` for ``n`` live rows (``leaves``) after running ``rt.options.fn`` eagerly on the
    same padded inputs (and, for a padded call with the live-rows check pending, on the live
    rows alone), and compare. Equal: the call's outputs, from ``hand_out(bucket, n)``. Padded
    replay differs from padded eager: the bucket is disabled and eager's outputs (narrowed to
    ``n`` rows) returned. Live rows differ from ``fn`` on them alone: the bucket is disabled,
    its fallback runs on live rows (``bucket.mixes_rows``), and that live result is returned."""
    nxt = bucket.replays + 1
    sampled = not nxt & (nxt - 1)  # a replay verify samples, not only a live-rows check
    # All three runs start from the same state: each eager run's writes are undone before the
    # next, and the ones of the result returned are re-applied at the end.
    rows_check = wants_rows_check(rt, bucket, n)
    live = run_live(rt, bucket, n, leaves) if rows_check else None
    load_static(rt, bucket.size, n, leaves)
    bargs, bkwargs = rt.bucket_args(bucket.size)
    undo = UndoLog()
    with undo:
        expected = rt.options.fn(*bargs, **bkwargs)
    undo.snapshot_post()
    undo.restore()  # eager's writes undone: replay starts from the same state
    assert bucket.replay is not None
    try:
        bucket.replay()
    except ReplayError as exc:
        if rt.group is not None:  # the ranks agree in compare(), which this rank now skips
            raise
        # The pieces before the failing step ran: put back what they wrote (the log holds every
        # tensor the step writes), then eager's writes, whose result is returned.
        undo.restore()
        undo.reapply()
        bucket.verify_diff = reason_of(exc)
        disable_bucket(rt, bucket, "disabled",
                       f"disabled by verification: its replay raised {reason_of(exc)}", exc)
        rt.build_routes()
        count_eager(rt, f"bucket {bucket.size} {bucket.reason}", n)
        return narrow_outputs(rt, expected, n)
    actual = pytree.tree_unflatten(bucket.out_leaves, rt.out_spec)
    diff = compare(actual, expected, rt.group)  # with a group: agreed by every rank
    bucket.verified = True
    if live is not None:
        # Against the padded result that stands: the replay's, or eager's when they differ
        # (then eager's padded fallback would be as wrong as the replay).
        padded = narrow_outputs(rt, actual if diff is None else expected, n)
        rows_diff = compare(padded, live.outputs, rt.group, "padded live rows vs fn on the live rows")
        if rows_diff is not None:
            undo.restore()  # undo the padded writes (the replay ran last), keep the live run's
            live.undo.reapply()
            bucket.verify_diff = rows_diff
            bucket.mixes_rows = True
            disable_bucket(rt, bucket, "disabled", mixes_rows_reason(bucket, n, rows_diff), None)
            rt.build_routes()
            count_eager(rt, f"bucket {bucket.size} {bucket.reason}", n)
            return live.outputs
        bucket.rows_checked = True
    if rows_check and diff is None:  # checked (or skipped: fn raised): padded sizes route hot
        rt.build_routes()
    if diff is not None:
        undo.reapply()  # keep eager's side effects: its result is the one returned
        bucket.verify_diff = diff
        disable_bucket(rt, bucket, "disabled", f"disabled by verification: {diff}", None)
        rt.build_routes()
        count_eager(rt, f"bucket {bucket.size} {bucket.reason}", n)
        return narrow_outputs(rt, expected, n)
    bucket.checks += sampled
    bucket.ready = bucket.checks >= rt.verify
    return hand_out(bucket, n)
