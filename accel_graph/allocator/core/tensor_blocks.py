"""Tensors that own engine blocks: the one-native-call tensor maker over a ``host`` engine.

:meth:`Engine.tensor_blocks <accel_graph.allocator.core.engine.Engine.tensor_blocks>` hands one
out where the ``_dlpack`` extension is built; docs/allocator.md "Tensor blocks".
"""

from __future__ import annotations

from typing import Any

from .loader import load_core
from .status import EngineLike, check_status

__all__ = ["TensorBlocks"]


class TensorBlocks:
    """Tensors that own engine blocks, each made in one native call (DLPack; docs/allocator.md
    "Tensor blocks").

    ``make(key, code, bits, shape, stride, owner=None)`` allocates the block a CPU tensor of
    that DLPack dtype, shape and stride spans and returns the tensor over it, or an ``int < 0``
    (the engine's status, for :meth:`check`) when the block cannot be had; ``owner`` is kept
    alive until the tensor dies. When the tensor's storage dies,
    from any thread, the block is freed into the engine and ``key`` is queued: :meth:`drain`
    returns the queued keys, and ``pending[0]`` is their number, readable at the cost of an
    index. The engine (and so every block) stays alive while any such tensor does.
    """

    __slots__ = ("_engine", "_ffi", "_lib", "_mod", "_ref", "addr", "pending")

    def __init__(self, engine: EngineLike, mod: Any) -> None:
        core = load_core()
        ffi, lib = core.ffi, core.lib
        handle = engine.c_handle
        self._engine, self._ffi, self._lib, self._mod = engine, ffi, lib, mod
        # Our own reference on the C engine: ``addr`` and ``pending`` stay valid for this
        # object's life even after ``engine.close()`` and the last tensor's death (calls then
        # get the engine's "closed" status instead of touching freed memory).
        lib.ag_engine_retain(handle)
        self._ref = ffi.gc(ffi.cast("ag_engine *", handle), lib.ag_engine_drop)
        self.addr = int(ffi.cast("uintptr_t", handle))
        self.pending = lib.ag_tensor_pending(handle)

    def make(
        self, key: int, code: int, bits: int, shape: Any, stride: Any, owner: Any = None
    ) -> Any:
        return self._mod.make(self.addr, key, code, bits, shape, stride, owner)

    @property
    def maker(self) -> Any:
        """``make(engine_addr, key, code, bits, shape, stride, owner)``, the raw extension
        function (``addr`` is the first argument): one call less on a hot path."""
        return self._mod.make

    def check(self, rc: int) -> None:
        """Raise what a refused block means (OutOfMemoryError with torch's message, ...)."""
        check_status(rc, self._engine)

    def drain(self) -> list[int]:
        """Keys of the tensors that died since the last drain, in order of death."""
        return self._mod.drain(self.addr)

    @property
    def drainer(self) -> Any:
        """``drain(engine_addr)``, the raw extension function."""
        return self._mod.drain

    def set_release_idle(self, on: bool) -> None:
        """Whether each death also returns whole free segments to the upstream (as
        :meth:`Engine.empty_cache`); turning it on releases them now."""
        rc = self._lib.ag_tensor_set_release_idle(self._engine.c_handle, 1 if on else 0)
        check_status(rc, self._engine)

    def counts(self) -> tuple[int, int]:
        """(live tensor blocks, deaths whose free the engine refused: always 0)."""
        ffi = self._ffi
        live, errors = ffi.new("int64_t *"), ffi.new("int64_t *")
        self._lib.ag_tensor_counts(self._engine.c_handle, live, errors)
        return int(live[0]), int(errors[0])
