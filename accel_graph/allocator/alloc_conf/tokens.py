"""torch's token walk over a ``PYTORCH_ALLOC_CONF`` string: token access, value conversions, the
``roundup_power2_divisions`` list and the error messages, shared by the grammar and the settings.

:class:`TokenWalk` is what every key handler stands on; :class:`~.grammar.ConfigParser` adds the
keys of each pass. The roundup list lives here, not in the grammar, because
:meth:`~.settings.AllocatorSettings.to_string` reads its own list form back through it
(:func:`read_roundup_list`) to be sure it never prints a lossy one: below both, neither module
needs the other.
"""

from __future__ import annotations

from ...errors import ConfigError
from ..devices import CONFIG_DIALECTS
from .numbers import SEPARATORS, Malformed, NumberError, is_pow2, stod, stoull, tokenize

__all__ = ["ROUNDUP_INTERVALS", "TokenWalk", "legal_values", "read_roundup_list"]

#: Number of roundup_power2_divisions intervals: [0] < 2 MiB, [i] = [2^(20+i), 2^(21+i)), [15] >= 32 GiB.
ROUNDUP_INTERVALS = 16

_LEGAL = {
    "large_segment_size_mb": "an integer number of MiB > 10 (default 20)",
    "max_split_size_mb": "an integer number of MiB >= large_segment_size_mb (20 by default); "
    "default unlimited",
    "max_non_split_rounding_mb": "an integer number of MiB >= large_segment_size_mb "
    "(20 by default); default = large_segment_size_mb",
    "garbage_collection_threshold": "a number strictly between 0.0 and 1.0; default 0 (off)",
    "roundup_power2_divisions": "a power of 2 for every interval, or a list [K:d,...,>:d] with "
    "K a power-of-2 MiB boundary and d a power of 2 or 0",
    "pinned_max_round_threshold_mb": "an integer number of MiB; default unlimited",
    "pinned_max_cached_size_mb": "an integer number of MiB; default unlimited",
    "backend": "native or cudaMallocAsync",
    "pinned_num_register_threads": "a power of 2 <= 128; default 1",
    "pinned_reserve_segment_size_mb": "an integer number of MiB > 0; default 0 (off)",
    "per_process_memory_fraction": "a number in [0.0, 1.0]; default 1.0",
}
_BOOL_LEGAL = "exactly True or False (case-sensitive)"
_SYNTAX = "entries are key:value separated by ',', list values are [a:b,c:d]"


def legal_values(key: str, device: str) -> str:
    dialect = CONFIG_DIALECTS.get(device)
    if key == "backend" and dialect is not None and dialect.backends:
        *first, last = dialect.backends
        return f"{', '.join(first)} or {last}"
    return _LEGAL.get(key, _BOOL_LEGAL)


