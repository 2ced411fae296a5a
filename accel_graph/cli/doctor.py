"""``accel-graph doctor [--json] [--probe-devices]``: what accel-graph sees on this machine.

Reports every registered backend with its probe verdict and reason and its capabilities; torch,
CUDA runtime and driver, HIP and XPU versions where present; the NVIDIA arch verdict per device;
the ROCm version, gfx arch and the HIP-graph quirks that apply; the XPU route (native graph class
or recorder fallback); the allocator settings in effect (which variable, parsed, canonical); the
device allocator plug-in's state; and the recorder's status.

It never initialises a device unless ``--probe-devices`` is given (or the device runtime is
already initialised in this process): facts that need one say ``not checked: would initialise
CUDA``. Human table by default; ``--json`` prints the versioned report documented in
``docs/doctor.md`` (:data:`SCHEMA`, :data:`SCHEMA_VERSION`). The exit status is 0 whenever a
report was produced, problems or not (they are listed under ``problems``).

This module is the command: its options, :func:`collect` (which assembles the sections and
turns a failing one into a problem) and the output. The sections are
:mod:`accel_graph.cli.doctor_sections`; the human table is :mod:`accel_graph.cli.doctor_text`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..backends.device_facts import safe as _safe
from .doctor_sections import (
    allocator_section,
    backend_entries,
    graph_apis_section,
    recorder_section,
    routing_section,
    sectioned_backends,
    torch_section,
    versions_section,
)
from .doctor_text import format_report
from .output import json_text, write_json

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "add_arguments",
    "collect",
    "format_report",
    "run",
]

SCHEMA = "accel-graph.doctor"
#: Bump on any change that removes or retypes a key (adding keys keeps the version).
SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph doctor``."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (docs/doctor.md)")
    parser.add_argument(
        "--probe-devices",
        action="store_true",
        help="initialise CUDA/HIP/XPU to read per-device facts (capability, arch verdict, gfx arch)",
    )
    parser.add_argument("--out", metavar="PATH", help="also write the JSON report to PATH")


def run(args: argparse.Namespace) -> int:
    """Collect, print (table or JSON) and optionally write the report. Returns 0."""
    report = collect(probe_devices=bool(args.probe_devices))
    if args.out:
        write_json(Path(args.out), report, allow_nan=True)
    print(json_text(report, sort_keys=False) if args.json else format_report(report))
    return 0


def collect(probe_devices: bool = False, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (schema in docs/doctor.md). Never raises.

    ``environ`` defaults to ``os.environ`` (the allocator variables and ``ACCEL_GRAPH_*``).
    """
    env = os.environ if environ is None else environ
    import accel_graph

    problems: list[str] = []
    cuda_init_before, _ = _safe(lambda: bool(torch.cuda.is_initialized()), False)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "accel_graph_version": accel_graph.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "probe_devices": bool(probe_devices),
        "cuda_initialized_before": cuda_init_before,
        "torch": torch_section(),
    }
    report["versions"] = versions_section(problems)
    got, err = _safe(backend_entries, ([], []))
    report["backends"] = got[0]
    problems.extend(got[1])
    if err:
        problems.append(f"doctor could not collect 'backends': {err}")
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("routing", lambda: routing_section(env, probe_devices, problems)),
        ("graph_apis", graph_apis_section),
    ]
    for cls in sectioned_backends():  # nvidia, rocm, xpu: each native backend's own section
        key = cls.doctor_key or cls.name
        sections.append((key, lambda c=cls: c.doctor_section(probe_devices, problems)))
    sections += [
        ("allocator", lambda: allocator_section(env, problems)),
        ("recorder", lambda: recorder_section(env)),
    ]
    for key, fn in sections:
        report[key], err = _safe(fn)
        if err:
            problems.append(f"doctor could not collect {key!r}: {err}")
    if not any(b["usable"] for b in report["backends"]):
        problems.append("no backend is usable: accel_graph.Graph cannot be created here")
    report["problems"] = problems
    return report


if __name__ == "__main__":  # pragma: no cover
    from .main import main

    sys.exit(main(["doctor", *sys.argv[1:]]))
