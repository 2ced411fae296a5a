"""The serving engine over the tensor-parallel decoder, one process per rank, under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 -m accel_graph.serving.tp_demo \\
        --requests 16 --rate inf --json tp.json

Rank 0 runs the :class:`~.engine.Engine` over a :class:`~.engine_tp.LeaderExecutor` (it
schedules, and broadcasts each step); every other rank follows (:func:`~.engine_tp.follow`).
Each rank holds its :class:`~accel_graph.models.TPDecoder` shard in an ``EagerExecutor`` or
(``--graph``) a ``GraphExecutor``. Rank 0 prints a summary and writes ``--json``: the options,
the figures, and every request's tokens (for comparison with the single-process engine).

Backend: gloo on the CPU (the default); on GPUs pass ``--backend nccl`` (each rank then uses
``cuda:LOCAL_RANK``, and the step broadcasts travel on the GPU as NCCL requires).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["main", "serve_tp"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m accel_graph.serving.tp_demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (default inf)")
    p.add_argument("--prompt-lens", default="4:40")
    p.add_argument("--max-new-tokens", default="4:16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--graph", action="store_true", help="GraphExecutor (default: EagerExecutor)")
    p.add_argument("--no-compile", action="store_true", help="with --graph: interpreted replay")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo, nccl)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout in seconds: a rank left waiting fails after it")
    p.add_argument("--json", type=Path, default=None)
    return p


def serve_tp(args: argparse.Namespace) -> dict[str, Any] | None:
    """Serve the stream of ``args`` on this rank of an initialised group; rank 0 returns the
    report, the others None."""
    import torch
    import torch.distributed as dist

    from .engine import Engine
    from .engine_tp import LeaderExecutor, follow
    from .executors import EagerExecutor, GraphExecutor, serving_config
    from .metrics import summarize
    from .workload import parse_range, poisson_requests

    rank = dist.get_rank()
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
              if args.backend == "nccl" else torch.device("cpu"))
    config = serving_config(max_batch=args.slots)
    kwargs: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.graph:
        kwargs["compile"] = None if args.no_compile else "inductor"
    cls = GraphExecutor if args.graph else EagerExecutor
    with torch.device(device):
        executor = cls.from_config(config, process_group=dist.group.WORLD, tensor_parallel=True,
                                   **kwargs)
    if rank != 0:
        follow(executor, device=device)
        return None
    stream = poisson_requests(args.requests, args.rate, parse_range(args.prompt_lens, "--prompt-lens"),
                              parse_range(args.max_new_tokens, "--max-new-tokens"),
                              vocab_size=config.vocab_size, seed=args.seed)
    with LeaderExecutor(executor, device=device) as leader:  # followers stop on leaving
        run = Engine(leader, vocab_size=config.vocab_size).run(stream)
    return {"schema": "accel_graph.serving-tp/1", "world_size": dist.get_world_size(),
            "backend": args.backend, "executor": executor.kind,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "figures": summarize(run.results, run.elapsed_s), "steps": run.stats["steps"],
            "tokens": [r.tokens for r in run.results],
            "finish_reasons": [r.finish_reason for r in run.results]}


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: join the group from the environment, serve, leave; 0 on success."""
    import torch
    import torch.distributed as dist

    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: python -m torch.distributed.run --nproc-per-node 2 -m "
              "accel_graph.serving.tp_demo ...", file=sys.stderr)
        return 2
    if args.backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        report = serve_tp(args)
    finally:
        # The executor's captured graphs hold the process group (their recorded collectives)
        # in reference cycles; free them while the group is alive, so gloo's threads are not
        # torn down at interpreter exit (which aborted rank 0 now and then: "terminate called
        # without an active exception").
        gc.collect()
        dist.destroy_process_group()
    if report is not None:
        f = report["figures"]
        print(f"tp_demo: {report['world_size']} ranks ({report['backend']}, {report['executor']}):"
              f" {f['served']} requests served, {f['generated_tokens']} tokens in "
              f"{f['elapsed_s']:.2f} s ({f['tokens_per_s']:.0f} tokens/s), {report['steps']} steps")
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
