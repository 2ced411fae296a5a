"""The stream and private-pool half of :class:`~.engine.Engine`'s API: streams (blocks are cached
per stream) and private pools (torch's graph pools and ``MemPool``: create, route allocations
to, count uses, release, inspect).

:class:`EnginePools` is a mixin over the engine's C handle (``_e``), cffi ``_lib``/``_ffi``; it
holds no state of its own. Every call goes through :func:`~.status.check_status`, as in
:mod:`.engine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .settings import I32, I64, bool_arg, int_arg
from .status import check_status

__all__ = ["EnginePools"]


class EnginePools:
    """Streams and private pools of one engine (mixed into :class:`~.engine.Engine`)."""

    __slots__ = ()
    _e: Any
    _ffi: Any
    _lib: Any

    def create_stream(self) -> int:
        """A new stream id (blocks are cached per stream)."""
        return check_status(self._lib.ag_create_stream(self._e), self)

    @property
    def num_streams(self) -> int:
        return int(self._lib.ag_num_streams(self._e))

    def create_pool(self, no_split: bool = False, use_on_oom: bool = False) -> int:
        """A private pool (graph pool / MemPool) with use count 1, like torch's
        ``MemPool(use_on_oom=..., no_split=...)``: ``no_split`` never splits its blocks;
        ``use_on_oom`` lets default-pool requests take its free blocks before running out of
        memory."""
        lib = self._lib
        flags = (lib.AG_POOL_NO_SPLIT if bool_arg("create_pool", "no_split", no_split) else 0) | (
            lib.AG_POOL_USE_ON_OOM if bool_arg("create_pool", "use_on_oom", use_on_oom) else 0
        )
        return check_status(lib.ag_create_pool(self._e, flags), self)

    def begin_allocate_to_pool(self, pool: int, stream: int = -1) -> None:
        """Route allocations on ``stream`` (-1: every stream) to ``pool``; adds one use."""
        pool = int_arg("begin_allocate_to_pool", "pool", pool, I64)
        stream = int_arg("begin_allocate_to_pool", "stream", stream, I32)
        check_status(self._lib.ag_begin_allocate_to_pool(self._e, pool, stream), self)

    def end_allocate_to_pool(self, pool: int) -> None:
        """Stop routing allocations to ``pool`` (the use taken by begin stays until release)."""
        pool = int_arg("end_allocate_to_pool", "pool", pool, I64)
        check_status(self._lib.ag_end_allocate_to_pool(self._e, pool), self)

    def release_pool(self, pool: int) -> None:
        """Drop one use of ``pool``; at zero its free memory goes back at the next empty_cache
        (or OOM retry), and the pool disappears once it holds no segment."""
        pool = int_arg("release_pool", "pool", pool, I64)
        check_status(self._lib.ag_release_pool(self._e, pool), self)

    def pool_use_count(self, pool: int) -> int:
        """How many users (creator, captures, MemPool contexts) hold ``pool``."""
        pool = int_arg("pool_use_count", "pool", pool, I64)
        return check_status(self._lib.ag_pool_use_count(self._e, pool), self)

    def pool_memory(self, pool: int | None = None) -> dict[str, int]:
        """What one private pool (or, for ``None``, the default pools) holds right now:
        ``segments``, ``reserved_bytes``, ``allocated_bytes``, ``active_bytes``,
        ``blocks_allocated``, and for private pools ``use_count`` and ``freeable``."""
        pool = 0 if pool is None else int_arg("pool_memory", "pool", pool, I64)
        info = self._ffi.new("ag_pool_info *")
        check_status(self._lib.ag_pool_info_get(self._e, pool, info), self)
        out = {
            f: int(getattr(info, f))
            for f in (
                "segments",
                "reserved_bytes",
                "allocated_bytes",
                "active_bytes",
                "blocks_allocated",
            )
        }
        if pool:
            out["use_count"] = int(info.use_count)
            out["freeable"] = int(info.freeable)
        return out

    @contextmanager
    def allocate_to_pool(self, pool: int, stream: int = -1) -> Iterator[int]:
        """``with engine.allocate_to_pool(p):`` like torch's ``use_mem_pool``: begin, then end
        and release on exit (begin took the use that release drops)."""
        self.begin_allocate_to_pool(pool, stream)
        try:
            yield pool
        finally:
            self.end_allocate_to_pool(pool)
            self.release_pool(pool)
