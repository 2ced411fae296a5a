"""Per-dtype tolerances and the result comparisons built on them (layer L0: torch only).

DESIGN.md's rule: interpreted replay at the captured shape runs the same kernels on the same
values as eager, so it must be *bitwise* equal (:func:`assert_bitwise_equal`). Compiled replay
(``compile="inductor"``) and replay at a padded bucket reorder or fuse floating-point work, so
they are compared within the per-dtype tolerances of :data:`TOLERANCES`
(:func:`assert_close_for_dtype`). Both accept a tensor or any nesting of lists, tuples and dicts
of tensors, and fail with a message saying where and by how much the results differ.

The runner's first-replay verification and the demo's token check use these directly; the test
helpers that depend on the active replay mode (:func:`~accel_graph.testing.compiled_replay`,
:func:`~accel_graph.testing.assert_replay_matches`) live in :mod:`accel_graph.testing.tolerances`,
which re-exports everything here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_bitwise_equal",
    "assert_close_for_dtype",
    "tolerance_for",
]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise (torch's rule)."""

    rtol: float
    atol: float


_EXACT = Tolerance(0.0, 0.0)

#: Per-dtype tolerances for compiled and padded replay. Integer and bool results are exact.
#: float32/complex64 use torch.testing.assert_close's defaults (rtol 1.3e-6, atol 1e-5): an
#: absolute floor of 1e-6 failed on values near zero produced by cancellation (5.7e-6 off on
#: 0.0037 after Inductor reordered a reduction), which is rounding, not a replay error.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-9),
    torch.complex128: Tolerance(1e-7, 1e-9),
    torch.float32: Tolerance(1.3e-6, 1e-5),
    torch.complex64: Tolerance(1.3e-6, 1e-5),
    torch.float16: Tolerance(1e-2, 1e-3),
    torch.bfloat16: Tolerance(1e-2, 1e-2),
}
# float8 formats exist only in newer torch builds; feature-detect them.
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        TOLERANCES[getattr(torch, _name)] = Tolerance(1.25e-1, 1e-2)


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The tolerance for results of ``dtype``: exact for integers and bool."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        raise ValueError(f"no tolerance defined for {dtype}; add it to TOLERANCES in {__name__}")
    return _EXACT


def _leaves(actual: Any, expected: Any, where: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Pair up the tensors of two equally nested structures, failing on a structural mismatch."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        return [(where, actual, expected)]
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            raise AssertionError(
                f"{where}: keys differ: {sorted(map(str, actual))} vs {sorted(map(str, expected))}"
            )
        return [
            pair for k in expected for pair in _leaves(actual[k], expected[k], f"{where}[{k!r}]")
        ]
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        if not isinstance(actual, Sequence) or len(actual) != len(expected):
            raise AssertionError(
                f"{where}: expected a sequence of {len(expected)}, got {actual!r:.80}"
            )
        return [
            pair
            for i, (a, e) in enumerate(zip(actual, expected, strict=True))
            for pair in _leaves(a, e, f"{where}[{i}]")
        ]
    if actual != expected:
        raise AssertionError(f"{where}: {actual!r} != {expected!r}")
    return []


def _check_meta(where: str, a: torch.Tensor, e: torch.Tensor) -> None:
    if a.dtype != e.dtype or a.shape != e.shape or a.device != e.device:
        raise AssertionError(
            f"{where}: got {a.dtype}{list(a.shape)} on {a.device}, "
            f"expected {e.dtype}{list(e.shape)} on {e.device}"
        )


def _describe_mismatch(a: torch.Tensor, e: torch.Tensor, bad: torch.Tensor) -> str:
    a, e, bad = a.detach().cpu(), e.detach().cpu(), bad.cpu()
    count = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0]) if count else ()
    msg = f"{count} of {bad.numel()} elements differ; first at index {first}: {a[first]!r} vs {e[first]!r}"
    if a.dtype.is_floating_point or a.dtype.is_complex:
        diff = (
            a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
            - e.to(torch.complex128 if e.dtype.is_complex else torch.float64)
        ).abs()
        finite = diff[torch.isfinite(diff)]
        if finite.numel():
            msg += f"; max abs difference {float(finite.max()):.3g}"
    return msg


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``'s elements, one row per element (so NaN payloads and -0.0 count)."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return (
        flat.view(torch.uint8).reshape(flat.numel(), -1) if flat.numel() else flat.view(torch.uint8)
    )


def assert_bitwise_equal(actual: Any, expected: Any, *, msg: str = "") -> None:
    """Assert ``actual`` and ``expected`` hold the same dtypes, shapes, devices and *bits*.

    Stricter than ``torch.equal``: NaNs must match bit for bit and ``-0.0`` differs from ``0.0``.
    For interpreted replay at the captured shape, which runs the kernels eager runs.
    """
    prefix = f"{msg}: " if msg else ""
    for where, a, e in _leaves(actual, expected, "result"):
        _check_meta(prefix + where, a, e)
        ab, eb = _bits(a), _bits(e)
        if torch.equal(ab, eb):
            continue
        bad = (ab != eb).reshape(ab.shape[0], -1).any(dim=1).reshape(a.shape) if a.numel() else None
        assert bad is not None
        raise AssertionError(
            f"{prefix}{where} is not bitwise equal: {_describe_mismatch(a, e, bad)}"
        )


def assert_close_for_dtype(actual: Any, expected: Any, *, msg: str = "") -> None:
    """Assert ``actual`` is within the :data:`TOLERANCES` of ``expected``'s dtype (NaN == NaN).

    For compiled replay and replay at a padded bucket. Dtypes, shapes and devices must match.
    """
    prefix = f"{msg}: " if msg else ""
    for where, a, e in _leaves(actual, expected, "result"):
        _check_meta(prefix + where, a, e)
        tol = tolerance_for(e.dtype)
        if tol == _EXACT:
            if not torch.equal(a, e):
                raise AssertionError(f"{prefix}{where} differs: {_describe_mismatch(a, e, a != e)}")
            continue
        wide = torch.complex128 if e.dtype.is_complex else torch.float64
        a64, e64 = a.detach().to(wide), e.detach().to(wide)
        ok = ((a64 - e64).abs() <= tol.atol + tol.rtol * e64.abs()) | (a64.isnan() & e64.isnan())
        ok |= a64 == e64  # equal infinities
        if not bool(ok.all()):
            raise AssertionError(
                f"{prefix}{where} is not within rtol={tol.rtol}, atol={tol.atol} for {e.dtype}: "
                f"{_describe_mismatch(a, e, ~ok)}"
            )
