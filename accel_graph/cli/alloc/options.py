"""What every ``accel-alloc`` command shares on the way in and out: exit codes, the user-error
type, and the argparse options.

Exit codes (stable; scripts may rely on them, see docs/accel-alloc.md):

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
0      success
1      a check failed: ``validate --max-error`` exceeded, ``diff --fail-above`` regression gate
2      usage error (unknown option, missing argument, bad --torch; argparse's own code)
3      a config string PyTorch would reject (unknown key, bad value, bad separator)
4      a trace file that cannot be read: missing, empty, truncated, corrupt, hostile (pickle
       globals, memo bombs, objects out of proportion to the file), wrong types, absurd sizes
5      a trace that was read but cannot be simulated: unknown device type, no events for the
       chosen device, more than 64 streams (all but ``inspect``), an unknown profile or policy
6      an impossible capacity: ``--cap`` smaller than the trace's largest allocation
7      an optional dependency is missing (``plot`` needs matplotlib: ``pip install
       'accel-graph[plot]'``)
70     an internal error (a bug: please report it with the command line)
=====  ==========================================================================================


Errors print one line, ``accel-alloc COMMAND: error: ...``, on stderr (:class:`CliError`,
:func:`guarded`); nothing in an input file is ever executed (pickles go through an unpickler
that refuses every global).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, NoReturn

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_BAD_TRACE",
    "EXIT_CAP",
    "EXIT_CHECK_FAILED",
    "EXIT_INTERNAL",
    "EXIT_MISSING_DEP",
    "EXIT_OK",
    "EXIT_UNSUPPORTED",
    "EXIT_USAGE",
    "SCHEMA_VERSION",
    "CliError",
    "OneLineParser",
    "add_cap_option",
    "add_json_option",
    "add_profile_option",
    "add_scenario_options",
    "add_trace_options",
    "guarded",
    "parse_size",
    "rules_line",
    "torch_version",
    "warn",
]


EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_CONFIG = 3
EXIT_BAD_TRACE = 4
EXIT_UNSUPPORTED = 5
EXIT_CAP = 6
EXIT_MISSING_DEP = 7
EXIT_INTERNAL = 70

#: Bumped only when a JSON field changes meaning or disappears (adding fields keeps it).
SCHEMA_VERSION = 1


class CliError(Exception):
    """An error the user can fix; ``code`` is the process exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line on stderr, as every other error of
    ``accel-alloc`` (``accel-alloc tune: error: ...; see accel-alloc tune --help``), exit 2.
    argparse's own form (the usage block, then the message) spans several lines."""

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's contract
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


