"""Load a pickle that may only contain plain data; every global is refused, and the memory it
may cost is bounded before the unpickler runs.

A memory snapshot is dicts, lists, tuples, str, int, float, bool and None. Pickle runs code only
through objects it looks up by name (``GLOBAL``/``STACK_GLOBAL``/``INST``/``EXT*`` all go through
``find_class``) or through persistent ids; refusing both means ``REDUCE``, ``BUILD``, ``NEWOBJ``
and friends never get a callable, so nothing in the file can execute. No whitelist is needed:
the public snapshots checked (CUDA, and the Ascend NPU files in ``shared/traces/npu``) contain no
global at all.

Executing nothing is not enough: CPython's unpickler zero-fills its memo up to twice the largest
index a ``PUT``/``LONG_BINPUT`` names (9 bytes can ask for 1 GiB), and one-byte opcodes build
64-byte objects. :func:`scan_pickle` walks the opcodes first (reading arguments only, building
nothing) and estimates what unpickling will allocate; :func:`safe_loads` refuses a file whose
estimate exceeds ``TraceLimits.max_decode_expansion`` times its size plus
``TraceLimits.decode_slack_bytes``, or whose memo indices exceed what its size can justify.
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from typing import Any

from ...errors import TraceFormatError
from .record import DEFAULT_LIMITS, TraceLimits

__all__ = ["check_pickle_size", "safe_loads", "scan_pickle"]

#: Bytes charged for every object pushed on the unpickler's stack: the slot it takes in its
#: container (a dict entry is 24 bytes plus index and spare room; a list slot 8).
_PUSH = 24
#: CPython object sizes (64-bit), before the contents; an estimate, on the high side.
_OBJECT_BYTES = {
    "EMPTY_DICT": 64, "DICT": 64, "EMPTY_LIST": 56, "LIST": 56, "EMPTY_SET": 216,
    "FROZENSET": 216, "TUPLE": 40, "TUPLE1": 48, "TUPLE2": 56, "TUPLE3": 64, "INT": 32,
    "BININT": 32, "BININT1": 32, "BININT2": 32, "LONG": 32, "LONG1": 32, "LONG4": 32,
    "FLOAT": 24, "BINFLOAT": 24, "STRING": 56, "BINSTRING": 56, "SHORT_BINSTRING": 56,
    "UNICODE": 56, "SHORT_BINUNICODE": 56, "BINUNICODE": 56, "BINUNICODE8": 56, "BINBYTES": 40,
    "SHORT_BINBYTES": 40, "BINBYTES8": 40, "BYTEARRAY8": 64,
}  # fmt: skip
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_NO_PUSH = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "POP", "POP_MARK",
                      "PROTO", "FRAME", "STOP", "BUILD", *_MEMO_PUTS})  # fmt: skip


@functools.cache
def _tables() -> tuple[bytes, tuple[int, ...], dict[int, Any]]:
    """Per opcode byte: the width of a fixed-size opcode with its argument (0: not fixed), the
    bytes it is estimated to allocate, and how to read the others (built once, on first use)."""
    width, cost, special = bytearray(256), [0] * 256, {}
    sized = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
             pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
             pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}  # fmt: skip
    for op in pickletools.opcodes:
        code = ord(op.code.encode("latin-1"))
        cost[code] = (_OBJECT_BYTES.get(op.name, 0) + (0 if op.name in _NO_PUSH else _PUSH)
                      + (16 if op.name in _MEMO_PUTS else 0))  # fmt: skip
        n = op.arg.n if op.arg is not None else 0
        if op.name in ("LONG_BINPUT", "PUT", "STOP"):
            special[code] = op.name
        elif n >= 0:
            width[code] = 1 + n
        elif n == pickletools.UP_TO_NEWLINE:
            special[code] = 2 if op.arg.name == "stringnl_noescape_pair" else 1
        else:
            special[code] = sized[n]
    return bytes(width), tuple(cost), special


def scan_pickle(data: bytes) -> tuple[int, int]:
    """Walk the opcodes of ``data`` without building anything: ``(estimated bytes unpickling
    allocates, the largest explicit memo index or -1)``.

    The estimate charges each object its CPython size plus a container slot, string and integer
    arguments their length, and the memo the 16 bytes per index that CPython's resizing costs.
    Genuine snapshots estimate 9-13 times their size (they really take 5-9). The walk stops at
    an unknown opcode, a negative length or ``STOP``; the unpickler then reports what is wrong.
    """
    width, cost, special = _tables()
    end, find = len(data), data.find
    i = est = 0
    top = -1
    while i < end:
        op = data[i]
        w = width[op]
        est += cost[op]
        if w:  # the common case: fixed-size opcodes (refs, small ints, marks, containers)
            i += w
            continue
        how = special.get(op)
        i += 1
        if type(how) is tuple:  # length-prefixed argument
            n, signed = how
            size = int.from_bytes(data[i : i + n], "little", signed=signed)
            if size < 0 or i + n + size > end:  # the unpickler reports it (truncated, ...)
                break
            i += n + size
            est += size
        elif type(how) is int:  # newline-terminated argument(s)
            for _ in range(how):
                j = find(b"\n", i)
                if j < 0:
                    return est, top
                est += j - i
                i = j + 1
        elif how == "LONG_BINPUT":
            top = max(top, int.from_bytes(data[i : i + 4], "little"))
            i += 4
        elif how == "PUT":
            j = find(b"\n", i)
            try:
                top = max(top, int(data[i:j] if j >= 0 else data[i:]))
            except ValueError:  # not a number, or more digits than int() reads: absurd
                top = 1 << 62
            i = end if j < 0 else j + 1
        else:  # STOP, or a byte that is no opcode
            break
    return est + 16 * max(top, 0), top


class _DataOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> object:
        raise TraceFormatError(
            f"{self._source}: the pickle refers to the Python global {module[:80]}.{name[:80]}, "
            "which a memory snapshot never does; refusing to load it (nothing from the file was "
            "run). If you produced this file yourself, re-save it as plain dicts and lists "
            "(torch.cuda.memory._snapshot() output) or convert it with a trusted tool."
        )

    def persistent_load(self, pid: object) -> object:
        raise TraceFormatError(
            f"{self._source}: the pickle uses a persistent id, which a memory snapshot never "
            "does; refusing to load it (nothing from the file was run)."
        )


def check_pickle_size(data: bytes, source: str, limits: TraceLimits = DEFAULT_LIMITS) -> None:
    """Refuse ``data`` before unpickling when its memo indices or its estimated decoded size
    (:func:`scan_pickle`) are out of proportion to its length."""
    est, top = scan_pickle(data)
    if top >= len(data):
        raise TraceFormatError(
            f"{source}: the pickle stores an object at memo index {top}, but a {len(data)}-byte "
            "pickle holds at most that many memo entries; the file is corrupt or hostile "
            "(unpickling it would reserve memory for every index). Refusing to load it."
        )
    limits.check_decode_size(est, len(data), source, "pickle")


def safe_loads(data: bytes, source: str = "<pickle>", limits: TraceLimits = DEFAULT_LIMITS) -> object:
    """Unpickle ``data`` allowing only plain data; raise :class:`TraceFormatError` otherwise.

    The opcodes are scanned first (:func:`check_pickle_size`): a pickle whose memo indices or
    estimated decoded size are out of proportion to its length is refused before anything is
    built. Truncated or corrupt pickles also raise :class:`TraceFormatError`, naming ``source``.
    """
    check_pickle_size(data, source, limits)
    try:
        return _DataOnlyUnpickler(io.BytesIO(data), source).load()
    except TraceFormatError:
        raise
    except EOFError:
        raise TraceFormatError(
            f"{source}: the pickle ends early (truncated file?); re-copy or re-record it."
        ) from None
    except pickle.UnpicklingError as e:
        if "truncated" not in str(e):
            raise TraceFormatError(
                f"{source}: not a readable pickle (UnpicklingError: {str(e)[:200]}); the file is "
                "corrupt or not a memory snapshot."
            ) from None
        raise TraceFormatError(
            f"{source}: the pickle ends early (truncated file?); re-copy or re-record it."
        ) from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            UnicodeDecodeError, RecursionError, MemoryError) as e:  # fmt: skip
        raise TraceFormatError(
            f"{source}: not a readable pickle ({type(e).__name__}: {str(e)[:200]}); the file is "
            "corrupt, truncated or not a memory snapshot."
        ) from None
