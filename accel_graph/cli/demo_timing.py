"""The timings of ``accel-graph demo``: each measured interleaved, by medians.

Contract: every function takes the demo's decoder and its captured :class:`~accel_graph.GraphRunner`
(capture done, under ``torch.inference_mode()``) and returns one JSON-ready section of the demo
report (schema ``accel_graph.demo/1``, docs/runner.md): :func:`bucket_timings` the per-bucket
step (runner call vs eager) and the runner's overhead per call, :func:`batch1_decode` greedy
decoding of one sequence both ways, :func:`multistep_decode` many tokens from one replay of a
``torch.while_loop`` graph. The served stream and the token check are in
:mod:`accel_graph.cli.demo`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["batch1_decode", "bucket_timings", "multistep_decode"]


def batch1_decode(model: Any, runner: Any, new_tokens: int, rounds: int) -> dict[str, Any]:
    """Greedy decoding of one sequence, eager vs through the runner, interleaved generation by
    generation; tokens/s from the median generation time."""
    from ..bench.timing import interleaved_samples
    from ..models import greedy_generate

    prompt = torch.arange(4, dtype=torch.int64).unsqueeze(0)
    variants = {
        "eager": lambda: greedy_generate(model, prompt, new_tokens),
        "graph": lambda: greedy_generate(model, prompt, new_tokens, step=runner),
    }
    s = interleaved_samples(variants, rounds=rounds, calls_per_round=1, warmup=1)
    med = {k: sorted(v)[len(v) // 2] / 1e9 for k, v in s.items()}
    return {
        "batch": 1, "new_tokens": new_tokens, "rounds": rounds,
        "eager_tokens_per_s": new_tokens / med["eager"],
        "graph_tokens_per_s": new_tokens / med["graph"],
        "speedup": med["eager"] / med["graph"],
    }


def multistep_decode(model: Any, runner: Any, new_tokens: int, rounds: int,
                     compile: str | None = None) -> dict[str, Any]:
    """Batch 1: ``new_tokens`` greedy tokens from one replay of a graph of
    ``Decoder.decode_steps`` (a ``torch.while_loop``; replayed as ``compile`` says, like the
    runner's graphs: compiled, its predicate and body are Inductor programs and the loop runs on
    the host) beside the runner's one-step replays; tokens checked against eager."""
    from .. import Graph, graph
    from ..bench.timing import interleaved_samples
    from ..models import greedy_generate

    prompt = torch.arange(4, dtype=torch.int64).unsqueeze(0)
    t = prompt.shape[1]
    tok, pos = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    g = Graph(device=prompt.device, compile=compile)
    with graph(g):
        out, count = model.decode_steps(tok, pos, steps=new_tokens)

    def multi() -> torch.Tensor:
        model.reset_cache()
        for i in range(t - 1):  # the prompt, one step at a time (as greedy_generate does)
            runner(prompt[:, i].contiguous(), torch.full((1,), i, dtype=torch.int64))
        tok.copy_(prompt[:, t - 1])
        pos.fill_(t - 1)
        g.replay()
        return torch.cat([prompt, out], dim=1)

    eager = greedy_generate(model, prompt, new_tokens)
    equal = bool(torch.equal(multi(), eager)) and int(count) == new_tokens
    s = interleaved_samples({"one_step": lambda: greedy_generate(model, prompt, new_tokens, step=runner),
                             "multi_step": multi}, rounds=rounds, calls_per_round=1, warmup=1)
    med = {k: sorted(v)[len(v) // 2] / 1e9 for k, v in s.items()}
    return {"batch": 1, "new_tokens": new_tokens, "rounds": rounds, "tokens_equal_eager": equal,
            "one_step_tokens_per_s": new_tokens / med["one_step"],
            "multi_step_tokens_per_s": new_tokens / med["multi_step"],
            "multi_vs_one_step": med["one_step"] / med["multi_step"]}


def bucket_timings(
    model: Any, runner: Any, buckets: list[int], iters: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-bucket step medians (runner call vs eager) and the runner overhead at batch 1."""
    from .. import GraphRunner
    from ..bench.timing import interleaved_samples, summarize_ns

    per_round = 10
    rounds = max(1, iters // per_round)
    rows = []
    cfg = model.config
    for b in buckets:
        tok = torch.arange(b, dtype=torch.int64) % cfg.vocab_size
        pos = torch.full((b,), 8, dtype=torch.int64)
        variants = {"eager": lambda tok=tok, pos=pos: model.decode_step(tok, pos),
                    "graph": lambda tok=tok, pos=pos: runner(tok, pos)}
        s = interleaved_samples(variants, rounds=rounds, calls_per_round=per_round, warmup=3)
        e, g = summarize_ns(s["eager"])["median_us"], summarize_ns(s["graph"])["median_us"]
        rows.append({"bucket": b, "eager_step_us": e, "graph_step_us": g, "speedup": e / g})
    # Overhead: the runner's pad/copy/replay/slice minus a bare replay of the same graph, on the
    # decoder's batch-1 graph and on a tiny step whose replay costs almost nothing (there the
    # difference is not drowned in the replay's own noise).
    overhead: dict[str, Any] = {"batch": 1}
    tok1, pos1 = torch.zeros(1, dtype=torch.int64), torch.full((1,), 8, dtype=torch.int64)
    g1 = runner.graph(buckets[0]) if buckets[0] == 1 else None
    if g1 is not None:
        s = interleaved_samples({"runner": lambda: runner(tok1, pos1), "bare": g1.replay},
                                rounds=rounds * 2, calls_per_round=per_round, warmup=3)
        r_us, b_us = summarize_ns(s["runner"])["median_us"], summarize_ns(s["bare"])["median_us"]
        overhead["decoder_runner_us"], overhead["decoder_bare_replay_us"] = r_us, b_us
        overhead["decoder_overhead_us"] = r_us - b_us
    x = torch.zeros(1, 64)
    tiny = GraphRunner(lambda v: v * 2 + 1, (x,), buckets=[1, 2], verify=False, progress=False).capture()
    gt = tiny.graph(1)
    assert gt is not None
    s = interleaved_samples({"runner": lambda: tiny(x), "bare": gt.replay},
                            rounds=max(100, rounds * 5), calls_per_round=per_round, warmup=10)
    r_us, b_us = summarize_ns(s["runner"])["median_us"], summarize_ns(s["bare"])["median_us"]
    overhead.update(tiny_runner_us=r_us, tiny_bare_replay_us=b_us, tiny_overhead_us=r_us - b_us)
    return rows, overhead
