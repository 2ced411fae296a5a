"""Process-wide compute settings that change what later ops compute without an aten op.

Replay runs the recorded kernels under whatever settings hold when it runs. A setting changed
inside the captured code (``torch.use_deterministic_algorithms``, ``torch.backends.mkldnn``'s
``enabled`` or ``flags()``, ``torch.set_num_threads``, ``torch.set_float32_matmul_precision``,
``torch.utils.deterministic.fill_uninitialized_memory``) is invisible to the dispatch mode, so
the capture watches them: before each recorded op it compares them with what the last op saw,
and where one changed, the program gets a step that applies the new value at that point of
every replay (and one at the end, for what the code left set). Replay then runs each op under
the settings it ran under in eager, given the same settings when replay starts, as eager does.

``torch.set_flush_denormal`` has no getter; :func:`install` wraps it for the duration of
captures (module attribute, capturing thread only), and a call is applied and recorded the same
way. Code that bound the function before the capture (``from torch import set_flush_denormal``)
is not seen. (Installed with the generator interception, :mod:`.rng`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Snapshot = tuple[Any, ...]


def _set_deterministic(value: bool) -> None:
    torch.use_deterministic_algorithms(value, warn_only=torch.is_deterministic_algorithms_warn_only_enabled())


def _set_warn_only(value: bool) -> None:
    torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(), warn_only=value)


def _watched() -> list[tuple[str, Callable[[], Any], Callable[[Any], Any]]]:
    """(name, getter, setter) of each watched setting this torch has. The getters are torch's
    C functions themselves: they run before every recorded op."""
    c = torch._C
    table: list[tuple[str, Callable[[], Any], Callable[[Any], Any]]] = [
        ("torch.set_num_threads", torch.get_num_threads, torch.set_num_threads)]
    for name, get, put in (
        ("torch.use_deterministic_algorithms", "_get_deterministic_algorithms", _set_deterministic),
        ("torch.use_deterministic_algorithms(warn_only)", "_get_deterministic_algorithms_warn_only",
         _set_warn_only),
        ("torch.backends.mkldnn.enabled", "_get_mkldnn_enabled", "_set_mkldnn_enabled"),
        ("torch.utils.deterministic.fill_uninitialized_memory",
         "_get_deterministic_fill_uninitialized_memory", "_set_deterministic_fill_uninitialized_memory"),
        ("torch.set_float32_matmul_precision", "_get_float32_matmul_precision",
         torch.set_float32_matmul_precision),
    ):
        setter = getattr(c, put, None) if isinstance(put, str) else put
        if hasattr(c, get) and setter is not None:
            table.append((name, getattr(c, get), setter))
    return table


_WATCHED = _watched()
_GETTERS = tuple(get for _, get, _ in _WATCHED)


def snapshot() -> Snapshot:
    """The watched settings now (cheap: a few C calls; taken before every recorded op)."""
    return tuple([get() for get in _GETTERS])


def changes(before: Snapshot, now: Snapshot) -> tuple[tuple[int, Any], ...]:
    """(index, new value) of each setting that differs."""
    return tuple((i, v) for i, (b, v) in enumerate(zip(before, now, strict=True)) if b != v)


def describe(diff: tuple[tuple[int, Any], ...]) -> str:
    return ", ".join(f"{_WATCHED[i][0]}({v!r})" for i, v in diff)


def apply(diff: tuple[tuple[int, Any], ...]) -> None:
    """Set the settings in ``diff`` (a replay step)."""
    for i, value in diff:
        _WATCHED[i][2](value)


def apply_flush_denormal(mode: bool) -> bool:
    """``torch.set_flush_denormal`` itself (also the replay step of a call during capture)."""
    return _ORIGINAL_FLUSH(mode)


def original_flush_denormal() -> Callable[[bool], bool]:
    return _ORIGINAL_FLUSH


_ORIGINAL_FLUSH = torch.set_flush_denormal
