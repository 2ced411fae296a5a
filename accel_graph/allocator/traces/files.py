"""Trace files: :func:`load_trace` sniffs the format and returns a :class:`~.model.Trace`;
:func:`save_trace` writes one atomically.

Loading never executes anything from the file and refuses truncated, corrupt or hostile files
with a :class:`TraceFormatError` that says what is wrong and what to do. Each format's details
live in its own module (``torch_snapshot``, ``compact``, ``rmm_csv``, ``safe_pickle``).
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from ...errors import TraceFormatError
from . import compact
from .model import Trace, infer_device_type, strip_frames
from .record import (
    DEFAULT_LIMITS,
    DEVICE_TYPES,
    FORMATS,
    META_KEY,
    NO_FRAMES,
    TraceLimits,
    bulk_objects,
    sniff_format,
)
from .rmm_csv import is_rmm_csv, read_rmm_csv
from .safe_pickle import safe_loads

__all__ = ["load_trace", "save_trace"]


def load_trace(
    path: str | os.PathLike[str],
    *,
    device_type: str | None = None,
    limits: TraceLimits = DEFAULT_LIMITS,
) -> Trace:
    """Load a trace from a snapshot pickle (dict or legacy list), JSON, compact file or RMM
    ``logging_resource_adaptor`` CSV (:mod:`~accel_graph.allocator.traces.rmm_csv`).

    The format is sniffed from the content, not the name. ``device_type`` overrides what the
    file says or what is inferred. Raises :class:`TraceFormatError` (a ``ValueError``) for a
    missing, empty, truncated, corrupt, oversized or hostile file; nothing in it is executed.
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_file_bytes:
                raise TraceFormatError(
                    f"{source}: {size} bytes exceed the {limits.max_file_bytes}-byte limit; "
                    "pass limits=TraceLimits(max_file_bytes=...) if the file is trusted and genuine."
                )
            data = _read_bounded(f, size, limits.max_file_bytes)
            if len(data) > limits.max_file_bytes:
                raise TraceFormatError(f"{source}: the file grew past the size limit while read.")
    except OSError as e:
        raise TraceFormatError(f"{source}: cannot read the file ({e.strerror or e}).") from None
    if not data:
        raise TraceFormatError(f"{source}: the file is empty; re-record or re-copy it.")
    fmt = sniff_format(data[:64])
    if fmt is None and is_rmm_csv(data[:64]):
        events = read_rmm_csv(data, source, limits)
        return Trace([events], [], None, device_type or "cuda")
    if fmt is None:
        if data[:2] == b"\x1f\x8b":
            raise TraceFormatError(f"{source}: gzip-compressed; decompress it first (gunzip).")
        raise TraceFormatError(
            f"{source}: not a memory snapshot pickle, JSON trace, compact trace or RMM log CSV "
            f"(starts with {bytes(data[:8])!r})."
        )
    if fmt == "compact":
        trace = _from_compact(data, source, limits)
    else:
        with bulk_objects():
            if fmt == "json":
                _check_json_size(data, source, limits)
                obj = _json_loads(data, source)
            else:
                obj = safe_loads(data, source, limits)
        trace = Trace.from_snapshot(obj, source, limits)
        del obj
    if device_type is not None:
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES}")
        trace.device_type = device_type
    return trace


def _read_bounded(f: Any, size: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``f``, reserving memory by what is there: ``size`` (the
    file's stat size) plus one byte to see growth, then 1 MiB chunks for a file that is longer
    than it said (a pipe, /proc) -- never ``limit`` bytes up front."""
    data = f.read(min(size, limit) + 1)
    if len(data) <= size or len(data) > limit:
        return data
    chunks = [data]
    total = len(data)
    while total <= limit:
        chunk = f.read(min(1 << 20, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def save_trace(trace: Trace, path: str | os.PathLike[str], format: str | None = None) -> None:
    """Write ``trace`` atomically as "pickle" (PyTorch's snapshot), "json" or "compact".

    ``format=None`` picks by suffix: ``.json`` is JSON, ``.agt``/``.compact`` is compact, anything
    else a pickle. The pickle opens in ``python -m torch.cuda._memory_viz`` and memory_viz. The
    compact format drops stack frames. A failed write leaves any existing file untouched.
    """
    if format is None:
        suffix = Path(path).suffix.lower()
        format = {".json": "json", ".agt": "compact", ".compact": "compact"}.get(suffix, "pickle")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    with bulk_objects():
        if format == "pickle":
            chunks: list[bytes | memoryview] = [pickle.dumps(trace.to_snapshot(), protocol=4)]
        else:
            try:
                if format == "json":
                    chunks = [json.dumps(_jsonable(trace.to_snapshot()), allow_nan=False).encode()]
                else:
                    chunks = _to_compact(trace)
            except ValueError as e:  # NaN or infinity somewhere in the metadata
                raise ValueError(
                    f"cannot write {os.fspath(path)} as {format}: the trace holds a value JSON "
                    f"cannot represent ({e}); save it as a pickle instead"
                ) from None
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (os.umask sets it, which
    would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_json_size(data: bytes, source: str, limits: TraceLimits) -> None:
    """Refuse JSON whose objects would be out of proportion to its bytes (``{},`` is 3 bytes and
    a 72-byte dict): an upper estimate from the count of brackets and commas, before decoding."""
    est = 72 * data.count(b"{") + 64 * data.count(b"[") + 36 * data.count(b",") + len(data)
    limits.check_decode_size(est, len(data), source, "JSON")


def _json_loads(data: bytes, source: str) -> object:
    def refuse_constant(name: str) -> object:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=refuse_constant)
    except UnicodeDecodeError:
        raise TraceFormatError(f"{source}: JSON trace is not valid UTF-8 (corrupt?).") from None
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(
            f"{source}: not valid JSON ({e}); the file is truncated or corrupt."
        ) from None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _to_compact(trace: Trace) -> list[bytes | memoryview]:
    arrays = []
    for a in trace.device_traces:
        if len(a) and (a["frames"] != NO_FRAMES).any():
            a = a.copy()
            a["frames"] = NO_FRAMES  # the compact format carries no stacks
        arrays.append(a)
    header = {
        "device_type": trace.device_type,
        "segments": _jsonable([strip_frames(s) for s in trace.segments]),
        "allocator_settings": _jsonable(trace.allocator_settings),
        "external_annotations": _jsonable(trace.external_annotations),
        "extra": _jsonable(trace.extra),
    }
    return compact.encode(header, arrays)


def _from_compact(data: bytes, source: str, limits: TraceLimits) -> Trace:
    header, arrays = compact.decode(data, source, limits)
    if any(len(a) and (a["frames"] != NO_FRAMES).any() for a in arrays):
        raise TraceFormatError(f"{source}: compact trace events refer to stack frames it lacks.")
    meta = {
        "segments": header.get("segments") or [],
        "device_traces": [],
    }
    for key in ("allocator_settings", "external_annotations"):
        if header.get(key) is not None:
            meta[key] = header[key]
    extra = header.get("extra") or {}
    if not isinstance(extra, dict) or any(k in meta or k == META_KEY for k in extra):
        raise TraceFormatError(f"{source}: compact trace header has a malformed 'extra'.")
    meta.update(extra)
    base = Trace.from_snapshot(meta, source, limits)
    base.device_traces = arrays
    dt = header.get("device_type")
    base.device_type = dt if dt in DEVICE_TYPES else infer_device_type(base)
    return base
