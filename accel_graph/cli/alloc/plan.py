"""``accel-alloc plan --model decoder --buckets 1,2,4,8 -o FILE``: a graph pool's trace, planned.

The command-line face of ``GraphRunner.plan_memory(trace=...)`` for the bundled models: a
``GraphRunner`` over the bundled decoder's decode step (``--model decoder``) or the bundled
ResNet (``--model resnet``) on the CPU is planned over the ladder ``--buckets`` (largest first,
one pool; nothing is captured, no kernel runs) and the planned pool's allocations are written as
a memory-snapshot trace (format by extension, as ``accel-alloc generate``). ``accel-alloc tune
FILE`` then ranks allocator settings for that graph pool. ``--config`` plans under an allocator
config string (default: torch's defaults). Prints the plan's pool figures, or with ``--json``
the plan itself (schema ``accel_graph.runner.memory-plan/1``, docs/runner.md "Memory plan").

Your own model: call ``runner.plan_memory(trace="pool.pkl")`` on its ``GraphRunner``, or
``accel_graph.plan_graph_memory(fn, inputs, trace=...)`` for one graph.
"""

from __future__ import annotations

import argparse
from typing import Any

from ...allocator.units import fmt_bytes
from ..output import emit
from .options import EXIT_USAGE, CliError, add_json_option, guarded

MODELS = ("decoder", "resnet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, choices=MODELS,
                        help="bundled model: decoder (decode step) or resnet (forward)")
    parser.add_argument("--buckets", default="1,2,4,8", metavar="LIST",
                        help="batch-size ladder, comma-separated (default 1,2,4,8)")
    parser.add_argument("--dim", type=int, default=None, metavar="N",
                        help="decoder width (default: DecoderConfig's)")
    parser.add_argument("--vocab", type=int, default=None, metavar="N",
                        help="decoder vocabulary (default: DecoderConfig's)")
    parser.add_argument("--config", default=None, metavar="STR",
                        help="allocator config the plan assumes, PYTORCH_ALLOC_CONF grammar "
                        "(default: torch's defaults)")
    parser.add_argument("-o", "--out", "--output", dest="output", required=True, metavar="FILE",
                        help="trace to write (.pkl/.pickle snapshot pickle, .json JSON, else "
                        "compact)")
    add_json_option(parser, "docs/runner.md")


def _buckets(text: str) -> list[int]:
    try:
        ladder = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CliError(f"--buckets must be comma-separated integers, got {text!r}", EXIT_USAGE) from None
    if not ladder or ladder[0] < 1:
        raise CliError(f"--buckets needs batch sizes >= 1, got {text!r}", EXIT_USAGE)
    return ladder


def _runner(args: argparse.Namespace, ladder: list[int]) -> Any:
    import torch

    import accel_graph

    if args.model == "decoder":
        from ...models.decoder import Decoder, DecoderConfig

        sizes: dict[str, int] = {"max_batch": ladder[-1]}
        if args.dim is not None:
            sizes.update(dim=args.dim, mlp_hidden=3 * args.dim)
        if args.vocab is not None:
            sizes["vocab_size"] = args.vocab
        model = Decoder(DecoderConfig(**sizes))
        ex = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        return accel_graph.GraphRunner(model.decode_step, ex, buckets=ladder, progress=False,
                                       device="cpu")
    from ...models.resnet import ResNet

    model = ResNet()
    return accel_graph.GraphRunner(model, model.example_input(1), buckets=ladder, progress=False,
                                   device="cpu")


def run(args: argparse.Namespace) -> int:
    ladder = _buckets(args.buckets)
    for name in ("dim", "vocab"):
        value = getattr(args, name)
        if value is not None and value < 2:
            raise CliError(f"--{name} must be >= 2", EXIT_USAGE)
    runner = guarded(lambda: _runner(args, ladder))
    try:
        plan = guarded(lambda: runner.plan_memory(trace=args.output, alloc_conf=args.config))
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}", EXIT_USAGE) from None
    text = (f"planned {args.model} ladder {ladder}: pool {fmt_bytes(plan['pool_reserved_bytes'])} "
            f"(peak {fmt_bytes(plan['pool_peak_reserved_bytes'])}), warm-up peak "
            f"{fmt_bytes(plan['warmup_peak_bytes'])}, in {plan['planning_seconds']:.2f} s; "
            f"trace written to {args.output} (accel-alloc tune {args.output})")
    emit(args, plan, text)
    return 0
