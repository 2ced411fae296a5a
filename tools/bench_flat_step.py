"""Benchmark: one flat serving step, eager against the graph executor (issue 27).

Builds the serving-sized bundled decoder (``accel_graph.serving.executors.serving_config``:
256-token context, 16 slots), gives every slot a cached history, and times, interleaved in
rounds, the same steps through an ``EagerExecutor`` (under ``inference_mode``: the baseline)
and a ``GraphExecutor`` (token buckets; compiled replay by default) over the same model: decode
steps of 1, 4, 8 and 16 requests, and mixed steps (one prompt chunk plus decode tokens). A
step rewrites the same keys and values at the same positions each time, so repeating it is
steady state. Medians of per-round medians; ratios from the same run.

    .venv213/bin/python tools/bench_flat_step.py --json /tmp/bench-flat-step.json

Prints a table; ``--json`` writes ``{"tool", "created_utc", "hardware", "settings", "rows"}``.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--replay", default="auto", help="auto (default), compiled, interpreted")
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
    t0 = time.perf_counter()
    graph = GraphExecutor(model, max_tokens=a.max_tokens, buckets=a.buckets, compile=compile_mode,
                          compile_options=options)
    capture_s = time.perf_counter() - t0
    rows = []
    print(f"capture (and compile) {capture_s:.1f} s, buckets {graph.runner.buckets}")
    print(f"{'step':>22} {'tokens':>6} {'bucket':>6} {'eager us':>9} {'graph us':>9} {'speedup':>8}")
    for i, (name, decodes, chunk) in enumerate(CASES):
        batch = make_step(decodes, chunk, a.context, seed=i)
        if batch.num_tokens > a.max_tokens:
            continue
        same = eager.run(batch) == graph.run(batch)
        for _ in range(20):  # past the checked replays and replay="auto"'s decision
            graph.run(batch)
        e_med, g_med = [], []
        for r in range(a.rounds):
            order = (eager.run, graph.run) if r % 2 == 0 else (graph.run, eager.run)
            for run in order:
                (e_med if run == eager.run else g_med).append(_time(run, batch, a.iters))
        e, g = statistics.median(e_med), statistics.median(g_med)
        bucket = graph.runner.bucket_for(batch.num_tokens)
        rows.append({"step": name, "tokens": batch.num_tokens, "segments": len(batch.segments),
                     "bucket": bucket, "eager_us": round(e, 1), "graph_us": round(g, 1),
                     "speedup": round(e / g, 3), "tokens_equal": same})
        print(f"{name:>22} {batch.num_tokens:>6} {bucket!s:>6} {e:>9.1f} {g:>9.1f} {e / g:>7.2f}x"
              + ("" if same else "  TOKENS DIFFER"))
    report = {"tool": "tools/bench_flat_step.py",
              "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "hardware": hardware_info(), "load_avg": load_avg(),
              "settings": {"config": cfg.as_dict(), "rounds": a.rounds, "iters": a.iters,
                           "buckets": graph.runner.buckets, "compile": compile_mode,
                           "cpp_wrapper": a.cpp_wrapper, "replay": a.replay, "context": a.context,
                           "threads": a.threads, "torch": torch.__version__,
                           "capture_s": round(capture_s, 2),
                           "default_ladder": token_ladder(a.max_tokens)},
              "describe": graph.describe(), "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
