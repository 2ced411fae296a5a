"""Load a pickle that may only contain plain data; every global is refused.

A memory snapshot is dicts, lists, tuples, str, int, float, bool and None. Pickle runs code only
through objects it looks up by name (``GLOBAL``/``STACK_GLOBAL``/``INST``/``EXT*`` all go through
``find_class``) or through persistent ids; refusing both means ``REDUCE``, ``BUILD``, ``NEWOBJ``
and friends never get a callable, so nothing in the file can execute. No whitelist is needed:
the public snapshots checked (CUDA, and the Ascend NPU files in ``shared/traces/npu``) contain no
global at all.
"""

from __future__ import annotations

import io
import pickle

from ...errors import TraceFormatError

__all__ = ["safe_loads"]


class _DataOnlyUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> object:
        raise TraceFormatError(
            f"{self._source}: the pickle refers to the Python global {module}.{name}, which a "
            "memory snapshot never does; refusing to load it (nothing from the file was run). "
            "If you produced this file yourself, re-save it as plain dicts and lists "
            "(torch.cuda.memory._snapshot() output) or convert it with a trusted tool."
        )

    def persistent_load(self, pid: object) -> object:
        raise TraceFormatError(
            f"{self._source}: the pickle uses a persistent id, which a memory snapshot never "
            "does; refusing to load it (nothing from the file was run)."
        )


def safe_loads(data: bytes, source: str = "<pickle>") -> object:
    """Unpickle ``data`` allowing only plain data; raise :class:`TraceFormatError` otherwise.

    Truncated or corrupt pickles also raise :class:`TraceFormatError`, naming ``source``.
    """
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
                f"{source}: not a readable pickle (UnpicklingError: {e}); the file is corrupt "
                "or not a memory snapshot."
            ) from None
        raise TraceFormatError(
            f"{source}: the pickle ends early (truncated file?); re-copy or re-record it."
        ) from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            UnicodeDecodeError, RecursionError, MemoryError) as e:  # fmt: skip
        raise TraceFormatError(
            f"{source}: not a readable pickle ({type(e).__name__}: {e}); the file is corrupt, "
            "truncated or not a memory snapshot."
        ) from None
