"""The caching-allocator engine: a thin Python face over the C core (``_core``, built by cffi).

One :class:`Engine` is one device's caching allocator: a policy (``"native"``, PyTorch's CUDA
caching allocator; ``"xpu"``, XPU's simpler one; ``"bfc"``, a model of TensorFlow's BFC allocator,
best fit with coalescing, which ignores streams and every torch knob but the cap, the capacity and
the memory fraction: docs/allocator.md "bfc policy") over an upstream (``"host"`` memory, usable by
tensors; ``"counting"``, a simulator that hands out fake addresses and moves no memory;
``"device"``, ``cudaMalloc``/``hipMalloc`` resolved at run time). The simulator and the allocator
are the same code.

Contract:

- Every C status goes through :func:`~.status.check_status`, which raises :class:`OutOfMemoryError` (also a
  ``torch.OutOfMemoryError`` and ``MemoryError``), :class:`ConfigError` (a ``ValueError``) for
  bad arguments, :class:`PoolError` for unknown or released pools, :class:`BackendUnavailable`
  when the device runtime cannot be loaded, :class:`AccelGraphError` otherwise. A refused call
  changes nothing; an OOM leaves the engine usable.
- The C core is imported on first use, never compiled at import: a missing build raises
  :class:`BackendUnavailable` saying how to rebuild.
- Every public C call takes the engine's own mutex (cffi releases the GIL around C). Memory handed out by a ``host`` engine lives
  until the engine is closed or collected: tensors over it must not outlive the engine. The
  exception is a tensor block (:class:`~.tensor_blocks.TensorBlocks`): the tensor owns its block and holds a
  reference on the C engine, so the block and the engine's memory stay valid until the tensor
  dies, even after :meth:`Engine.close`.

Streams and private pools come from the :class:`~.pools.EnginePools` mixin; the bulk record
layouts (:data:`OP_DTYPE`, :data:`EVENT_DTYPE`, :data:`OP`) from :mod:`.records`, re-exported
here as part of :meth:`Engine.replay`'s and :meth:`Engine.drain_events`' contract.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import AccelGraphError, ConfigError
from ..devices import DEFAULT_DEVICE_KIND, device_kind_for_policy
from .loader import load_core, load_dlpack
from .pools import EnginePools
from .records import EVENT_DTYPE, OP, OP_DTYPE
from .settings import (
    I32,
    I64,
    U64,
    U64_MAX,
    EngineSettings,
    fill_settings,
    fraction_arg,
    int_arg,
)
from .stats import BLOCK_STATES, memory_stats_dict, snapshot_segments
from .status import check_status
from .tensor_blocks import TensorBlocks

__all__ = ["EVENT_DTYPE", "OP", "OP_DTYPE", "Engine"]

def _malloc_args(size: Any, stream: Any, pool: Any) -> None:
    """malloc's argument checks, off the hot path: run only once cffi refused an argument or
    one is a bool. Raises ConfigError naming the first bad one."""
    int_arg("malloc", "size", size, I64)
    int_arg("malloc", "stream", stream, I32)
    if pool is not None:
        int_arg("malloc", "pool", pool, I64)

# the engine


class Engine(EnginePools):
    """A caching allocator instance. See the module docstring for the contract.

    ``Engine(policy="native", upstream="counting", settings=EngineSettings(), streams=1)``.
    Streams are small ints ``0..n-1`` (0 is the default stream; at most 64); pools are ints from
    :meth:`create_pool`. ``device_name``, ``device_index`` and ``conf_var`` (the environment
    variable torch names for this device's allocator config) shape the OOM message.
    """

    __slots__ = (
        "_e",
        "_ffi",
        "_free",
        "_lib",
        "_malloc",
        "conf_var",
        "device_index",
        "device_name",
        "policy",
        "settings",
        "upstream",
    )

    def __init__(
        self,
        policy: str = "native",
        upstream: str = "counting",
        settings: EngineSettings | None = None,
        *,
        streams: int = 1,
        device_name: str | None = None,
        device_index: int = 0,
    ) -> None:
        # checked before anything is created; the C core refuses streams past its limit (64)
        streams = int_arg("Engine", "streams", streams, (1, I32[1]))
        core = load_core()
        ffi, lib = core.ffi, core.lib
        self.settings = settings if settings is not None else EngineSettings()
        self.policy = policy
        self.upstream = upstream
        c = fill_settings(ffi, self.settings, policy, upstream)
        libs = (
            ";".join(self.settings.device_libs).encode() if self.settings.device_libs else ffi.NULL
        )
        out = ffi.new("ag_engine **")
        err = ffi.new("char[512]")
        rc = lib.ag_engine_create(c, libs, out, err, 512)
        if rc != 0:
            check_status(rc, None, ffi.string(err).decode(errors="replace"))
        self._ffi, self._lib = ffi, lib
        self._e = ffi.gc(out[0], lib.ag_engine_destroy)
        # Bound C functions: the hot path is one attribute load and one cffi call.
        self._malloc = lib.ag_malloc
        self._free = lib.ag_free
        # The device family the policy simulates (bfc: none, worded as CUDA) names the device
        # and the variable in torch-style out-of-memory messages.
        kind = device_kind_for_policy(policy) or DEFAULT_DEVICE_KIND
        self.device_name = device_name or kind.display
        self.device_index = device_index
        self.conf_var = kind.oom_variable
        for _ in range(streams - 1):
            self.create_stream()

    def last_error(self) -> str:
        """The C core's message for this engine's last refused call ("" when none)."""
        return self._ffi.string(self._lib.ag_last_error(self._e)).decode(errors="replace")

    def __repr__(self) -> str:
        return f"Engine(policy={self.policy!r}, upstream={self.upstream!r})"

    @property
    def c_handle(self) -> Any:
        """The C engine (``ag_engine *``) for C-level callers of the core, such as the device
        plug-in (``ag_pluggable_install``). Valid while this engine is open; never free it."""
        return self._e

    def host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory at ``ptr`` as a writable ``uint8`` array, no copy.

        Only for a ``host`` upstream and for a block this engine handed out (the caller keeps
        the block alive while the view is used): the engine cannot check either.
        """
        if self.upstream != "host":
            raise ConfigError(f"host_view needs the 'host' upstream, this engine uses {self.upstream!r}")
        ffi = self._ffi
        return np.frombuffer(ffi.buffer(ffi.cast("char *", ptr), nbytes), dtype=np.uint8)

    # -- allocation ------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0, pool: int | None = None) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the block address.

        ``pool`` sends the request to that private pool; otherwise a pool receiving allocations
        for ``stream`` (:meth:`begin_allocate_to_pool`) gets it, else the default pools.
        Raises OutOfMemoryError (torch's message) when nothing can serve it, ConfigError for a
        size <= 0 or an unknown stream, PoolError for an unknown or released pool.
        """
        if size.__class__ is bool or stream.__class__ is bool or pool.__class__ is bool:
            _malloc_args(size, stream, pool)  # raises: cffi would take a bool for 0 or 1
        try:
            r = self._malloc(self._e, size, stream, pool or 0)
        except (OverflowError, TypeError):
            if type(size) is int and size > I64[1]:
                # too big for int64: the same 1 EB refusal torch gives
                return check_status(self._lib.ag_malloc(self._e, 1 << 62, 0, 0), self)
            _malloc_args(size, stream, pool)  # raises, naming the argument
            raise  # pragma: no cover - cffi refused what the checks accept
        if r < 0:
            check_status(r, self)
        return r

    def free(self, ptr: int) -> None:
        """Free a block. Unknown or already-freed pointers raise ConfigError and change nothing."""
        if ptr.__class__ is bool:
            int_arg("free", "ptr", ptr, U64)  # raises
        try:
            rc = self._free(self._e, ptr)
        except (OverflowError, TypeError):
            int_arg("free", "ptr", ptr, U64)
            raise  # pragma: no cover - cffi refused what int_arg accepts
        if rc:
            check_status(rc, self)

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark the block as used on ``stream``: its free completes only after a later
        :meth:`process_events` or :meth:`synchronize` (``free_requested`` then ``free_completed``)."""
        ptr = int_arg("record_stream", "ptr", ptr, U64)
        stream = int_arg("record_stream", "stream", stream, I32)
        check_status(self._lib.ag_record_stream(self._e, ptr, stream), self)

    def block_size(self, ptr: int) -> int:
        """The (rounded, maybe unsplit) size of an allocated block."""
        ptr = int_arg("block_size", "ptr", ptr, U64)
        return check_status(self._lib.ag_block_size(self._e, ptr), self)

    def process_events(self) -> None:
        """Complete pending cross-stream frees (skipped while a pool receives allocations, as
        torch skips event queries during capture). malloc does this first, as torch does."""
        check_status(self._lib.ag_process_events(self._e), self)

    def synchronize(self) -> None:
        """Synchronise all streams: complete pending frees; counts ``num_sync_all_streams``."""
        check_status(self._lib.ag_synchronize(self._e), self)

    def empty_cache(self) -> None:
        """Return every whole free segment (and whole free expandable page) to the upstream,
        and the memory of released private pools. Skipped for the default pools while any pool
        receives allocations, as torch does during capture."""
        check_status(self._lib.ag_empty_cache(self._e), self)

    def set_memory_fraction(self, fraction: float | None) -> None:
        """torch's ``set_per_process_memory_fraction``: a number in [0, 1] (0 lets nothing be
        allocated, 1 is torch's default: no limit); ``None`` unsets it. NaN, negative numbers,
        numbers over 1 and non-numbers raise ConfigError, as does any fraction on an engine
        without a known capacity (no ``cap`` or ``capacity``)."""
        f = -1.0 if fraction is None else fraction_arg("set_memory_fraction", fraction)
        check_status(self._lib.ag_set_memory_fraction(self._e, f), self)

    def tensor_blocks(self) -> TensorBlocks | None:
        """The one-call tensor maker over this engine's blocks (host upstream), or ``None``
        where it cannot run: the ``_dlpack`` extension or the core's ``ag_tensor_*`` entry
        points are not built, or torch has no DLPack importer."""
        if self.upstream != "host":
            return None
        mod = load_dlpack()
        return None if mod is None else TensorBlocks(self, mod)

    # -- statistics, layout, events --------------------------------------------------------

    def _raw_stats(self) -> Any:
        raw = self._ffi.new("ag_stats *")
        self._lib.ag_get_stats(self._e, raw)
        return raw

    def memory_stats(self) -> dict[str, int]:
        """torch.cuda.memory_stats()-shaped flat dict (plus ``accel.*`` extras)."""
        # Keyed on the name, not on POLICY_KEYS: bfc resets max_split_size at create
        # (bfc_adjust_settings, _core_bfc.c), while xpu ignores the key yet keeps and reports it.
        max_split = None if self.policy == "bfc" else self.settings.max_split_size
        return memory_stats_dict(self._raw_stats(), max_split)

    def reset_peak_stats(self) -> None:
        self._lib.ag_reset_peak_stats(self._e)

    def reset_accumulated_stats(self) -> None:
        self._lib.ag_reset_accumulated_stats(self._e)

    @property
    def capacity(self) -> int | None:
        """Total device memory as the engine sees it; None when unbounded."""
        c = int(self._lib.ag_capacity(self._e))
        return None if c == U64_MAX else c

    def layout(self) -> list[dict[str, Any]]:
        """Every segment with every block, unmapped expandable blocks included (state
        ``"unmapped"``), in the engine's internal order. For tests and simulators;
        :meth:`snapshot` is the torch-shaped view."""
        ffi, lib = self._ffi, self._lib
        ns, nb = ffi.new("int64_t *"), ffi.new("int64_t *")
        lib.ag_layout_counts(self._e, ns, nb)
        segs = ffi.new("ag_segment_info[]", max(ns[0], 1))
        blocks = ffi.new("ag_block_info[]", max(nb[0], 1))
        check_status(lib.ag_layout(self._e, segs, ns[0], blocks, nb[0]), self)

        out = []
        for i in range(ns[0]):
            s = segs[i]
            first = s.first_block
            out.append(
                {
                    "address": s.address,
                    "size": s.size,
                    "pool_id": s.pool_id,
                    "stream": s.stream,
                    "is_small": bool(s.is_small),
                    "is_expandable": bool(s.is_expandable),
                    "blocks": [
                        {
                            "address": blocks[j].address,
                            "size": blocks[j].size,
                            "requested_size": blocks[j].requested_size,
                            "state": BLOCK_STATES[blocks[j].state],
                            "stream": blocks[j].stream,
                        }
                        for j in range(first, first + s.n_blocks)
                    ],
                }
            )
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot()``-shaped segment list, sorted by address."""
        return snapshot_segments(self.layout(), self.device_index)

    def enable_events(self, max_entries: int = 0) -> None:
        """Start recording events; ``max_entries`` > 0 keeps only the newest ones (a ring)."""
        max_entries = int_arg("enable_events", "max_entries", max_entries, (0, I64[1]))
        check_status(self._lib.ag_events_enable(self._e, 1, max_entries), self)

    def disable_events(self) -> None:
        """Stop recording; events already recorded stay until drained."""
        check_status(self._lib.ag_events_enable(self._e, 0, 0), self)

    def drain_events(self, as_list: bool = False) -> Any:
        """Remove and return the recorded events, oldest first: a numpy structured array of
        :data:`EVENT_DTYPE` (``seq, time_us, addr, size, pool_id, stream, action``; action codes are
        ``trace.ACTIONS``), or a list of tuples with ``as_list=True``. For ``oom`` the ``addr``
        field holds the free device bytes and ``size`` the rounded request, as torch's trace."""
        n = int(self._lib.ag_events_count(self._e))
        arr = np.empty(n, dtype=EVENT_DTYPE)
        if n:
            got = self._lib.ag_events_drain(self._e, self._ffi.from_buffer("ag_event[]", arr), n)
            arr = arr[:got]
        return arr.tolist() if as_list else arr

    # -- whole-trace replay ----------------------------------------------------------------

    def replay(self, ops: Any, n_slots: int | None = None) -> Any:
        """Run a whole op array in one C call; returns per-op int64 results.

        ``ops`` is a numpy array of :data:`OP_DTYPE` (``op, stream, size, id, size2``), opcodes in
        :data:`OP`. ``malloc`` puts its pointer into slot ``id``; ``free``/``record_stream`` name a
        slot; ``set_requested`` sets the requested bytes (``size``, 1..block size) of slot
        ``id``'s live block. A malloc that runs out of memory yields a negative result (``AG_ERR_OOM``), leaves
        its slot empty, and the replay goes on (a later free of that slot is skipped). Any other
        error stops the replay and raises, naming the op index.
        """
        ops = np.ascontiguousarray(ops, dtype=OP_DTYPE)
        if n_slots is None:
            n_slots = int(ops["id"].max()) + 1 if len(ops) else 0
        n_slots = int_arg("replay", "n_slots", n_slots, (0, I64[1]))
        slots = np.zeros(max(n_slots, 1), dtype=np.uint64)
        results = np.zeros(max(len(ops), 1), dtype=np.int64)
        done = self._ffi.new("int64_t *")
        ffi = self._ffi
        rc = self._lib.ag_replay(
            self._e,
            ffi.from_buffer("ag_op[]", ops),
            len(ops),
            ffi.from_buffer("uint64_t[]", slots),
            n_slots,
            ffi.from_buffer("int64_t[]", results),
            done,
        )
        if rc:
            check_status(rc, self, f"replay stopped at op {done[0]}: {self.last_error()}")
        return results[: len(ops)]

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Give all memory back to the upstream now. Pointers from this engine become invalid;
        any later call raises AccelGraphError. Must not race with calls from other threads.
        Tensor blocks still alive keep their memory (and the C engine) until they die."""
        e, ffi = self._e, self._ffi
        self.__class__ = _ClosedEngine
        ffi.release(e)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ClosedEngine(Engine):
    """What an Engine becomes after close(): every public call refuses (instead of crashing)."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name in ("policy", "upstream", "settings", "close"):
            return object.__getattribute__(self, name)
        raise AccelGraphError(f"this allocator engine is closed; {name} is not available")

    def close(self) -> None:
        return None

    def __repr__(self) -> str:
        return "Engine(<closed>)"
