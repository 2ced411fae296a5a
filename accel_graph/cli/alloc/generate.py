"""``accel-alloc generate --workload NAME -o FILE``: a calibrated synthetic trace.

The command-line face of :func:`accel_graph.allocator.sim.generate.generate` (docs/trace-generator.md):
the workload's alloc/free program run through the C engine under ``--config`` (default: torch's
defaults), written as a snapshot pickle (readable by ``python -m torch.cuda._memory_viz`` and
pytorch.org/memory_viz), accel-graph JSON or the compact binary format. The format follows the
extension unless ``--format`` says otherwise: ``.pkl``/``.pickle`` pickle, ``.json`` JSON,
anything else compact. Prints one summary line, or with ``--json`` the document
``accel-alloc/generate/1`` with the trace's calibration statistics (``trace_stats``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from ...allocator.units import fmt_bytes
from ..output import emit
from .options import (
    EXIT_CAP,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
    SCHEMA_VERSION,
    CliError,
    add_json_option,
    guarded,
)

#: The generator's workloads (kept equal to ``generate.WORKLOADS``; a test checks it), listed
#: here so that ``--help`` and argparse's choices need no import of the engine.
WORKLOAD_NAMES = ("train", "shapes", "moe", "serve", "rl", "frag", "pin")
FORMAT_BY_EXT = {".pkl": "pickle", ".pickle": "pickle", ".json": "json"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", "-w", required=True, choices=WORKLOAD_NAMES,
                        help="train (dense LM step), shapes (varying sequence length), moe, "
                        "serve (KV cache + graph capture), rl (train/generate with offload), "
                        "frag (known fragmentation), pin (the pytorch#193400 pattern)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="training steps / serving rounds / RL iterations (default: per "
                        "workload)")
    parser.add_argument("--scale", type=float, default=0.25, metavar="F",
                        help="hidden size relative to d=2560 (default 0.25: d=640)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="transformer layers (default 8)")
    parser.add_argument("--config", default=None, metavar="STR",
                        help="allocator config the trace is generated under, PYTORCH_ALLOC_CONF "
                        "grammar (default: torch's defaults)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="file to write")
    parser.add_argument("--format", choices=("pickle", "json", "compact"), default=None,
                        help="output format (default from the extension: .pkl/.pickle pickle, "
                        ".json JSON, anything else compact)")
    add_json_option(parser, "docs/accel-alloc-plot-diff-generate.md")


def output_format(path: str, given: str | None) -> str:
    if given is not None:
        return given
    return FORMAT_BY_EXT.get(os.path.splitext(path)[1].lower(), "compact")


def run(args: argparse.Namespace) -> int:
    from ...allocator.alloc_conf import parse_config
    from ...allocator.sim.generate import generate, trace_stats
    from ...allocator.traces import save_trace

    if args.steps is not None and args.steps < 1:
        raise CliError("--steps must be >= 1", EXIT_USAGE)
    if not (args.scale > 0 and math.isfinite(args.scale)):
        raise CliError("--scale must be a finite number > 0", EXIT_USAGE)
    if args.layers is not None and args.layers < 1:
        raise CliError("--layers must be >= 1", EXIT_USAGE)
    fmt = output_format(args.output, args.format)
    settings = None
    if args.config is not None:
        settings = guarded(lambda: parse_config(args.config))
        if settings.backend != "native":
            raise CliError(f"backend:{settings.backend} hands allocation to the driver's "
                           "stream-ordered pool, which the generator's engine does not model; "
                           "generate under backend:native settings", EXIT_UNSUPPORTED)
        if settings.per_process_memory_fraction != 1.0:
            raise CliError("per_process_memory_fraction is a fraction of the device's memory, "
                           "and generate simulates no device size; leave it out (apply it later "
                           "with `accel-alloc simulate --cap SIZE --config ...`)", EXIT_CAP)
    trace = guarded(lambda: generate(args.workload, seed=args.seed, steps=args.steps,
                                     scale=args.scale, layers=args.layers, settings=settings))
    try:
        save_trace(trace, args.output, format=fmt)
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}", EXIT_USAGE) from None
    stats = trace_stats(trace)
    gen = (trace.allocator_settings or {}).get("accel_graph_generator", {})
    payload: dict[str, Any] = {
        "schema": f"accel-alloc/generate/{SCHEMA_VERSION}",
        "output": args.output,
        "format": fmt,
        "bytes": os.path.getsize(args.output),
        "workload": args.workload,
        "seed": args.seed,
        "steps": gen.get("steps", args.steps),
        "scale": args.scale,
        "layers": gen.get("layers", args.layers),
        "config": settings.to_string() if settings is not None else None,
        "device_type": trace.device_type,
        "events": trace.num_events,
        "stats": stats,
    }
    emit(args, payload, render(payload))
    return 0


def render(p: dict[str, Any]) -> str:
    s = p["stats"]
    return (f"wrote {p['output']} ({p['format']}, {fmt_bytes(p['bytes'])}): {p['workload']} "
            f"seed {p['seed']}, {p['steps']} steps, {p['events']} events, "
            f"{s['allocs']} allocations, peak reserved {fmt_bytes(s['peak_reserved'])}, "
            f"peak allocated {fmt_bytes(s['peak_allocated'])}"
            + (f", config {p['config']}" if p["config"] else ""))
