"""Benchmark: multi-step decode in one replay (``Decoder.decode_steps`` in a
``torch.while_loop``) against N one-step replays of the bundled decoder (recorder, CPU).

Both decode the same N greedy tokens at batch 1 from the same start: one graph of
``decode_steps(steps=N)`` replayed once, or one graph of ``decode_step`` replayed N times with
the argmax and the input update in Python between replays (what a server loop does); each
interpreted and compiled (``compile="inductor"``: the multi-step graph's loop predicate and
body are Inductor programs, the loop on the host). Eager under ``inference_mode`` is the
baseline. Interleaved rounds, medians, 1 torch thread.

    bash tools/dev.sh run python tools/bench_multistep.py [--steps 8] [--rounds 21] --json out.json
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = Decoder(DecoderConfig())
    tok, pos = torch.tensor([3]), torch.tensor([0])
    graphs = {}
    with torch.no_grad():
        for mode in (None, "inductor"):  # interpreted, then compiled replay
            one = accel_graph.Graph(device="cpu", compile=mode)
            with accel_graph.graph(one):
                logits = model.decode_step(tok, pos)
            multi = accel_graph.Graph(device="cpu", compile=mode)
            with accel_graph.graph(multi):
                out, count = model.decode_steps(tok, pos, steps=a.steps)
            graphs[mode] = (one, logits, multi, out)

    def run_one(one: accel_graph.Graph, logits: torch.Tensor) -> torch.Tensor:
        toks = []
        for _ in range(a.steps):
            one.replay()
            nxt = logits.argmax(-1)
            toks.append(nxt)
            tok.copy_(nxt)
            pos.add_(1)
        return torch.stack(toks, 1)

    def run_eager() -> torch.Tensor:
        t, q, toks = tok.clone(), pos.clone(), []
        for _ in range(a.steps):
            t = model.decode_step(t, q).argmax(-1)
            toks.append(t)
            q = q + 1
        return torch.stack(toks, 1)

    times: dict[str, list[float]] = {"eager": [], "one_step_replays": [], "multi_step_replay": [],
                                     "one_step_replays_compiled": [], "multi_step_replay_compiled": []}
    results = {}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for name in times:  # interleaved
                model.reset_cache()
                tok.fill_(3)
                pos.zero_()
                t0 = time.perf_counter()
                one, logits, multi, out = graphs["inductor" if name.endswith("compiled") else None]
                if name == "eager":
                    results[name] = run_eager()
                elif name.startswith("one_step"):
                    results[name] = run_one(one, logits)
                else:
                    multi.replay()
                    results[name] = out.clone()
                times[name].append(time.perf_counter() - t0)
    equal = all(torch.equal(results[k], results["eager"]) for k in results)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"variant": k, "median_ms": med[k] * 1e3, "tokens_per_s": a.steps / med[k],
             "x_eager_time": med[k] / med["eager"]} for k in times]
    res = {"tool": "tools/bench_multistep.py",
           "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "hardware": {"cores": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
                        "torch_threads": 1},
           "settings": vars(a), "tokens_equal_eager": equal, "rows": rows,
           "multi_vs_one_step_tokens_per_s": med["one_step_replays"] / med["multi_step_replay"],
           "compiled_multi_vs_one_step_tokens_per_s":
               med["one_step_replays"] / med["multi_step_replay_compiled"],
           "compiled_multi_vs_compiled_one_step_tokens_per_s":
               med["one_step_replays_compiled"] / med["multi_step_replay_compiled"],
           "load_avg_1m": os.getloadavg()[0]}
    print(f"batch 1, {a.steps} tokens, {a.rounds} interleaved rounds; tokens equal to eager: {equal}")
    print("| variant | median ms | tokens/s | x eager time |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['x_eager_time']:.3f} |")
    print(f"multi-step / one-step tokens per second (interpreted): {res['multi_vs_one_step_tokens_per_s']:.3f}")
    print(f"compiled multi-step / interpreted one-step: {res['compiled_multi_vs_one_step_tokens_per_s']:.3f}; "
          f"compiled multi-step / compiled one-step: {res['compiled_multi_vs_compiled_one_step_tokens_per_s']:.3f}; "
          f"load average {res['load_avg_1m']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
