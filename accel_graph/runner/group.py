"""Agreement between the ranks of a process group that each run a GraphRunner.

In tensor parallelism every rank serves the same batches through its own runner, and the
captured step issues collectives. Replay on one rank and eager on another still pair their
collectives, but the runner's own extra work does not: the first replay of a bucket runs eager
*and* replay (verification), and the recorder's first replay adds a fingerprint collective. A
rank whose bucket fell back to eager while another's replays would issue a different sequence of
collectives and hang until the group's timeout. So the ranks agree, by one small all-reduce at
each point where a rank may decide alone:

- at the start of capture, on the setup (the ladder and ``verify``): :func:`check_same_setup`;
- after each bucket's capture, and after each of its checked replays (``verify``: replays 1,
  2, 4, ..., the same ones on every rank): :func:`exchange` gathers one code per rank (0 ok,
  1 this bucket cannot serve here, 2 this rank raised), so every rank sees the same list and
  disables (or raises) together. ``capture="lazy"`` is refused (:meth:`GroupInfo.build`).

Which bucket serves a batch is then a pure function of the batch size and the agreed ladder,
the same on every rank, as long as every rank is called with the same batch sizes in the same
order (the ranks of a TP group receive the same batch).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["CODE_FAILED", "CODE_OK", "CODE_RAISED", "GroupInfo", "check_same_setup", "exchange"]

#: Per-rank codes :func:`exchange` gathers.
CODE_OK, CODE_FAILED, CODE_RAISED = 0, 1, 2


@dataclass(frozen=True)
class GroupInfo:
    """The process group a runner agrees over: the group, this rank in it, its size, and the
    device the agreement tensors live on (the CPU for gloo, the runner's device otherwise, as
    NCCL/RCCL/XCCL take device tensors only)."""

    group: Any
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def build(cls, group: Any, device: torch.device, capture: str = "eager") -> GroupInfo:
        """Describe ``group`` for a runner on ``device``; ConfigError when torch.distributed is
        not initialised, ``group`` is not a process group this rank belongs to, or ``capture``
        is ``"lazy"`` (a bucket captured on its first call would need the ranks to agree inside
        the serving path; capture every bucket up front instead)."""
        import torch.distributed as dist

        if capture == "lazy":
            raise ConfigError(
                "capture='lazy' cannot be combined with process_group=: the ranks agree on each "
                "bucket at capture, so capture them all up front (capture='eager', the default)"
            )

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "process_group= needs torch.distributed initialised on every rank first "
                "(dist.init_process_group(...)); pass process_group=None for a single process"
            )
        if not isinstance(group, dist.ProcessGroup):
            raise ConfigError(
                f"process_group must be a torch.distributed ProcessGroup (for example "
                f"dist.group.WORLD or one from dist.new_group), got {type(group).__name__}"
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(
                "this process is not a member of process_group; create the runner only on its "
                "ranks (dist.new_group must be called on every rank, joined by its members)"
            )
        backend = str(dist.get_backend(group))
        on_cpu = "gloo" in backend or device.type == "cpu"
        return cls(group, rank, dist.get_world_size(group), torch.device("cpu") if on_cpu else device)


def exchange(info: GroupInfo, code: int) -> list[int]:
    """Every rank's code, by group rank: one all-reduce (sum) of a vector where each rank fills
    only its own slot. Collective: every rank of the group must call it at the same point."""
    import torch.distributed as dist

    codes = torch.zeros(info.world_size, dtype=torch.int64, device=info.device)
    codes[info.rank] = code
    dist.all_reduce(codes, group=info.group)
    return [int(c) for c in codes.tolist()]


def check_same_setup(info: GroupInfo, ladder: list[int], verify: bool) -> None:
    """Raise ConfigError on every rank when the ranks' ladders or ``verify`` settings differ
    (their capture and first-replay collectives would not pair up). Collective."""
    text = f"ladder={ladder} verify={bool(verify)}"
    hashes = exchange(info, zlib.crc32(text.encode()))
    odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
    if odd:
        raise ConfigError(
            f"GraphRunner ranks disagree on their setup: rank(s) {odd} differ from rank 0 "
            f"(this rank {info.rank}: {text}); every rank of process_group must build its "
            f"runner with the same buckets and verify="
        )


def agreed_diff(info: GroupInfo, diff: str | None) -> str | None:
    """The verification verdict of a bucket's first replay, agreed over the group: None when
    every rank's replay matched its eager run, else this rank's mismatch (or which ranks had
    one), so every rank disables the bucket together. Collective."""
    codes = exchange(info, CODE_OK if diff is None else CODE_FAILED)
    failed = [r for r, c in enumerate(codes) if c != CODE_OK]
    if not failed:
        return None
    if diff is None:
        return f"replay differed from eager on rank(s) {failed}; disabled on every rank"
    return f"{diff} (rank(s) {failed}; disabled on every rank)"
