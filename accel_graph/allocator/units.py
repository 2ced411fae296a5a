"""Byte units: the constants every allocator module counts in, and one formatter for messages,
reports and tables."""

from __future__ import annotations

__all__ = ["MIB", "U64_MAX", "fmt_bytes", "fmt_signed_bytes"]

#: One mebibyte: torch's allocator settings and figures are in MiB.
MIB = 1 << 20
#: ``UINT64_MAX``: the C core's "no limit" value and torch's ``SIZE_MAX`` on 64-bit hosts.
U64_MAX = (1 << 64) - 1


def fmt_bytes(n: float | int | None) -> str:
    """Bytes as ``12.3 MiB`` (binary units); ``-`` for None."""
    if n is None:
        return "-"
    v = float(n)
    sign = "-" if v < 0 else ""
    v = abs(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1024
    return f"{sign}{v:.1f} TiB"  # pragma: no cover


def fmt_signed_bytes(n: int) -> str:
    """A change in bytes, always signed: ``+12.3 MiB``, ``-1.0 KiB``, ``+0 B``."""
    return ("+" if n >= 0 else "-") + fmt_bytes(abs(n))
