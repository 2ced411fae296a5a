"""The first-replay check: every rank of a group recorded the same collectives on it.

A graph's :class:`Signature` lists its collectives per process group (descriptions from
:func:`.collectives.describe`). At the graph's first replay (the graph runs :func:`first_replay_check` once, then replays without it)
every rank gathers, per group, two int64 from each member: the number of collectives and a hash
of their descriptions. Only when they differ are the descriptions themselves exchanged, so the
:class:`~accel_graph.errors.ReplayError` every rank raises names the rank and the first op that
differs. A rank that never joins makes the gather fail after the group's timeout, not hang.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import ReplayError
from .collectives import IDENTITY, describe, group_of, role

__all__ = ["Signature", "first_replay_check", "signature_of"]


class Signature:
    """The collectives of one graph, per process group in order of first use: what the first
    replay compares across ranks. ``entries`` holds ``(group, description)`` in capture order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[tuple[Any, str]] = []
        self.groups: dict[str, Any] = {}

    def add(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        if role(func) == IDENTITY:
            return
        group = group_of(func, args, kwargs)
        self.groups.setdefault(group.group_name, group)
        self.entries.append((group, describe(func, args, kwargs)))

    def __len__(self) -> int:
        return len(self.entries)

    def on(self, name: str) -> list[str]:
        """Descriptions of the collectives on group ``name``, in order."""
        return [d for g, d in self.entries if g.group_name == name]


def _hash64(items: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _collective_device(group: Any, fallback: torch.device) -> torch.device:
    """The device whose tensors ``group``'s backend takes (CPU for gloo)."""
    try:
        name = str(torch.distributed.get_backend(group)).lower()
    except Exception:
        return fallback
    return torch.device("cpu") if name in ("gloo", "mpi") else fallback


def first_replay_check(sig: Signature) -> None:
    """Check that every rank of each group the graph uses recorded the same collectives on it.

    One ``all_gather`` of ``(count, hash)`` per group (two int64 per rank); only on a mismatch
    the descriptions themselves are exchanged to name the rank and the op. Raises ReplayError;
    a rank that never joins the check makes it fail after the group's timeout, not hang.
    """
    dist = torch.distributed
    me = dist.get_rank()
    for name, group in sig.groups.items():
        mine = sig.on(name)
        device = _collective_device(group, sig.device)
        local = torch.tensor([len(mine), _hash64(mine)], dtype=torch.int64, device=device)
        size = dist.get_world_size(group)
        gathered = torch.empty(2 * size, dtype=torch.int64, device=device)
        try:
            with warnings.catch_warnings():  # torch 2.13 renames it; the op is the same
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(gathered, local, group=group)
        except Exception as exc:
            raise ReplayError(
                f"rank {me}: the first replay's check that every rank of process group {_shown(name, group)} "
                f"(size {size}) captured the same collectives failed before collective #0 "
                f"({mine[0]}): {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}. "
                f"A rank of the group did not replay a graph with collectives on this group (it "
                f"captured a different program, or replays graphs in another order), or the group "
                f"timed out. Every rank must capture the same collectives and replay the same "
                f"graphs in the same order."
            ) from exc
        rows = gathered.view(size, 2).tolist()
        if all(row == rows[0] for row in rows):
            continue
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        raise ReplayError(_mismatch_message(me, name, group, everyone))


def _shown(name: str, group: Any) -> str:
    """A group as error messages name it (the default group says so)."""
    world = torch.distributed.group.WORLD
    return f"{name!r} (the default group)" if group is world else repr(name)


def _mismatch_message(me: int, name: str, group: Any, everyone: list[list[str]]) -> str:
    """Which ranks' collective sequences on ``group`` differ from group rank 0's, at which op."""
    dist = torch.distributed
    ref = everyone[0]
    ref_rank = dist.get_global_rank(group, 0)
    lines = []
    for r, seq in enumerate(everyone):
        if seq == ref:
            continue
        rank = dist.get_global_rank(group, r)
        i = next((k for k, (a, b) in enumerate(zip(seq, ref)) if a != b), min(len(seq), len(ref)))
        theirs = seq[i] if i < len(seq) else "nothing (its graph ends there)"
        ours = ref[i] if i < len(ref) else "nothing (its graph ends there)"
        lines.append(f"rank {rank} records collective #{i} as {theirs}, but rank {ref_rank} "
                     f"records {ours}")
    return (
        f"rank {me}: the ranks of process group {_shown(name, group)} captured different collectives, "
        f"detected at the first replay: {'; '.join(lines)}. Every rank must capture the same "
        f"collectives (same ops, shapes, dtypes, groups, order) and replay the same graphs in the "
        f"same order; recapture on every rank."
    )


def signature_of(steps: list[Any], device: torch.device) -> Signature:
    """The :class:`Signature` of recorded steps (those of kind ``collective``)."""
    sig = Signature(device)
    for s in steps:
        if s.kind == "collective":
            sig.add(s.func, s.args, s.kwargs)
    return sig
