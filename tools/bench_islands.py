"""Eager islands on the recorder: what an island costs per replay, and a tiny MoE decoder with
its experts as islands, against eager under ``inference_mode`` (interleaved rounds, medians).

    python tools/bench_islands.py [--rounds 31] [--no-compile] [--json PATH]

1. Overhead of one island per replay, beyond the island's own eager time: three programs on a
   16-element tensor, ``a = x * 2; b = f(a); out = b + 1`` with ``f`` an island, the same
   without ``f`` (``out = a + 1``), and ``f`` alone, eager. Overhead = with - without - f alone.
2. A transformers 5 Mixtral (2 layers, hidden 32, 4 experts, the per-expert loop that reads the
   router's choice on the host) at batch 1, one forward over 8 tokens without a cache: eager,
   interpreted replay and compiled replay (``compile="inductor"``), the experts modules marked
   as islands. Replays are checked against eager (bitwise interpreted, float-close compiled).
   Skipped, saying why, without transformers 5.

Timings are for the machine this runs on; state it with any figure (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import accel_graph

STEP_CALLS = 200  # calls per timed sample in the overhead rows (one sample = their mean)


def sample(fn: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call of ``fn`` over ``calls`` calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, sampled in turn, ``rounds`` times."""
    for fn in fns.values():  # warm-up
        sample(fn, max(1, calls // 10))
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            runs[name].append(sample(fn, calls))
    return {k: statistics.median(v) for k, v in runs.items()}


def island_overhead(rounds: int) -> dict[str, Any]:
    """Row 1: the cost of one island per replay beyond the island's own eager time."""
    x = torch.randn(16)

    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.neg(a)

    island = accel_graph.eager_island(f)
    with torch.inference_mode():
        with_island, without = accel_graph.Graph(device="cpu"), accel_graph.Graph(device="cpu")
        with accel_graph.graph(with_island):
            out_with = island(x * 2) + 1
        with accel_graph.graph(without):
            out_without = x * 2 + 1
        with_island.replay()
        if not torch.equal(out_with, torch.neg(x * 2) + 1):
            raise AssertionError("the island graph does not compute what eager does")
        a = x * 2
        times = interleaved({"with island": with_island.replay, "without": without.replay,
                             "island alone, eager": lambda: f(a)}, rounds, STEP_CALLS)
    del out_without
    overhead = times["with island"] - times["without"] - times["island alone, eager"]
    return {"replay_with_island_us": times["with island"] * 1e6,
            "replay_without_us": times["without"] * 1e6,
            "island_alone_eager_us": times["island alone, eager"] * 1e6,
            "overhead_us": overhead * 1e6, "target_us": 5.0}


def build_mixtral() -> tuple[torch.nn.Module, str | None]:
    """A tiny seeded Mixtral with the host-reading experts loop, or None and why not."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (a test dependency)"  # type: ignore[return-value]
    if int(transformers.__version__.split(".")[0]) < 5:
        return None, f"transformers {transformers.__version__}: needs 5.x"  # type: ignore[return-value]
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
        attn_implementation="eager")  # sdpa's mask shortcut reads the mask on the host
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval(), None


def moe_rows(rounds: int, compile_: bool) -> dict[str, Any]:
    """Row 2: the tiny Mixtral, eager vs replay with its experts as islands."""
    model, why = build_mixtral()
    if model is None:
        return {"status": "skipped", "reason": why}
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    for m in experts:
        accel_graph.eager_island(m)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    static, mask = ids.clone(), torch.ones_like(ids)

    def forward() -> torch.Tensor:
        # An explicit mask: without one and without a cache, transformers looks for packed
        # sequences with a host read (masking_utils.find_packed_sequence_indices).
        return model(input_ids=static, attention_mask=mask, use_cache=False).logits

    out: dict[str, Any] = {"status": "ok", "islands": len(experts), "tokens": int(ids.shape[1])}
    with torch.inference_mode():
        expected = forward()
        fns: dict[str, Callable[[], Any]] = {"eager": forward}
        g = accel_graph.Graph(device="cpu")
        with accel_graph.graph(g):
            logits = forward()
        g.replay()
        out["interpreted_bitwise_equal"] = bool(torch.equal(logits, expected))
        fns["interpreted"] = g.replay
        if compile_:
            t0 = time.perf_counter()
            gc = accel_graph.Graph(device="cpu", compile="inductor",
                                   compile_options={"replay": "compiled"})
            with accel_graph.graph(gc):
                clogits = forward()
            gc.replay()
            out["compile_s"] = time.perf_counter() - t0
            out["compiled_max_abs_diff"] = float((clogits - expected).abs().max())
            out["compiled_info"] = {k: v for k, v in gc.compile_info().items()
                                    if k in ("fallback", "segments", "stretches", "islands")}
            fns["compiled"] = gc.replay
        times = interleaved(fns, rounds, 20)
    out["eager_us"] = times["eager"] * 1e6
    for name in ("interpreted", "compiled"):
        if name in times:
            out[f"{name}_us"] = times[name] * 1e6
            out[f"{name}_x_eager"] = times[name] / times["eager"]
    out["targets_x_eager"] = {"interpreted": 0.6, "compiled": 0.35}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled replay row")
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    overhead = island_overhead(a.rounds)
    moe = moe_rows(a.rounds, not a.no_compile)
    print(f"island overhead per replay (recorder, 16 elements, {a.rounds} interleaved rounds of "
          f"{STEP_CALLS} replays, medians)")
    print(f"  replay with island {overhead['replay_with_island_us']:.2f} us | without "
          f"{overhead['replay_without_us']:.2f} us | island alone, eager "
          f"{overhead['island_alone_eager_us']:.2f} us | overhead {overhead['overhead_us']:.2f} us "
          f"(target <= 5 us)")
    if moe["status"] != "ok":
        print(f"MoE decoder: skipped ({moe['reason']})")
    else:
        print(f"tiny Mixtral, batch 1, forward over {moe['tokens']} tokens, {moe['islands']} "
              f"experts islands (medians of {a.rounds} interleaved rounds)")
        print(f"  {'variant':<12}{'us':>10}{'x eager':>10}{'target':>8}")
        print(f"  {'eager':<12}{moe['eager_us']:>10.0f}{1.0:>10.3f}")
        for name in ("interpreted", "compiled"):
            if f"{name}_us" in moe:
                print(f"  {name:<12}{moe[f'{name}_us']:>10.0f}{moe[f'{name}_x_eager']:>10.3f}"
                      f"{moe['targets_x_eager'][name]:>8.2f}")
        print(f"  interpreted bitwise equal to eager: {moe['interpreted_bitwise_equal']}"
              + (f"; compiled max |diff| {moe['compiled_max_abs_diff']:.2e}, compile "
                 f"{moe['compile_s']:.1f} s, {moe['compiled_info']}" if "compile_s" in moe else ""))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "tool": "tools/bench_islands.py", "rounds": a.rounds,
            "hardware": {"nproc": os.cpu_count(), "python": platform.python_version(),
                         "torch": torch.__version__, "threads": torch.get_num_threads(),
                         "loadavg": os.getloadavg()},
            "island_overhead": overhead, "moe": moe}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
