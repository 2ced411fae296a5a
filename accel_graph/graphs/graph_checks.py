"""The misuse checks :class:`accel_graph.Graph` runs before it changes state, and its warning
about an empty capture.

Each check raises the user-facing error (``ConfigError``, ``GraphStateError``,
``CaptureError``) with the words the front end has always used; none touches the graph's state,
so :mod:`accel_graph.graphs.graph` keeps the state machine and calls these where a transition
needs them. The state-order refusals (``capture_begin()`` twice, ``replay()`` before a capture)
stay in the state machine, where the states are.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import torch

from ..backends.base import CAPTURE_ERROR_MODES, Backend, DeviceSpec
from ..errors import ConfigError, GraphStateError

__all__ = [
    "EMPTY_GRAPH_MESSAGE",
    "EmptyGraphWarning",
    "check_capture_error_mode",
    "check_capturing_thread",
    "check_generator",
    "check_process_allows_capture",
    "warn_empty_capture",
]

#: torch's words when a capture recorded nothing (``CUDAGraph::capture_end``, a ``TORCH_WARN``,
#: so a ``UserWarning`` in Python); kept verbatim so filters written for torch's warning match.
EMPTY_GRAPH_MESSAGE = (
    "The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
    "on wrong device or stream."
)


class EmptyGraphWarning(UserWarning):
    """A capture recorded no work: ``replay()`` will do nothing. A ``UserWarning``, as torch's."""


def check_capture_error_mode(mode: str) -> str:
    """``mode`` if it is one of torch's capture error modes, else ``ConfigError``."""
    if mode not in CAPTURE_ERROR_MODES:
        raise ConfigError(
            f"unknown capture_error_mode {mode!r}; use one of {', '.join(CAPTURE_ERROR_MODES)}"
        )
    return mode


def check_generator(generator: object, device: DeviceSpec) -> torch.Generator:
    """``generator`` if ``register_generator_state`` may take it for a graph on ``device``
    (a ``torch.Generator`` of the graph's device type), else ``ConfigError``."""
    if not isinstance(generator, torch.Generator):
        raise ConfigError(
            f"register_generator_state(generator) takes a torch.Generator, got "
            f"{type(generator).__name__}"
        )
    want = device.torch_device.type
    if generator.device.type != want:
        raise ConfigError(
            f"register_generator_state: the generator is on {generator.device}, the graph on "
            f"{device}; pass a generator of the graph's device "
            f"(torch.Generator(device={want!r}))"
        )
    return generator


def check_capturing_thread(owner: threading.Thread | None, mode: str, device: DeviceSpec,
                           what: str) -> None:
    """Refuse ending a capture from a thread other than ``owner``, the one that began it, as
    CUDA does (``cudaErrorStreamCaptureWrongThread``) unless the capture is ``"relaxed"``.
    Allowed: a ``relaxed`` capture (the capturing thread then runs eagerly), and a capture whose
    thread has exited (nobody else can end it; the recorder invalidated it at the exit)."""
    here = threading.current_thread()
    if owner is None or owner is here or not owner.is_alive() or mode == "relaxed":
        return
    raise GraphStateError(
        f"Graph.{what} was called from thread {here.name!r} (ident {here.ident}), but the "
        f"capture on {device} is underway on thread {owner.name!r} (ident "
        f"{owner.ident}) in capture_error_mode={mode!r}: as on CUDA, only a "
        f"'relaxed' capture may be ended or reset from another thread. Call {what} from "
        f"thread {owner.name!r}, or capture with capture_error_mode='relaxed'"
    )


def check_process_allows_capture(backend: Backend, device: DeviceSpec) -> None:
    """Raise ``CaptureError`` when a process-wide state forbids device-graph capture here:
    the allocator plug-in installed as the whole-process CUDA allocator (torch keeps the
    graph-pool hooks of pluggable allocators C++-only). Only native graphs are affected; the
    recorder does not use torch's graph pools."""
    if not backend.capabilities().native_graphs:
        return
    # Imported here: the plug-in module pulls in the allocator engine, which a process that
    # never captures (or never uses the plug-in) should not pay for at `import accel_graph`.
    from ..allocator.core.device_plugin import check_capture_allowed

    check_capture_allowed(device)


def _caller_stacklevel(skip: tuple[str, ...]) -> int:
    """The ``stacklevel`` that points a warning issued by our caller at the user's line, past
    the frames of the files in ``skip`` (this module, the graph's, ``contextlib``'s of
    ``with graph(g):``)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename in skip:
        frame = frame.f_back
        level += 1
    return level


def warn_empty_capture(device: DeviceSpec, graph_file: str) -> None:
    """Warn (:class:`EmptyGraphWarning`, at the user's line: frames of ``graph_file``, the
    module of the state machine, are skipped) that a capture on ``device`` recorded nothing."""
    warnings.warn(EmptyGraphWarning(
        f"{EMPTY_GRAPH_MESSAGE} (accel-graph on {device}: the capture recorded "
        f"no operation that replay would run, so replay() does nothing. Ops of other "
        f"threads are not captured; views and torch.empty run nothing at replay)"
    ), stacklevel=_caller_stacklevel((__file__, graph_file, contextlib.__file__)))
