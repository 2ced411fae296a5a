"""Debug mode of :class:`~accel_graph.runner.GraphRunner`: the outputs contract, checked.

A runner returns views into its graphs' static outputs: valid until the next call of the same
bucket, or of any bucket with ``share_outputs=True``. In debug mode each call keeps a snapshot
of what it returned; the next call first checks that those tensors still hold it (if not,
something else wrote into them between calls: another runner capturing into the same pool,
or the caller) and then fills them with the recorder's poison (NaN, True, 0x5A...), so code
that keeps a returned view past the next call reads poison, not plausible numbers from another
bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..backends.capture_common.poison import poison
from .runtime import RunnerRuntime

__all__ = ["debug_call"]

log = logging.getLogger("accel_graph")


def debug_call(rt: RunnerRuntime, serve: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
    """``serve(args, kwargs)`` with the previous call's outputs checked and poisoned first, and
    this call's outputs snapshotted after. Inputs that are (views of) the previous outputs, as
    when a decode loop feeds its tokens back, are cloned before the poisoning."""
    if rt.last_returned:
        storages = {t.untyped_storage().data_ptr() for t, _ in rt.last_returned}

        def detach_from_outputs(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in storages:
                return x.clone()
            return x

        args, kwargs = pytree.tree_map(detach_from_outputs, (args, kwargs))
    _check_and_poison(rt)
    out = serve(args, kwargs)
    if not rt.copy_outputs:  # copies belong to the caller
        rt.last_returned = [(t, t.clone()) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return out


def _check_and_poison(rt: RunnerRuntime) -> None:
    changed = [i for i, (t, snap) in enumerate(rt.last_returned) if not _same(t, snap)]
    if changed:
        rt.stale_output_warnings += 1
        log.warning(
            "GraphRunner (debug): outputs %s of the previous call changed before this call "
            "started; the runner did not write them, so another graph replayed into the same "
            "pool (a second runner sharing it?) or the caller wrote into a returned view. "
            "Pass copy_outputs=True or clone what you keep", changed)
    for t, _ in rt.last_returned:
        poison(t)  # the recorder's poison fill: NaN, True, 0x5A...
    rt.last_returned = []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)
