"""C status codes to exceptions: the one place a refusal of the C core becomes a Python error.

:func:`check_status` is used by :class:`~accel_graph.allocator.core.engine.Engine`, the tensor
blocks and the device plug-in alike, so the same status always raises the same exception.
"""

from __future__ import annotations

from typing import Any, Protocol

from ... import errors as _errors
from ...errors import AccelGraphError, BackendUnavailable, ConfigError, PoolError
from .loader import load_core
from .settings import POLICY_KEYS, POLICY_MODELS
from .stats import oom_message

__all__ = ["EngineLike", "check_status"]


class EngineLike(Protocol):
    """What a refusal's exception is built from: the parts of an
    :class:`~accel_graph.allocator.core.engine.Engine` that :func:`check_status` and the tensor
    blocks read. A protocol, so that this module (below the engine, which calls it) needs no
    import of the engine."""

    policy: str
    device_name: str
    device_index: int
    conf_var: str

    @property
    def c_handle(self) -> Any: ...

    def last_error(self) -> str: ...


def check_status(rc: int, engine: EngineLike | None = None, message: str | None = None) -> int:
    """Turn a C status (or a negative pointer/id result) into the matching exception.

    Non-negative values pass through unchanged, so ``ptr = check_status(lib.ag_malloc(...))`` works.
    """
    if rc >= 0:
        return rc
    if message is None:
        message = engine.last_error() if engine is not None else f"allocator error {rc}"
    core = load_core()
    lib = core.lib
    if rc == lib.AG_ERR_OOM:
        if engine is not None:
            info = core.ffi.new("ag_oom_info *")
            lib.ag_last_oom(engine.c_handle, info)
            message = oom_message(info, engine.device_name, engine.device_index, engine.conf_var)
            policy = engine.policy
            if "expandable_segments" not in POLICY_KEYS[policy]:
                # torch's hint is to turn on expandable segments: useless to this policy
                message = message.split(" If reserved but unallocated", 1)[0] + (
                    f" (policy {policy}: a model of {POLICY_MODELS[policy]}; torch's allocator "
                    "settings do not apply)"
                )
        raise _errors.OutOfMemoryError(message)
    if rc in (lib.AG_ERR_INVALID, lib.AG_ERR_BAD_PTR, lib.AG_ERR_UNSUPPORTED):
        raise ConfigError(message)
    if rc == lib.AG_ERR_POOL:
        raise PoolError(message)
    if rc == lib.AG_ERR_LOAD:
        raise BackendUnavailable(message)
    if rc == lib.AG_ERR_NOMEM:
        # the C core may fail before it can write a message (its malloc failed): never raise
        # a MemoryError with no text
        raise MemoryError(message or "the allocator core could not allocate host memory for "
                          "its own bookkeeping (malloc failed); free host memory, or replay a "
                          "shorter trace")
    raise AccelGraphError(message)


