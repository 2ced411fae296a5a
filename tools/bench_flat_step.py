"""Benchmark: one flat serving step, eager against the graph executor (issue 27).

Builds the serving-sized bundled decoder (``accel_graph.serving.executors.serving_config``:
256-token context, 16 slots), gives every slot a cached history, and times, interleaved in
rounds, the same steps through an ``EagerExecutor`` (under ``inference_mode``: the baseline)
and one ``GraphExecutor`` per graph mode (``--graphs``, default piecewise and full; compiled
replay by default) over the same model: decode
steps of 1, 4, 8 and 16 requests, and mixed steps (one prompt chunk plus decode tokens); and,
as a check on the baseline, the whole-step forms of ``graphs="full"`` run eagerly ("eager
full": is eager's own attention form the faster eager one?). A
step rewrites the same keys and values at the same positions each time, so repeating it is
steady state. Medians of per-round medians; ratios from the same run.

    bash tools/dev.sh run python tools/bench_flat_step.py --json /tmp/bench-flat-step.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "rows"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from accel_graph.bench.timing import hardware_info, load_avg
from accel_graph.models import Decoder
from accel_graph.serving.executors import EagerExecutor, GraphExecutor, serving_config, token_ladder
from accel_graph.serving.step import Segment, StepBatch

#: (name, decode segments, prompt chunk tokens)
CASES = [("decode 1", 1, 0), ("decode 4", 4, 0), ("decode 8", 8, 0), ("decode 16", 16, 0),
         ("chunk 32 + decode 8", 8, 32), ("chunk 48 + decode 15", 15, 48),
         ("chunk 64", 0, 64)]


def make_step(decodes: int, chunk: int, context: int, seed: int) -> StepBatch:
    """``decodes`` decode segments in slots 0.. at positions near ``context``, and a prompt
    chunk of ``chunk`` tokens in the next slot starting at ``context // 2``."""
    g = torch.Generator().manual_seed(seed)
    segs = []
    for s in range(decodes):
        pos = context - int(torch.randint(0, context // 2, (1,), generator=g))
        segs.append(Segment(s, pos, (int(torch.randint(0, 500, (1,), generator=g)),), True))
    if chunk:
        toks = tuple(torch.randint(0, 500, (chunk,), generator=g).tolist())
        segs.append(Segment(decodes, context // 2, toks, True))
    return StepBatch(tuple(segs))


def _time(run: Any, batch: StepBatch, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        run(batch)
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--iters", type=int, default=30, help="timed steps per variant per round")
    p.add_argument("--max-tokens", type=int, default=64, help="largest token bucket (default 64)")
    p.add_argument("--buckets", type=int, nargs="*", default=None, help="token buckets")
    p.add_argument("--compile", default="inductor", help="inductor (default) or none")
    p.add_argument("--cpp-wrapper", action="store_true", help="Inductor's C++ wrapper")
    p.add_argument("--replay", default="compiled", help="compiled (default, as the executor), "
                   "auto, interpreted")
    p.add_argument("--graphs", default="piecewise,full",
                   help="graph executor modes to time, comma-separated (default %(default)s)")
    p.add_argument("--context", type=int, default=160, help="cached tokens per slot (default 160)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--config", default="", help="DecoderConfig overrides, e.g. dim=64,n_heads=2")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    overrides = {}
    for item in filter(None, a.config.split(",")):
        key, value = item.split("=")
        overrides[key.strip()] = float(value) if "." in value else int(value)
    cfg = serving_config(**overrides)
    model = Decoder(cfg)
    with torch.no_grad():  # a cached history in every slot (finite values, as real keys are)
        for layer in model.layers:
            layer.k_cache.normal_(generator=torch.Generator().manual_seed(1))
            layer.v_cache.normal_(generator=torch.Generator().manual_seed(2))
    compile_mode = None if a.compile == "none" else a.compile
    options: dict[str, Any] | None = None
    if compile_mode:
        options = {"replay": a.replay, "cpp_wrapper": a.cpp_wrapper}
    eager = EagerExecutor(model, max_tokens=a.max_tokens)
    modes = [m for m in a.graphs.split(",") if m]
    graphs: dict[str, GraphExecutor] = {}
    capture_s: dict[str, float] = {}
    for mode in modes:
        t0 = time.perf_counter()
        graphs[mode] = GraphExecutor(model, max_tokens=a.max_tokens, buckets=a.buckets,
                                     compile=compile_mode, compile_options=options, graphs=mode)
        capture_s[mode] = round(time.perf_counter() - t0, 2)
    # The whole-step forms run eagerly (uncaptured runners fall back to eager): is the eager
    # baseline's attention form (sdpa at the live lengths) the faster eager one?
    eager_full = GraphExecutor(model, max_tokens=a.max_tokens, buckets=a.buckets,
                               compile=None, graphs="full", capture=False)
    logging.getLogger("accel_graph").setLevel(logging.ERROR)  # its fallback notes
    rows = []
    print(f"capture (and compile) seconds {capture_s}; token buckets "
          f"{graphs[modes[0]].runner.buckets}")
    head = f"{'step':>22} {'tokens':>6} {'eager us':>9} {'eager full us':>13}"
    for mode in modes:
        head += f" {mode + ' us':>{max(9, len(mode) + 3)}} {'speedup':>8}"
    print(head)
    for i, (name, decodes, chunk) in enumerate(CASES):
        batch = make_step(decodes, chunk, a.context, seed=i)
        if batch.num_tokens > a.max_tokens:
            continue
        ref = eager.run(batch)
        same = {m: g.run(batch) == ref for m, g in graphs.items()}
        for g in graphs.values():
            for _ in range(20):  # past the checked replays and replay="auto"'s decision
                g.run(batch)
        same["eager full"] = eager_full.run(batch) == ref
        runs = [("eager", eager.run), ("eager full", eager_full.run)] + [
            (m, g.run) for m, g in graphs.items()]
        meds: dict[str, list[float]] = {m: [] for m, _ in runs}
        for r in range(a.rounds):
            order = runs if r % 2 == 0 else runs[::-1]
            for m, run in order:
                meds[m].append(_time(run, batch, a.iters))
        e = statistics.median(meds["eager"])
        ef = statistics.median(meds["eager full"])
        row: dict[str, Any] = {"step": name, "tokens": batch.num_tokens,
                               "segments": len(batch.segments), "eager_us": round(e, 1),
                               "eager_full_us": round(ef, 1),
                               "eager_full_tokens_equal": same["eager full"]}
        line = f"{name:>22} {batch.num_tokens:>6} {e:>9.1f} {ef:>13.1f}"
        for m in modes:
            g_us = statistics.median(meds[m])
            row[m] = {"graph_us": round(g_us, 1), "speedup": round(e / g_us, 3),
                      "tokens_equal": same[m]}
            line += f" {g_us:>{max(9, len(m) + 3)}.1f} {e / g_us:>7.2f}x" + ("" if same[m] else " DIFFER")
        rows.append(row)
        print(line)
    report = {"tool": "tools/bench_flat_step.py",
              "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "hardware": hardware_info(), "load_avg": load_avg(),
              "settings": {"config": cfg.as_dict(), "rounds": a.rounds, "iters": a.iters,
                           "buckets": graphs[modes[0]].runner.buckets, "graphs": modes,
                           "compile": compile_mode,
                           "cpp_wrapper": a.cpp_wrapper, "replay": a.replay, "context": a.context,
                           "threads": a.threads, "torch": torch.__version__,
                           "capture_s": capture_s,
                           "default_ladder": token_ladder(a.max_tokens)},
              "describe": {m: g.describe() for m, g in graphs.items()}, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
