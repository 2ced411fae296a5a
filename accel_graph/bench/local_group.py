"""Run a function on N local processes joined in a gloo process group over loopback.

Used by ``accel-graph demo --tp``, the tensor-parallel benchmark and the tests: no torchrun,
nothing beyond 127.0.0.1. The processes are started with ``torch.multiprocessing``'s *spawn*
context (fresh interpreters: no forked torch state), rank ``r`` runs ``fn(r, world, *args)``
inside ``dist.init_process_group("gloo", ...)`` and sends its return value back.

Bounded in time: each rank's group has ``pg_timeout_s`` (a collective that never pairs up fails
after it instead of hanging), and the parent gives up after ``timeout_s``, kills the ranks still
running and raises. When a rank fails, the others are killed at once (they would only wait in
their next collective) and its traceback is raised in the parent.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import AccelGraphError, ConfigError

__all__ = ["LocalGroupError", "free_port", "run_local_group"]


class LocalGroupError(AccelGraphError):
    """A rank of :func:`run_local_group` raised, died or ran past the time limit; the message
    names the rank and carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, pg_timeout_s: float,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """One rank: join the group, run ``fn``, send ``(rank, ok, value or traceback)``."""
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, as text
        results.put((rank, False, traceback.format_exc()))


def run_local_group(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
                    pg_timeout_s: float = 30.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes in one gloo group; return
    their results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function), and so must each
    result. Raises ConfigError for ``world < 1`` and LocalGroupError when a rank raises (its
    traceback in the message), dies without a result, or the whole run takes longer than
    ``timeout_s``; the other ranks are killed first, so nothing is left running.
    """
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, pg_timeout_s, fn, args, results),
                    daemon=True, name=f"accel-graph-rank{r}")
        for r in range(world)
    ]
    # Children inherit the environment: keep gloo on loopback even on multi-homed hosts.
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    if saved is None and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(out))
                raise LocalGroupError(
                    f"rank(s) {missing} of {world} gave no result within {timeout_s:.0f} s "
                    f"(killed); a collective that never paired up waits up to the group's "
                    f"timeout ({pg_timeout_s:.0f} s)"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise LocalGroupError(f"rank(s) {dead} died without a result (exit codes {codes})") from None
                continue
            if not ok:
                raise LocalGroupError(f"rank {rank} of {world} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive() and len(out) < world:
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    return [out[r] for r in range(world)]
