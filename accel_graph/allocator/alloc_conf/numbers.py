"""Torch-exact number conversions and the config tokenizer (c10's ``ConfigTokenizer``).

``std::stoull`` and ``std::stod`` accept prefixes, wrap and round in ways Python's ``int()`` and
``float()`` do not; the grammar must accept and reject the very strings torch does, so each is
reproduced here. :class:`NumberError` carries whether the failure was "out of range" (torch's
message differs).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from ..units import U64_MAX

__all__ = ["SEPARATORS", "SIZE_MAX", "Malformed", "NumberError", "is_pow2", "stod", "stoull",
           "tokenize"]

SIZE_MAX = U64_MAX  # torch's name in the config parser: what stoull fits in on 64-bit hosts


class Malformed(Exception):
    """A malformed string: torch would trip an internal assert here; carries the index that was out of bounds."""


_C_SPACE = frozenset(" \t\n\v\f\r")
#: The characters that end a token and are tokens themselves.
SEPARATORS = frozenset(",:[]")


def tokenize(text: str) -> list[str]:
    """Split at the separators ``,:[]`` (kept as tokens) and drop C whitespace, as torch does."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in SEPARATORS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch not in _C_SPACE:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


_ULL = re.compile(r"[+-]?[0-9]+")
_HEX = re.compile(r"([+-]?)0[xX]([0-9a-fA-F]*)(?:\.([0-9a-fA-F]*))?(?:[pP]([+-]?[0-9]+))?")
_DEC = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPECIAL = re.compile(r"([+-]?)(infinity|inf|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)
_MIN_NORMAL = 2.2250738585072014e-308


class NumberError(Exception):
    """``stoull``/``stod`` refused a token; ``out_of_range`` tells torch's two messages apart."""

    def __init__(self, out_of_range: bool) -> None:
        super().__init__()
        self.out_of_range = out_of_range


def stoull(token: str) -> int:
    """``std::stoull``: a decimal prefix, '-' wraps modulo 2**64, overflow is out of range."""
    m = _ULL.match(token)
    if not m:
        raise NumberError(False)
    text = m.group()
    value = int(text.lstrip("+-"))
    if value > SIZE_MAX:
        raise NumberError(True)
    return (-value) % (1 << 64) if text.startswith("-") else value


def stod(token: str) -> float:
    """``std::stod`` (glibc strtod): longest numeric prefix; inexact under/overflow is out of range."""
    m = _SPECIAL.match(token)
    if m:
        value = math.inf if m.group(2).lower().startswith("inf") else math.nan
        return -value if m.group(1) == "-" else value
    m = _HEX.match(token)
    if m and (m.group(2) or m.group(3)):
        exact = _hex_fraction(m)
    else:
        m = _DEC.match(token)
        if not m:
            raise NumberError(False)
        mant, _, exp = m.group().lower().partition("e")
        whole, _, frac = mant.lstrip("+-").partition(".")
        if not (whole + frac).strip("0"):
            return 0.0
        # Decimal magnitude of the value, so absurd exponents never reach Fraction's bignums.
        if whole.lstrip("0"):
            magnitude = len(whole.lstrip("0")) + (int(exp) if exp else 0)
        else:
            magnitude = (int(exp) if exp else 0) - (len(frac) - len(frac.lstrip("0")))
        if abs(magnitude) > 400:
            raise NumberError(True)  # certain overflow, or underflow of a nonzero value
        exact = Fraction(m.group())
    if exact == 0:
        return 0.0
    try:
        value = float(exact)
    except OverflowError:
        raise NumberError(True) from None
    if abs(value) < _MIN_NORMAL and Fraction(value) != exact:
        raise NumberError(True)
    return value


def _hex_fraction(m: re.Match[str]) -> Fraction:
    sign, whole, frac, exp = m.group(1), m.group(2), m.group(3) or "", m.group(4)
    mantissa = int(whole + frac, 16)
    power = (int(exp) if exp else 0) - 4 * len(frac)
    if power > 5000:
        raise NumberError(mantissa != 0)
    if power < -5000:
        if mantissa:
            raise NumberError(True)
        return Fraction(0)
    value = Fraction(mantissa) * (Fraction(2) ** power)
    return -value if sign == "-" else value



def is_pow2(value: int) -> bool:
    """Whether ``value`` is a positive power of two."""
    return value > 0 and value & (value - 1) == 0
