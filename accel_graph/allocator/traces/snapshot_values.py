"""The checks every value read from an untrusted PyTorch memory snapshot passes, shared by the
snapshot reader (:mod:`.torch_snapshot`): plain data only (nothing a pickle could smuggle in),
integers in range, and stack frames interned by identity, so that a pickle's shared frame
lists cost one check each.

Contract: :class:`SnapshotValueChecker` reports bad data only as :class:`TraceFormatError`
(built by :meth:`~SnapshotValueChecker.fail`), naming where in the snapshot the value is and
what is wrong with it. It counts the printed size of what it keeps (``distinct``,
``expanded``) so that the reader can refuse a pickle whose memo references would blow up
when printed.
"""

from __future__ import annotations

from typing import Any

from ...errors import TraceFormatError
from .record import NO_FRAMES, TraceLimits, show

__all__ = ["ADDR_MAX", "INT64_MAX", "INT64_MIN", "Frame", "SnapshotValueChecker", "Stack"]

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: Block, segment and event addresses must fit the int64 arrays the analyses put them in
#: (``inspect``'s layout): one limit for all, so a trace that loads is one every command reads
#: (an event at 2^63 used to load, then crash ``inspect`` with an OverflowError, exit 70). No
#: device hands out such addresses (CUDA's, ROCm's, x86-64's are 48 or 57 bits).
ADDR_MAX = INT64_MAX
_PLAIN_SCALARS = (str, int, float, bool, type(None))

Frame = dict[str, Any]
Stack = tuple[Frame, ...]


class SnapshotValueChecker:
    """Checks the values of one untrusted snapshot and interns its stacks: ``stacks`` holds
    the distinct frame lists seen, in first-seen order, and :meth:`stack` returns an index
    into it."""

    def __init__(self, source: str, limits: TraceLimits) -> None:
        self.source = source
        self.limits = limits
        self.stack_index: dict[tuple[int, ...], int] = {}
        self.stack_by_id: dict[int, int] = {}
        self.frames: list[Frame] = []
        self.frame_index: dict[tuple[Any, ...], int] = {}
        self.frame_by_id: dict[int, int] = {}
        self.stacks: list[Stack] = []
        # id -> expanded size of each plain container (and long string) checked so far; the
        # objects stay alive in the snapshot being read, so no id is reused meanwhile.
        self.sizes: dict[int, int] = {}
        self.distinct = 0  # plain data units, each object once
        self.expanded = 0  # plain data units, shared objects at every reference
        # Objects whose id() is cached in stack_by_id, kept alive so no id is ever reused.
        self.keep_alive: list[object] = []

    def fail(self, where: str, what: str) -> TraceFormatError:
        """The error for a bad value at ``where`` (returned, for the caller to raise)."""
        return TraceFormatError(
            f"{self.source}: {where}: {what}. This is not a valid PyTorch memory snapshot; "
            "check that the file is a complete _dump_snapshot()/save_trace() output."
        )

    # -- generic plain-data check (for what we keep verbatim)
    def plain(self, obj: object, where: str, depth: int = 0) -> int:
        """Check that ``obj`` is plain data; return its size printed in full (units of about a
        byte), shared sub-objects counted at every reference. Each distinct object is walked
        once, and adds its own size to ``self.distinct``."""
        if isinstance(obj, str):
            n = len(obj) + 2
            if n <= 64 or self.sizes.setdefault(id(obj), n) is n:  # long strings: once by id
                self.distinct += n
            return n
        if isinstance(obj, int):
            n = obj.bit_length() // 3 + 2
            self.distinct += n
            return n
        if isinstance(obj, (float, type(None))):
            self.distinct += 8
            return 8
        if depth > self.limits.max_nesting:
            raise self.fail(where, f"nested deeper than {self.limits.max_nesting} levels")
        known = self.sizes.get(id(obj))
        if known is not None:  # shared sub-objects are checked once (no blow-up)
            return known
        total = 2
        if isinstance(obj, dict):
            for k, v in obj.items():
                if not isinstance(k, (str, int)):
                    raise self.fail(where, f"dict key of type {type(k).__name__}")
                key = k[:80] if isinstance(k, str) else show(k)
                total += self.plain(k, where) + self.plain(v, f"{where}.{key}", depth + 1) + 2
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                total += self.plain(v, f"{where}[{i}]", depth + 1) + 2
        else:
            raise self.fail(
                where, f"value of type {type(obj).__name__}, which snapshots never hold"
            )
        self.distinct += 2 + 2 * len(obj)
        self.sizes[id(obj)] = total
        return total

    def integer(self, value: object, where: str, lo: int = 0, hi: int | None = None) -> int:
        hi = self.limits.max_bytes_value if hi is None else hi
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(where, f"expected an integer, got {type(value).__name__}")
        if value < lo:
            raise self.fail(where, f"negative value {show(value)}" if lo == 0
                            else f"value {show(value)} below {lo}")
        if value > hi:
            raise self.fail(where, f"absurd value {show(value)} (limit {hi})")
        return value

    def stack(self, frames: object, where: str) -> int:
        """Intern a frames list. Pickles share frame dicts (and sometimes whole lists) through
        their memo, so both are cached by identity: each distinct object is checked once."""
        index = self.stack_by_id.get(id(frames))
        if index is not None:
            return index
        if type(frames) is not list:
            raise self.fail(where, f"frames must be a list, got {type(frames).__name__}")
        if not frames:
            index = NO_FRAMES
        else:
            if len(frames) > self.limits.max_stack_depth:
                raise self.fail(where, f"{len(frames)} frames exceed the limit")
            by_id = self.frame_by_id
            key = tuple([by_id.get(id(f)) or self.frame(f, where) for f in frames])
            index = self.stack_index.get(key)
            if index is None:
                index = self.stack_index[key] = len(self.stacks)
                self.stacks.append(tuple(self.frames[k - 1] for k in key))
        self.stack_by_id[id(frames)] = index
        self.keep_alive.append(frames)
        return index

    def frame(self, frame: object, where: str) -> int:
        """Check and intern one frame dict; returns its 1-based id (0 is never used)."""
        if type(frame) is not dict:
            raise self.fail(where, f"a frame must be a dict, got {type(frame).__name__}")
        for k, v in frame.items():
            if type(k) is not str or not isinstance(v, _PLAIN_SCALARS):
                key = show(k) if type(k) is int else repr(k)[:80]
                raise self.fail(where, f"frame entry {key} must map a string to a scalar")
        content = tuple(frame.items())
        fid = self.frame_index.get(content)
        if fid is None:
            self.frames.append(frame)
            fid = self.frame_index[content] = len(self.frames)
        self.frame_by_id[id(frame)] = fid
        self.keep_alive.append(frame)
        return fid
