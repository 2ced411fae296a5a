"""Run a function on N local processes joined in a ``torch.distributed`` process group.

For tests of code that communicates (collectives inside captured graphs, tensor-parallel
models) on a CPU-only machine: :func:`run_ranks` spawns ``world_size`` processes, joins them in
a gloo group over the loopback interface on a free port, calls ``fn(rank, world_size, *args)``
in each and returns each rank's result. Everything is bounded: the group has a short timeout
(a collective that waits for a rank that never comes fails instead of hanging), and the whole
run has a deadline after which every process still alive is killed.

``fn`` and its arguments and results are pickled (processes are spawned, not forked, so torch
state is never inherited half-initialised): define ``fn`` at module level in an importable
module (a test module is fine). Spawning costs about a torch import per process, so group
many checks into one ``fn``.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import AccelGraphError, ConfigError

__all__ = ["RankFailure", "free_port", "run_ranks"]


class RankFailure(AccelGraphError):
    """One or more ranks of :func:`run_ranks` raised, died or missed the deadline. The message
    holds each failing rank's traceback; ``failures`` maps rank to that text."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, backend: str, pg_timeout: float,
            num_threads: int | None, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """One rank: join the group, run ``fn``, report ``(rank, ok, result or traceback)``."""
    import torch
    import torch.distributed as dist

    if os.path.exists("/sys/class/net/lo"):  # gloo over loopback only (Linux name)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, value))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *, args: tuple = (),
              timeout: float = 120.0, pg_timeout: float = 20.0, backend: str = "gloo",
              num_threads: int | None = 0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes in one process
    group and return the results, indexed by rank.

    Args:
        fn: a module-level function (it is pickled by name into each process).
        world_size: number of processes (>= 1).
        args: extra picklable arguments, the same for every rank.
        timeout: seconds for the whole run (spawn, import, ``fn``); processes still alive then
            are killed and :class:`RankFailure` says which ranks did not report.
        pg_timeout: the process group's timeout in seconds: a collective waiting for a rank
            that never comes fails after this long.
        backend: the ``torch.distributed`` backend (``gloo`` on the CPU).
        num_threads: ``torch.set_num_threads`` in each rank; ``0`` (the default) shares the
            CPUs out, ``os.cpu_count() // world_size`` each (at least 1), so ranks do not
            oversubscribe the machine; ``None`` leaves torch's default.

    Raises:
        ConfigError: a bad ``world_size``, ``timeout`` or ``pg_timeout``.
        RankFailure: a rank raised, exited without reporting, or missed the deadline; the
            message carries each failing rank's traceback.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 0):
        raise ConfigError(f"num_threads must be None or an int >= 0, got {num_threads!r}")
    if num_threads == 0:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    if not (timeout > 0 and pg_timeout > 0):
        raise ConfigError(f"timeout ({timeout!r}) and pg_timeout ({pg_timeout!r}) must be > 0 seconds")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, pg_timeout, num_threads, fn, args,
                                          results),
                    daemon=True, name=f"accel-graph-rank{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                # A rank that died without reporting (killed, segfault) never will: stop waiting
                # for it once every live rank has reported or the others are stuck on it.
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                if dead and all(r in got or not procs[r].is_alive() for r in range(world_size)):
                    # Drain what the dead ranks may have queued just before exiting.
                    try:
                        while True:
                            rank, ok, value = results.get(timeout=0.2)
                            got[rank] = (ok, value)
                    except queue.Empty:
                        pass
                    break
                continue
            got[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    for r, p in enumerate(procs):
        if r not in got:
            failures[r] = (f"rank {r} did not report within {timeout:g} s "
                           f"(exit code {p.exitcode}; killed if it was still running)")
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed:\n{text}", failures)
    return [got[r][1] for r in range(world_size)]
