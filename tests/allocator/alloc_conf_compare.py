"""One comparison rule for every allocator-config parity test: torch's outcome (live, or from a
frozen table) against :func:`~accel_graph.allocator.alloc_conf.parse_config`'s."""

from __future__ import annotations

from accel_graph.allocator.alloc_conf import parse_config
from accel_graph.errors import ConfigError

# torch only says this for std::invalid_argument / std::out_of_range; ours says more.
OPAQUE = {"stoull", "stod"}


def our_outcome(text: str, device: str, torch: str | None = None) -> ConfigError | None:
    try:
        parse_config(text, device, torch)
    except ConfigError as e:
        return e
    return None


def mismatch(theirs: list[str] | None, text: str, device: str, torch: str | None) -> str | None:
    """Why our parse of ``text`` disagrees with torch's recorded outcome ``theirs`` (None: accepted;
    ``[type, message]``: raised), or None when they agree.

    Agreement: both accept; torch stopped at a missing driver (``DriverError``, a GPU-less
    host) and we accept; or both reject and, where torch raised a ValueError with a real
    message, ours contains it verbatim; where torch only said ``stoull``/``stod``, raised an
    IndexError or tripped an internal assert, ours explains instead of echoing torch.
    """
    ours = our_outcome(text, device, torch)
    if theirs is None:
        return None if ours is None else f"torch accepts {text!r}, we reject it: {ours}"
    if theirs[0] == "DriverError":  # torch parsed the string up to a driver call: not malformed
        return None if ours is None else f"torch got past parsing {text!r} ({theirs[1]}), we reject it: {ours}"
    if ours is None:
        return f"torch rejects {text!r} ({theirs}), we accept it"
    kind, message = theirs
    if kind == "ValueError" and message not in OPAQUE:
        if message not in str(ours):
            return f"{text!r}: torch says {message!r}, we say {ours}"
        return None
    if "INTERNAL ASSERT" in str(ours) or len(str(ours)) <= 40:
        return f"{text!r}: torch says {theirs}, and ours does not explain: {ours}"
    return None

