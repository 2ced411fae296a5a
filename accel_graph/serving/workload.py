"""Seeded request streams for serve-bench, the load sweep and the torchrun demo.

A stream is a list of :class:`~.requests.Request` with Poisson arrivals (exponential gaps at
``rate`` requests per second), prompt lengths uniform in ``A..B`` and output lengths uniform in
``C..D``, all drawn from one ``random.Random(seed)``: the same arguments give the same stream in
every process, so the eager and the graph engine (and every rank) serve the same requests.
"""

from __future__ import annotations

import math
import random

from ..errors import ConfigError
from .requests import Request

__all__ = ["parse_range", "poisson_requests"]


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``, meaning ``A:A``) as a pair of positive ints ``A <= B``; a
    ConfigError naming ``name`` otherwise."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ConfigError(f"{name} must be A:B with 1 <= A <= B (or one positive int), got {text!r}")
    return lo, hi


def poisson_requests(n: int, rate: float, prompt_lens: tuple[int, int],
                     new_tokens: tuple[int, int], *, vocab_size: int, seed: int = 0,
                     eos_id: int | None = None) -> list[Request]:
    """``n`` requests (module docstring); ``rate`` in requests per second (``inf``: all arrive
    at 0). Prompt tokens are uniform over ``0..vocab_size-1``; ids are the indexes."""
    if n < 1:
        raise ConfigError(f"the number of requests must be >= 1, got {n}")
    if not rate > 0:
        raise ConfigError(f"the arrival rate must be > 0 requests/s (inf: all at once), got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        plen = rng.randint(*prompt_lens)
        prompt = [rng.randrange(vocab_size) for _ in range(plen)]
        out.append(Request(prompt, rng.randint(*new_tokens), eos_id, arrival=t, id=i))
    return out