class TokenWalk:
    """One walk over one string's tokens for one device: token access, value conversions and
    the errors that name the current key (``self.key``) and its legal values. Handlers store
    what they read in ``self.values`` under the :class:`~.settings.AllocatorSettings` field
    name."""

    def __init__(self, text: str, device: str) -> None:
        self.text = text
        self.device = device
        self.tokens = tokenize(text)
        self.key = ""
        self.values: dict[str, object] = {}

    # -- token access: out-of-bounds is torch's internal assert, a malformed string for us
    def tok(self, i: int) -> str:
        if i >= len(self.tokens):
            raise Malformed(i)
        return self.tokens[i]

    def check(self, i: int, token: str) -> bool:
        return self.tok(i) == token

    def error(self, message: str) -> ConfigError:
        key = self.key
        err = ConfigError(
            f"invalid allocator config {self.text!r}: {message.rstrip()} "
            f"(key '{key}': legal values are {legal_values(key, self.device)})"
        )
        err.key = key  # type: ignore[attr-defined]
        return err

    def to_size(self, i: int) -> int:
        token = self.tok(i)
        try:
            return stoull(token)
        except NumberError as e:
            what = (
                "is out of range for a 64-bit unsigned integer"
                if e.out_of_range
                else ("is not a non-negative integer")
            )
            raise self.error(f"value '{token}' of {self.key} {what}") from None

    def to_double(self, i: int) -> float:
        token = self.tok(i)
        try:
            return stod(token)
        except NumberError as e:
            what = "is out of the range of a double" if e.out_of_range else "is not a number"
            raise self.error(f"value '{token}' of {self.key} {what}") from None

    def to_bool(self, i: int) -> bool:
        token = self.tok(i)
        if token == "True":
            return True
        if token == "False":
            return False
        raise self.error(
            f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{token}'"
        )

    def skip_key(self, i: int) -> int:
        self.check(i + 1, ":")  # result ignored, as in torch: only the bounds matter
        i += 2
        if self.tok(i) != "[":
            return i
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            i += 1
        if i >= len(self.tokens):
            raise Malformed(i)
        return i


    def parse_roundup(self, i: int) -> int:
        self.key = "roundup_power2_divisions"
        self.check(i + 1, ":")
        i += 2
        divs = [0] * ROUNDUP_INTERVALS
        if self.tok(i) == "[":
            first_value = True
            last_index = 0
            i += 1
            while i < len(self.tokens) and self.tokens[i] != "]":
                boundary_index = i
                self.check(i + 1, ":")
                i += 2
                value = self.to_size(i)
                if not (value == 0 or is_pow2(value)):
                    raise self.error(
                        "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
                    )
                if self.tokens[boundary_index] == ">":
                    for j in range(last_index + 1, ROUNDUP_INTERVALS):
                        divs[j] = value
                else:
                    boundary = self.to_size(boundary_index)
                    if not is_pow2(boundary):
                        raise self.error("For roundups, the intervals have to be power of 2 ")
                    index = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                    if first_value:
                        divs[:index] = [value] * index
                        first_value = False
                    divs[index] = value
                    last_index = index
                if self.tok(i + 1) != "]":
                    i += 1  # torch's checkToken(',') result is ignored
                i += 1
            if i >= len(self.tokens):
                raise Malformed(i)
        else:
            value = self.to_size(i)
            if not is_pow2(value):
                raise self.error("For roundups, the divisions has to be power of 2 ")
            divs = [value] * ROUNDUP_INTERVALS
        self.values["roundup_power2_divisions"] = tuple(divs)
        return i

    def parse_bool(self, i: int, key: str, name: str) -> int:
        self.key = key
        self.check(i + 1, ":")
        i += 2
        self.values[name] = self.to_bool(i)
        return i

    def malformed(self, index: int) -> ConfigError:
        key = self.key
        if key in SEPARATORS:
            what = f"a stray '{key}' where a key was expected (empty entry?)"
        elif any(t == "[" for t in self.tokens) and index >= len(self.tokens):
            what = f"the string ends inside the value of '{key}' (missing value or ']'?)"
        else:
            what = f"key '{key}' has no value (expected '{key}:<value>')"
        err = ConfigError(
            f"malformed allocator config {self.text!r}: {what}; {_SYNTAX}. "
            "(torch itself fails here with an internal assert, "
            "'Index out of bounds in ConfigTokenizer'.)"
        )
        err.key = key  # type: ignore[attr-defined]
        return err


def read_roundup_list(text: str) -> tuple[int, ...]:
    """The divisions a ``roundup_power2_divisions`` value ``text`` (``"[1:4,>:2]"`` or ``"4"``)
    stands for, read as torch reads ``roundup_power2_divisions:<text>`` (on a CPU build: the
    key is common to every device). Raises :class:`ConfigError` as the grammar would."""
    walk = TokenWalk(f"roundup_power2_divisions:{text}", "cpu")
    walk.key = "roundup_power2_divisions"
    try:
        walk.parse_roundup(0)
    except Malformed as e:
        raise walk.malformed(e.args[0]) from None
    return walk.values["roundup_power2_divisions"]  # type: ignore[return-value]
