"""The ``accel-alloc`` console script: the allocator tuning CLI.

Same registry mechanism as ``accel-graph`` (:mod:`accel_graph.cli.main`): one module per
command defining ``add_arguments(parser)`` and ``run(args) -> int``, imported only when chosen.
Every user error becomes one line on stderr and a documented exit code
(:mod:`accel_graph.cli.alloc.options`); the command never prints a traceback for bad input.

The command modules import the allocator's numpy-backed modules (and the optional matplotlib
and tqdm) inside the functions that use them: for start-up time only (``accel-alloc --help``
and argument errors stay fast, and torch is never imported). The allocator never imports the
CLI, so none of these hides an import cycle.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..main import build_parser, package_version
from .options import EXIT_INTERNAL, EXIT_USAGE, CliError, OneLineParser

__all__ = ["COMMANDS", "PROG", "main"]

PROG = "accel-alloc"

#: name -> (module defining add_arguments/run, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("accel_graph.cli.alloc.inspect",
                "what a trace recorded: peaks, utilisation, waste at the peak, top allocation sites"),
    "simulate": ("accel_graph.cli.alloc.simulate",
                 "replay a trace under another config / profile / policy / device size"),
    "validate": ("accel_graph.cli.alloc.validate",
                 "replay a trace under its own settings: the error to expect from every answer"),
    "tune": ("accel_graph.cli.alloc.tune",
             "search allocator settings for a trace; ranked table, Pareto front, line to paste"),
    "diff": ("accel_graph.cli.alloc.diff",
             "two traces, or one trace under two configs, side by side"),
    "plot": ("accel_graph.cli.alloc.plot",
             "allocated and reserved over time under one or more configs (PNG, SVG or HTML)"),
    "generate": ("accel_graph.cli.alloc.generate",
                 "write a calibrated synthetic trace (train, serve, moe, rl, ...)"),
    "plan": ("accel_graph.cli.alloc.plan",
             "plan a bundled model's graph pool (no capture) and write it as a trace to tune"),
}  # fmt: skip

DESCRIPTION = (
    "Replay recorded PyTorch allocator traces under other allocator settings, predict peak "
    "memory and device calls, and recommend a PYTORCH_ALLOC_CONF. Exit codes: 0 ok, 1 check "
    "failed, 2 usage, 3 bad config, 4 unreadable trace, 5 unsupported trace, 6 impossible cap, "
    "7 missing optional dependency, 70 internal error."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``accel-alloc``; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list, prog=PROG, commands=COMMANDS, description=DESCRIPTION,
                          version=package_version(), parser_class=OneLineParser)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as e:  # argparse: --help/--version exit 0, usage errors exit 2
        return int(e.code or 0)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(run(args) or 0)
    except CliError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `accel-alloc ... | head`
        return 0
    except MemoryError as e:  # str(MemoryError()) is "": say what ran out and what to do
        detail = f" ({e})" if str(e) else ""
        print(f"{PROG} {args.command}: error: out of host memory{detail}; the trace needs more "
              "memory than this machine has free: close other programs, or convert it with "
              "accel_graph.allocator.traces.save_trace(..., format='compact') (no stack "
              "frames, memory-mapped)", file=sys.stderr)
        return EXIT_INTERNAL
    except Exception as e:  # a bug: say so, with the type, and keep the code distinct
        import traceback

        traceback.print_exc(file=sys.stderr)
        print(f"{PROG} {args.command}: internal error ({type(e).__name__}: {e}); please report "
              "it with the command line", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
