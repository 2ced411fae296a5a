"""What every ``accel-alloc`` command reads: a trace file, the device to use, the scenario
from the shared options. Every user error becomes a :class:`~.options.CliError` with its exit
code.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ...allocator.devices import DEVICE_TYPES
from .options import EXIT_BAD_TRACE, EXIT_UNSUPPORTED, CliError, guarded, warn

__all__ = [
    "ENGINE_STREAMS",
    "FROM_ARGS",
    "NO_HISTORY",
    "RECORDED_WORDS",
    "config_text",
    "load_input",
    "pick_device",
    "scenario_from_args",
]


FROM_ARGS = object()
#: Words that mean "the settings the trace was recorded with" where a config is expected.
RECORDED_WORDS = ("recorded", "as-recorded")
#: The device families with an allocator model, as messages list them ("cuda, rocm, xpu and npu").
_MODELLED = f"{', '.join(DEVICE_TYPES[:-1])} and {DEVICE_TYPES[-1]}"


def config_text(value: str | None) -> str | None:
    """A ``--config`` value with the words of :data:`RECORDED_WORDS` (any case, surrounding
    blanks ignored) turned into None, "as recorded"; every command reads them the same way."""
    if isinstance(value, str) and value.strip().lower() in RECORDED_WORDS:
        return None
    return value


def scenario_from_args(args: argparse.Namespace, trace: Any, config: Any = FROM_ARGS,
                       device: int = 0) -> Any:
    """A :class:`~accel_graph.allocator.sim.scenario.Scenario` from the shared options (``config``
    overrides ``--config``; None or a word of :data:`RECORDED_WORDS` = as recorded), with every
    user error turned into a :class:`CliError` carrying the documented exit code. A ``--torch``
    older than the trace shows (:func:`~accel_graph.allocator.tune.versions.older_than_trace`)
    adds a note first."""
    import dataclasses

    from ...allocator.sim.scenario import make_scenario
    from ...allocator.tune.versions import infer_torch, older_than_trace

    text = config_text(args.config if config is FROM_ARGS else config)
    given = getattr(args, "torch", None)
    sc = guarded(lambda: make_scenario(
        trace, text, policy=args.policy, profile=args.profile, cap=args.cap, device=device,
        torch=given))
    # a --torch older than the trace shows: every command's notes say so (text and JSON)
    clash = older_than_trace(given, infer_torch(trace, device))
    if clash:
        sc = dataclasses.replace(sc, notes=(clash, *sc.notes))
    return sc


def load_input(path: str, device_type: str | None = None) -> Any:
    """Load any supported trace file (format sniffed from the content) as a
    :class:`~accel_graph.allocator.traces.model.Trace`. Unreadable or hostile files raise
    :class:`CliError` with :data:`EXIT_BAD_TRACE`."""
    from ...allocator.traces import load_trace

    if not os.path.exists(path):
        raise CliError(f"{path}: no such file", EXIT_BAD_TRACE)
    if os.path.isdir(path):
        raise CliError(f"{path}: is a directory; pass a trace file", EXIT_BAD_TRACE)
    trace = guarded(lambda: load_trace(path, device_type=device_type))
    foreign = getattr(trace, "unsupported_device", None)
    if trace.device_type is None and foreign:
        raise CliError(
            f"{path}: recorded on a '{foreign}' device, for which accel-alloc has no allocator "
            "model (it models " + _MODELLED + "); if its allocator is a port of PyTorch's "
            "CUDA caching allocator, pass --device-type cuda to analyse it as one",
            EXIT_UNSUPPORTED)
    return trace


#: Said when a file holds segments but no events: nothing to replay.
NO_HISTORY = ("the file holds the allocator's segments but no event history (the legacy list "
              "format of torch.cuda.memory_snapshot(), or a snapshot taken without "
              "torch.cuda.memory._record_memory_history()), so there is nothing to replay; "
              "`accel-alloc inspect` shows the state it captured. Record with "
              "_record_memory_history() before the workload to simulate it")


#: Streams the simulator's engine can replay on one device (its stream ids are 0..63).
ENGINE_STREAMS = 64


def pick_device(trace: Any, device: int | None, *, quiet: bool = False,
                replay: bool = True) -> int:
    """The device index to simulate: ``device`` if it has events, else the busiest one (with a
    warning on stderr naming the others, unless ``quiet``). With ``replay`` (every command but
    ``inspect``), a device whose events use more than :data:`ENGINE_STREAMS` streams is refused
    (:data:`EXIT_UNSUPPORTED`)."""
    chosen = _pick_device(trace, device, quiet)
    if replay:
        import numpy as np

        n = len(np.unique(trace.events(chosen)["stream"]))
        if n > ENGINE_STREAMS:
            raise CliError(f"device {chosen} of the trace uses {n} streams; the simulator replays "
                           f"at most {ENGINE_STREAMS} per device (`accel-alloc inspect` reads "
                           "it)", EXIT_UNSUPPORTED)
    return chosen


def _pick_device(trace: Any, device: int | None, quiet: bool) -> int:
    counts = {i: len(a) for i, a in enumerate(trace.device_traces)}
    if device is not None:
        if not counts.get(device):
            if not any(counts.values()) and trace.segments:
                raise CliError(NO_HISTORY, EXIT_UNSUPPORTED)
            have = ", ".join(str(i) for i, n in counts.items() if n) or "none"
            raise CliError(f"the trace has no events for device {device} (devices with events: "
                           f"{have}); pass --device with one of those", EXIT_UNSUPPORTED)
        return device
    if not any(counts.values()):
        if trace.segments:
            raise CliError(NO_HISTORY, EXIT_UNSUPPORTED)
        raise CliError("the trace has no allocator events on any device; record with "
                       "torch.cuda.memory._record_memory_history() before the workload",
                       EXIT_UNSUPPORTED)
    chosen = max(counts, key=lambda i: (counts[i], -i))
    others = [str(i) for i, n in counts.items() if n and i != chosen]
    if others and not quiet:
        warn(f"the trace has events for devices {', '.join(sorted(others + [str(chosen)]))}; "
             f"using device {chosen} (the most events): pass --device N for another")
    return chosen


# ---------------------------------------------------------------------------------------------
# output
