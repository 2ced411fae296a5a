"""The ``accel-graph`` console script: a registry of subcommands, imported only when chosen.

Adding a subcommand is one line in :data:`COMMANDS` plus a module that defines::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...   # its options
    def run(args: argparse.Namespace) -> int: ...                      # the exit status

``accel-graph --help`` lists every command from the one-line help strings here and imports no
command module, so it stays quick; only the chosen command's module is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = ["COMMANDS", "build_parser", "main", "package_version"]

#: name -> (module defining add_arguments/run, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "accel_graph.cli.demo",
        "serve the bundled decoder from captured graphs: check tokens, time it",
    ),
    "bench": (
        "accel_graph.cli.bench",
        "time the bundled decoder's decode step (--models: decoder and ResNet): eager vs "
        "graph replay vs torch.compile",
    ),
    "doctor": (
        "accel_graph.cli.doctor",
        "what accel-graph sees here: backends, versions, arch, allocator",
    ),
    "serve-bench": (
        "accel_graph.cli.serve_bench",
        "serve one request stream with the eager and the graph engine: tokens/s, TTFT, TPOT",
    ),
}

PROG = "accel-graph"


def package_version() -> str:
    """The installed accel-graph version, or a note that the source tree is not installed
    (the ``--version`` of both command-line tools)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("accel-graph")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version`` that looks the version up only when asked."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: object
    ) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        parser.exit(message=f"{PROG} {package_version()}\n")


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first token that is not an option), if any."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("-"):
            return token
    return None


def build_parser(
    argv: Sequence[str] = (),
    *,
    prog: str = PROG,
    commands: dict[str, tuple[str, str]] | None = None,
    description: str = "Device graphs and a pluggable caching allocator for PyTorch.",
    version: str | None = None,
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """The top-level parser. Only the command chosen in ``argv`` gets its options (and its
    module imported); the others appear in ``--help`` by name and help line.

    ``prog``/``commands``/``description`` let other console scripts (``accel-alloc``) share the
    registry mechanism; the defaults build ``accel-graph``. ``parser_class`` is the parser type
    (subcommand parsers inherit it), e.g. one whose usage errors are a single line.
    """
    parser = parser_class(prog=prog, description=description)
    if version is not None:
        parser.add_argument("--version", action="version", version=f"{prog} {version}")
    else:
        parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    chosen = _chosen(argv)
    for name, (module_name, help_line) in (COMMANDS if commands is None else commands).items():
        cmd = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd)
            cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``accel-graph``: parse ``argv`` (default ``sys.argv[1:]``), run the chosen
    command and return its exit status. A ``ConfigError`` (bad settings) exits with status 2 and one line on stderr."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except ConfigError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
