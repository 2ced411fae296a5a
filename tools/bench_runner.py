"""Benchmark: GraphRunner costs that issue 17 budgets (recorder, CPU).

Three measurements, each interleaved within one run, medians:

1. **Runner overhead at batch 1**: one ``runner(x)`` call minus one bare ``graph.replay()`` of
   the same bucket's graph (which is what the call does besides copying inputs in and handing
   outputs back), for a small step, with and without per-bucket state (``state=``).
2. **Output memory** of the bundled decoder over vLLM's ladder up to ``--max-batch``: the bytes
   the buckets' outputs cover, with and without ``share_outputs=True``, and the pool.
3. **Start-up to the first result at batch 1**: construct + first call with
   ``capture="lazy"`` (one bucket warmed up, captured, verified), over construct +
   ``capture()`` of the whole ladder + first call (the first call verifies in both).

    bash tools/dev.sh run python tools/bench_runner.py --json out.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "overhead",
"outputs", "lazy"}``. Eager under ``inference_mode`` is the baseline of the decoder rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

import accel_graph
from accel_graph.models import Decoder, DecoderConfig


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def overhead(calls: int, rounds: int) -> dict[str, float]:
    """Median microseconds per call of runner(x) and of the bare replay, with/without state."""
    w = torch.randn(64, 64)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    def step_state(x: torch.Tensor, *, state: torch.Tensor) -> torch.Tensor:
        state.add_(1)
        return torch.tanh(x @ w) + state

    plain = accel_graph.GraphRunner(step, torch.zeros(1, 64), buckets=[1, 2, 4], progress=False).capture()
    stateful = accel_graph.GraphRunner(step_state, torch.zeros(1, 64), buckets=[1, 2, 4],
                                       state=lambda b: torch.zeros(1), progress=False).capture()
    x = torch.randn(1, 64)
    for r in (plain, stateful):
        for _ in range(3):  # checked replays first, then the hot path
            r(x)
    timings: dict[str, list[float]] = {"runner": [], "runner_state": [], "replay": [], "replay_state": []}
    subjects = {
        "runner": lambda: plain(x),
        "runner_state": lambda: stateful(x),
        "replay": plain.graph(1).replay,
        "replay_state": stateful.graph(1).replay,
    }
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in subjects.items():  # interleaved, round by round
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                timings[name].append((time.perf_counter() - t0) / calls * 1e6)
    med = {k: statistics.median(v) for k, v in timings.items()}
    return {
        "runner_us": med["runner"], "replay_us": med["replay"],
        "overhead_us": med["runner"] - med["replay"],
        "runner_state_us": med["runner_state"], "replay_state_us": med["replay_state"],
        "overhead_state_us": med["runner_state"] - med["replay_state"],
    }


_MODELS: dict[int, Decoder] = {}


def _decoder_runner(max_batch: int, **kw: object) -> accel_graph.GraphRunner:
    """A runner over the bundled decoder (the model is built once per ladder, outside timings)."""
    model = _MODELS.get(max_batch)
    if model is None:
        torch.manual_seed(0)
        model = _MODELS[max_batch] = Decoder(DecoderConfig(max_batch=max_batch)).eval()
    example = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return accel_graph.GraphRunner(model.decode_step, example, max_batch=max_batch, progress=False, **kw)


def outputs(max_batch: int) -> dict[str, object]:
    rows = {}
    for share in (False, True):
        rep = _decoder_runner(max_batch, share_outputs=share).capture().memory_report()
        rows["shared" if share else "per_bucket"] = {
            k: rep[k] for k in ("output_bytes_per_bucket_sum", "output_region_bytes",
                                "output_bytes_saved", "pool_reserved_bytes")}
        rows["buckets"] = [b["bucket"] for b in rep["buckets"]]
    return rows


def lazy(max_batch: int, rounds: int) -> dict[str, float]:
    x = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    eager_s, lazy_s = [], []
    for _ in range(rounds):  # interleaved
        t0 = time.perf_counter()
        _decoder_runner(max_batch).capture()(*x)
        eager_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = _decoder_runner(max_batch, capture="lazy")
        r(*x)
        lazy_s.append(time.perf_counter() - t0)
    e, la = statistics.median(eager_s), statistics.median(lazy_s)
    return {"eager_first_result_s": e, "lazy_first_result_s": la, "lazy_vs_eager": la / e,
            "buckets": len(_decoder_runner(max_batch).buckets)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per timed round (overhead)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (medians)")
    p.add_argument("--max-batch", type=int, default=32, help="ladder of the decoder rows")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    # One capture first, so torch's one-time imports do not land in the first timed row.
    _decoder_runner(2).capture()
    res = {
        "tool": "tools/bench_runner.py",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                     "python": platform.python_version(), "torch_threads": 1},
        "settings": vars(a),
        "overhead": overhead(a.calls, a.rounds),
        "outputs": outputs(a.max_batch),
        "lazy": lazy(a.max_batch, max(3, a.rounds // 3)),
    }
    o, out, lz = res["overhead"], res["outputs"], res["lazy"]
    print(f"{res['hardware']['cpu']}, {res['hardware']['cores']} cores, torch {torch.__version__}, 1 thread")
    print("| measurement | value |\n|---|---|")
    print(f"| runner(x) batch 1 | {o['runner_us']:.2f} us (bare replay {o['replay_us']:.2f} us) |")
    print(f"| runner overhead, no state | {o['overhead_us']:.2f} us |")
    print(f"| runner overhead, with state= | {o['overhead_state_us']:.2f} us |")
    for k in ("per_bucket", "shared"):
        r = out[k]
        print(f"| decoder outputs, {k} ({len(out['buckets'])} buckets) | region {r['output_region_bytes']} B "
              f"of {r['output_bytes_per_bucket_sum']} B; pool {r['pool_reserved_bytes']} B |")
    print(f"| start-up to the first result, lazy / eager ({lz['buckets']} buckets) | "
          f"{lz['lazy_first_result_s'] * 1e3:.1f} ms / {lz['eager_first_result_s'] * 1e3:.1f} ms "
          f"= {lz['lazy_vs_eager']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
