"""Compile failures of compiled replay, told accurately and quietly.

- :func:`failure_reason`: the cause worth a log line, from the innermost meaningful exception
  of the chain (Inductor wraps the real error: ``InductorError: ValueError: Exponent must be
  non-negative``, torch's ``_grouped_mm`` meta kernel refusing fp32 under AOT autograd).
- :func:`compiler_hint`: the C++-compiler hint, only when the compiler is the cause.
- :func:`quiet_torch_errors`: while we compile, torch's own ERROR-level records (the tracebacks
  ``torch._inductor`` and ``torch._dynamo`` log before raising) stay out of the user's log: the
  failure is handled (retried, or replay falls back to the interpreted program) and reported in
  one line of ours. With debug logging on for the ``accel_graph`` logger they pass through.
  Only records of the compiling thread are held back, and only while it compiles.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from .inductor import CompileUnsupported

log = logging.getLogger("accel_graph")

#: Loggers whose ERROR records :func:`quiet_torch_errors` holds back (children included):
#: all of torch's, since a failed compile logs its traceback from wherever it arose
#: (``torch._subclasses.fake_tensor`` for a meta kernel's refusal, ``torch._inductor``...).
TORCH_LOGGER = "torch"

# Lines of torch's messages that say how to debug, not what failed.
_BOILERPLATE = ("set torch_logs", "set torchdynamo_verbose", "for more information",
                "you can suppress this exception", "while executing", "original traceback")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps, outermost first: Inductor's ``inner_exception``,
    then ``__cause__`` (``raise ... from``), then an unsuppressed ``__context__``."""
    out: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        inner = getattr(cur, "inner_exception", None)
        if not isinstance(inner, BaseException):
            inner = cur.__cause__
        if inner is None and not cur.__suppress_context__:
            inner = cur.__context__
        cur = inner
    return out


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        text = line.strip()
        if text and not text.lower().startswith(_BOILERPLATE):
            return text
    return ""


def failure_reason(exc: BaseException) -> str:
    """``Type: first meaningful line`` of the innermost exception of ``exc``'s chain that says
    something (a wrapper repeating its inner error is skipped; an inner error without a message
    gives way to the nearest outer one with one)."""
    for e in reversed(_chain(exc)):
        line = _first_line(e)
        if line:
            return f"{type(e).__name__}: {line}"
    return type(exc).__name__


def compiler_hint(exc: BaseException) -> str:
    """A C++-compiler hint for a compile failure whose cause names the compiler, and nothing
    otherwise (torch's own refusals, functionalization errors and ours are not about it)."""
    if isinstance(exc, CompileUnsupported):
        return ""
    text = " ".join(f"{type(e).__name__} {_first_line(e)}" for e in _chain(exc)).lower()
    if any(w in text for w in ("cppcompileerror", "cxxcompiler", "c++ compile", "g++", "gcc",
                                "clang", "compiler")):
        return " Inductor needs a working C++ compiler on the CPU."
    return ""


class _HoldBack(logging.Filter):
    """Drops ERROR-and-above records of torch's loggers (:data:`TORCH_LOGGER` and its children)
    logged by one thread."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.levelno >= logging.ERROR and record.thread == self.thread
                and (record.name == TORCH_LOGGER or record.name.startswith(TORCH_LOGGER + "."))):
            self.held += 1
            return False
        return True


def _handlers_reached(name: str) -> list[logging.Handler]:
    """Every handler a record of logger ``name`` (or of a child) can reach by propagation,
    and the last-resort handler logging uses when there is none."""
    found: list[logging.Handler] = []
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        found.extend(logger.handlers)
        logger = logger.parent if logger.propagate else None
    prefix = name + "."
    for other_name, other in list(logging.Logger.manager.loggerDict.items()):
        if other_name.startswith(prefix) and isinstance(other, logging.Logger):
            found.extend(other.handlers)
    if logging.lastResort is not None:
        found.append(logging.lastResort)
    return found


@contextlib.contextmanager
def quiet_torch_errors() -> Iterator[None]:
    """Hold back torch's ERROR records from this thread for the duration (module docstring),
    unless the ``accel_graph`` logger has DEBUG enabled. Other threads' records pass."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    hold = _HoldBack(threading.get_ident())
    handlers = {id(h): h for h in _handlers_reached(TORCH_LOGGER)}
    for h in handlers.values():
        h.addFilter(hold)
    try:
        yield
    finally:
        for h in handlers.values():
            h.removeFilter(hold)