# ---------------------------------------------------------------------------------------------
# sizes

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"512m"``, ``"1073741824"`` -> bytes (binary units; ``GB`` means GiB here,
    as in ``nvidia-smi``). Raises ``argparse.ArgumentTypeError`` with the accepted forms."""
    t = text.strip().lower().replace("_", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):].strip()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with a unit, e.g. 80GiB, 512MiB"
        )
    if _UNITS[unit] == 1 and value != int(value):
        # "--cap 0.9" is a memory fraction typed where a size goes; "1.5" bytes is no size
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of bytes; give the device size with a unit, e.g. "
            "80GiB (a memory fraction goes in the config: per_process_memory_fraction:0.9)"
        )
    size = int(value * _UNITS[unit])
    if size >= 1 << 60:  # 1 EiB: no device is that large, and the engine counts in int64
        raise argparse.ArgumentTypeError(f"{text!r} is larger than any device (limit 1 EiB)")
    return size


# ---------------------------------------------------------------------------------------------
# options shared by commands


def add_json_option(parser: argparse.ArgumentParser, doc: str = "docs/accel-alloc.md") -> None:
    """``--json``: print one JSON document (:func:`accel_graph.cli.output.emit`) instead of text."""
    parser.add_argument("--json", action="store_true",
                        help=f"print one JSON document (schema in {doc}) instead of text")


def add_trace_options(parser: argparse.ArgumentParser, *, nargs: str | None = None) -> None:
    """``TRACE`` plus ``--device-type`` and ``--device``."""
    # Imported here for start-up time only (not a cycle): `accel-alloc --version` and the
    # command list need no device table.
    from ...allocator.devices import DEVICE_TYPES

    if nargs is None:
        parser.add_argument("trace", metavar="TRACE",
                            help="snapshot pickle (dict or legacy list; CUDA, ROCm, XPU, NPU), "
                            "accel-graph JSON or compact trace, or RMM logging CSV")
    parser.add_argument("--device-type", choices=DEVICE_TYPES, default=None,
                        help="override the device type the file says or implies")
    parser.add_argument("--device", type=int, default=None, metavar="N",
                        help="device index to use (default: the one with the most events)")


def add_scenario_options(parser: argparse.ArgumentParser, *, config_required: bool = False,
                         multiple_configs: bool = False) -> None:
    """``--config``, ``--policy``, ``--profile``, ``--cap``, ``--capacity``."""
    if multiple_configs:
        parser.add_argument("--config", action="append", default=None, metavar="STR",
                            help="allocator config in PYTORCH_ALLOC_CONF grammar; repeat for "
                            "several; 'recorded' = the settings the trace was recorded with "
                            "(the default)")
    else:
        parser.add_argument("--config", required=config_required, default=None, metavar="STR",
                            help="allocator config in PYTORCH_ALLOC_CONF grammar, e.g. "
                            "'expandable_segments:True,max_split_size_mb:256'; 'recorded' (the "
                            "default) = the settings the trace was recorded with")
    # pure Python (no torch, no compiled core): the help lists every engine policy
    from ...allocator.core.settings import POLICIES, POLICY_MODELS

    policies = ", ".join(f"{name} ({POLICY_MODELS[name]})" for name in POLICIES)
    parser.add_argument("--policy", default=None, metavar="NAME",
                        help=f"allocator policy to simulate: {policies} (default: the profile's)")
    add_profile_option(parser)
    add_cap_option(parser)


def add_profile_option(parser: argparse.ArgumentParser) -> None:
    """``--profile NAME`` (the torch version x device profile to simulate) and ``--torch X.Y``
    (the torch the trace ran under: picks the config-parser rules and the default profile)."""
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="torch version x device profile, e.g. cuda-2.14, cuda-2.13, cuda-2.9, "
                        "rocm-2.13, npu, xpu (default: from --torch, else the trace's device "
                        "type, newest torch); `accel-alloc simulate --list-profiles` lists them")
    parser.add_argument("--torch", type=torch_version, default=None, metavar="X.Y",
                        help="the torch version the trace ran under, e.g. 2.13 or 2.14.1: read "
                        "configs with that torch's PYTORCH_ALLOC_CONF rules and, without "
                        "--profile, simulate its profile (default: the newest torch, which every "
                        "trace's evidence allows)")


def torch_version(text: str) -> str:
    """``--torch``'s type: ``"2.14.1+cu130"`` -> ``"2.14"``; an argparse error (exit 2) naming the
    accepted forms and the known rules otherwise."""
    from ...allocator.alloc_conf import parse_torch_version, rules_for
    from ...errors import ConfigError

    try:
        rules_for(text)
        major, minor = parse_torch_version(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{major}.{minor}"


def add_cap_option(parser: argparse.ArgumentParser, role: str = (
        "allocations beyond it retry, release the cache and finally fail as out-of-memory "
        "events")) -> None:
    """``--cap BYTES``: the simulated device size; ``role`` says what it does for the command."""
    parser.add_argument("--cap", type=parse_size, default=None, metavar="BYTES",
                        help=f"device memory to simulate (e.g. 80GiB; binary units: GB means "
                        f"GiB, 2**30 bytes, as nvidia-smi counts): {role}")



def guarded(fn: Any) -> Any:
    """Run ``fn()`` turning the library's user errors into :class:`CliError` exit codes."""
    from ...errors import CapacityError, ConfigError, TraceFormatError, UnsupportedTraceError

    try:
        return fn()
    except TraceFormatError as e:
        raise CliError(str(e), EXIT_BAD_TRACE) from None
    except CapacityError as e:
        raise CliError(str(e), EXIT_CAP) from None
    except UnsupportedTraceError as e:
        raise CliError(str(e), EXIT_UNSUPPORTED) from None
    except ConfigError as e:
        raise CliError(str(e), EXIT_BAD_CONFIG) from None


# ---------------------------------------------------------------------------------------------

def rules_line(rules: dict[str, str] | None) -> str:
    """The human line saying which torch's PYTORCH_ALLOC_CONF rules read the configs."""
    if not rules:
        return "config rules: unknown"
    return (f"config rules: torch {rules['torch']}'s PYTORCH_ALLOC_CONF parser (chosen by "
            f"{rules['chosen_by']}; --torch X.Y sets the trace's torch)")



def warn(message: str) -> None:
    """A warning line on stderr (never mixed into ``--json`` output on stdout)."""
    print(f"accel-alloc: warning: {message}", file=sys.stderr)
