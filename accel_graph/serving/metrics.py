"""Serving figures from request results: tokens/s, TTFT and TPOT percentiles.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

- ``tokens_per_s``: generated tokens of the served requests over the run's wall time (from the
  start of ``Engine.run`` to the last token);
- ``ttft_ms_*``: time to first token, from the request's arrival (not its admission: waiting
  in the queue counts), over served requests;
- ``tpot_ms_*``: per request, the mean interval between its generated tokens after the first;
  percentiles over the requests that generated at least two tokens.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .requests import RequestResult

__all__ = ["percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: Iterable[RequestResult], elapsed_s: float) -> dict[str, float | int]:
    """JSON-ready figures of one run (module docstring); ``elapsed_s`` is the run's wall time."""
    results = list(results)
    served = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in served if r.ttft is not None]
    tpot = [r.tpot * 1e3 for r in served if r.tpot is not None]
    generated = sum(len(r.tokens) for r in served)
    return {
        "served": len(served),
        "rejected": sum(r.finish_reason == "rejected" for r in results),
        "failed": sum(r.finish_reason == "error" for r in results),
        "generated_tokens": generated,
        "elapsed_s": elapsed_s,
        "tokens_per_s": generated / elapsed_s if elapsed_s > 0 else math.nan,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
    }
