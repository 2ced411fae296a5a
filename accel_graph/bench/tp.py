"""The tensor-parallel decoder on local CPU processes: correctness and step times.

Behind ``accel-graph demo --tp N`` and ``tools/bench_tp.py``. :func:`run_tp` spawns ``world``
processes joined in a gloo group over loopback
(:func:`accel_graph.testing.distributed.run_ranks`); each rank builds the
bundled :class:`~accel_graph.models.Decoder` from the same seed, shards it
(:class:`~accel_graph.models.TPDecoder`), and serves its decode step from a
:class:`~accel_graph.GraphRunner` with ``process_group=`` (one graph per bucket, captured on
every rank). Each rank then

1. decodes one prompt per bucket size greedily three ways (single-process model, eager TP,
   TP through the runner) and compares the tokens with the single-process model's (a difference
   counts as a near-tie only where that model's top-two logits are within float32 rounding);
   compares one step's logits (eager TP and replay TP against single-process) to the float32
   tolerance;
2. times the batch-1 step, interleaved (same seeded order on every rank, so the collectives
   pair up), medians: eager TP under ``inference_mode`` (the baseline), the runner's replay, the
   step's collectives alone (``2 * n_layers`` all-reduces of ``[1, dim]`` float32), which bounds
   what replay can save, and this rank's compute alone (the shard with its all-reduces replaced
   by the identity), eager and replayed;
3. times batch-1 greedy generation eager TP vs replay TP (median of interleaved generations).

Before spawning, the parent times the single-process model the same way (eager vs its own
runner), for reference. The report is a JSON-ready dict, schema :data:`SCHEMA`
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from ..errors import ConfigError
from ..testing.distributed import run_ranks
from .timing import hardware_info, interleaved_samples, summarize_ns
from .tokens import compare_greedy

__all__ = ["SCHEMA", "TPSettings", "run_tp", "tp_rank"]

SCHEMA = "accel_graph.tp/1"


@dataclass(frozen=True)
class TPSettings:
    """What :func:`run_tp` runs. ``iters`` timed steps per variant (in rounds of
    ``calls_per_round``, after ``warmup`` untimed calls); ``gen_rounds`` interleaved greedy
    generations of ``new_tokens`` per variant (0: none); ``compile`` is the runner's
    ``compile=`` (None: interpreted replay)."""

    world: int = 2
    buckets: tuple[int, ...] = (1, 2, 4)
    new_tokens: int = 24
    prompt_len: int = 4
    threads: int = 1
    iters: int = 200
    calls_per_round: int = 10
    warmup: int = 10
    gen_rounds: int = 5
    compile: str | None = None
    collective: str = "c10d"
    seed: int = 0
    pg_timeout_s: float = 60.0
    timeout_s: float = 900.0

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        if self.world < 2:
            raise ConfigError(f"tensor parallelism needs at least 2 ranks, got {self.world}")
        if not self.buckets or min(self.buckets) < 1 or max(self.buckets) > 64:
            raise ConfigError(f"buckets must be batch sizes in 1..64, got {list(self.buckets)}")
        for name in ("new_tokens", "prompt_len", "threads", "calls_per_round"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("iters", "warmup", "gen_rounds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prompt_len + self.new_tokens > 128:
            raise ConfigError(
                f"prompt_len + new_tokens must be <= 128 (the model's max_seq), got "
                f"{self.prompt_len + self.new_tokens}"
            )


def _model_config(s: TPSettings) -> Any:
    from ..models import DecoderConfig

    return DecoderConfig(max_batch=max(s.buckets))


def _prompts(s: TPSettings, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(s.seed)
    return [torch.randint(0, vocab, (b, s.prompt_len), generator=gen) for b in sorted(set(s.buckets))]


def _step_medians(variants: dict[str, Any], s: TPSettings) -> dict[str, float]:
    """Median microseconds per call of each variant, timed in interleaved rounds under
    inference mode (``s.iters`` calls each, ``s.calls_per_round`` in a row)."""
    rounds = max(1, -(-s.iters // s.calls_per_round))
    with torch.inference_mode():
        samples = interleaved_samples(variants, rounds=rounds, calls_per_round=s.calls_per_round,
                                      warmup=s.warmup, seed=s.seed)
    return {k: float(summarize_ns(v)["median_us"]) for k, v in samples.items()}


def _generation(variants: dict[str, Any], s: TPSettings) -> dict[str, float] | None:
    """Tokens per second of batch-1 greedy generation per variant (median generation)."""
    if not s.gen_rounds:
        return None
    t = interleaved_samples(variants, rounds=s.gen_rounds, calls_per_round=1, warmup=1, seed=s.seed)
    return {k: s.new_tokens / (sorted(v)[len(v) // 2] / 1e9) for k, v in t.items()}


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    """Stands in for a TP layer's all-reduce when only the compute is timed."""
    return x


def tp_rank(rank: int, world: int, s: TPSettings) -> dict[str, Any]:
    """One rank of :func:`run_tp` (runs inside a process of the group); returns its results."""
    import logging

    import torch.distributed as dist

    from ..foundation.tolerances import assert_close_for_dtype
    from ..models import Decoder, TPDecoder, greedy_generate
    from ..runner import GraphRunner

    logging.getLogger("accel_graph").setLevel(logging.ERROR)  # the parent reports statuses
    torch.set_num_threads(s.threads)
    cfg = _model_config(s)
    base = Decoder(cfg)
    tp = TPDecoder(base, collective=s.collective)
    example = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(tp.decode_step, example, buckets=list(s.buckets), compile=s.compile,
                         process_group=dist.group.WORLD, progress=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.capture()
    capture_s = time.perf_counter() - t0
    out: dict[str, Any] = {"rank": rank, "capture_s": capture_s}

    # 1. Correctness against the single-process model.
    check = {"eager_tp": [0, 0, []], "replay_tp": [0, 0, []]}
    for prompt in _prompts(s, cfg.vocab_size):
        logits: list[torch.Tensor] = []

        def ref_step(tok: torch.Tensor, pos: torch.Tensor, logits: list = logits) -> torch.Tensor:
            y = base.decode_step(tok, pos)
            logits.append(y)
            return y

        ref = greedy_generate(base, prompt, s.new_tokens, step=ref_step)
        got = {"eager_tp": greedy_generate(tp, prompt, s.new_tokens),
               "replay_tp": greedy_generate(tp, prompt, s.new_tokens, step=runner)}
        for name, tokens in got.items():
            c, t, bad = compare_greedy(prompt.shape[1], ref, tokens, logits)
            check[name][0] += c
            check[name][1] += t
            check[name][2] += [{"batch": prompt.shape[0], **m} for m in bad]
    out["tokens"] = {k: {"compared": v[0], "near_ties": v[1], "mismatches": v[2]} for k, v in check.items()}
    b = max(s.buckets)
    tok = torch.arange(b, dtype=torch.int64) % cfg.vocab_size
    pos = torch.zeros(b, dtype=torch.int64)
    with torch.inference_mode():
        base.reset_cache()
        tp.reset_cache()
        ref_logits = base.decode_step(tok, pos).clone()
        eager_logits = tp.decode_step(tok, pos).clone()
        tp.reset_cache()
        replay_logits = runner(tok, pos).clone()
    out["logits"] = {}
    for name, value in (("eager_tp", eager_logits), ("replay_tp", replay_logits)):
        try:
            assert_close_for_dtype(value, ref_logits, msg=f"{name} vs single-process")
            close = True
        except AssertionError:
            close = False
        out["logits"][name] = {"max_abs_diff": float((value - ref_logits).abs().max()), "close": close}

    # 2. Batch-1 step times, interleaved in the same order on every rank.
    if s.iters:
        tok1 = torch.tensor([3], dtype=torch.int64)
        pos1 = torch.tensor([s.prompt_len], dtype=torch.int64)
        partials = [torch.zeros(1, cfg.dim) for _ in range(2 * cfg.n_layers)]

        def collectives_only() -> None:
            for t in partials:
                dist.all_reduce(t)

        # This rank's share of the step without its all-reduces (a copy of the shard whose
        # reduce is the identity: wrong logits, right compute), eager and replayed, to split the
        # step into compute and communication. Timing only; never compared.
        local = TPDecoder(base, rank=rank, world_size=world)
        for layer in local.layers:
            layer.reduce = _no_reduce
        local_runner = GraphRunner(local.decode_step, example, buckets=[1], compile=s.compile,
                                   verify=False, progress=False)
        with torch.inference_mode():
            local_runner.capture()
        variants = {"eager_tp": lambda: tp.decode_step(tok1, pos1),
                    "replay_tp": lambda: runner(tok1, pos1),
                    "allreduce_only": collectives_only,
                    "eager_compute_only": lambda: local.decode_step(tok1, pos1),
                    "replay_compute_only": lambda: local_runner(tok1, pos1)}
        out["step_us"] = _step_medians(variants, s)
    # 3. Greedy generation at batch 1, eager TP vs replay TP.
    prompt1 = torch.arange(s.prompt_len, dtype=torch.int64).unsqueeze(0)
    out["tokens_per_s"] = _generation({
        "eager_tp": lambda: greedy_generate(tp, prompt1, s.new_tokens),
        "replay_tp": lambda: greedy_generate(tp, prompt1, s.new_tokens, step=runner),
    }, s)
    out["buckets"] = [{"bucket": m.size, "status": m.status, "reason": m.reason,
                       "capture_ms": m.capture_ms} for m in runner.runtime.buckets]
    out["eager_calls"] = runner.stats()["eager_calls"]
    return out


def _single_reference(s: TPSettings) -> dict[str, Any]:
    """The single-process model at batch 1, eager vs its own runner (no process group)."""
    from ..models import Decoder, greedy_generate
    from ..runner import GraphRunner

    saved = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        model = Decoder(_model_config(s))
        example = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        runner = GraphRunner(model.decode_step, example, buckets=[1], compile=s.compile, progress=False)
        with torch.inference_mode():
            runner.capture()
        tok1 = torch.tensor([3], dtype=torch.int64)
        pos1 = torch.tensor([s.prompt_len], dtype=torch.int64)
        out: dict[str, Any] = {}
        if s.iters:
            out["step_us"] = _step_medians(
                {"eager": lambda: model.decode_step(tok1, pos1), "replay": lambda: runner(tok1, pos1)}, s)
        prompt1 = torch.arange(s.prompt_len, dtype=torch.int64).unsqueeze(0)
        out["tokens_per_s"] = _generation({
            "eager": lambda: greedy_generate(model, prompt1, s.new_tokens),
            "replay": lambda: greedy_generate(model, prompt1, s.new_tokens, step=runner),
        }, s)
        return out
    finally:
        torch.set_num_threads(saved)


def run_tp(s: TPSettings) -> dict[str, Any]:
    """Run the TP check and timings (see the module docstring); return the report."""
    s.validate()
    t_start = time.perf_counter()
    single = _single_reference(s)
    t0 = time.perf_counter()
    ranks = run_ranks(tp_rank, s.world, args=(s,), timeout=s.timeout_s, pg_timeout=s.pg_timeout_s)
    group_s = time.perf_counter() - t0
    # Every rank must agree (replicated logits); rank 0's numbers are the report's.
    ok = all(not r["tokens"][k]["mismatches"] and r["logits"][k]["close"]
             for r in ranks for k in ("eager_tp", "replay_tp"))
    same_buckets = all(
        [b["status"] == "captured" for b in r["buckets"]] == [b["status"] == "captured" for b in ranks[0]["buckets"]]
        for r in ranks)
    r0 = ranks[0]
    step = r0.get("step_us")
    ratio = step["replay_tp"] / step["eager_tp"] if step else None
    cfg = _model_config(s)
    return {
        "schema": SCHEMA,
        "tool": "accel_graph.bench.tp",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info() | {"threads": s.threads},
        "model": {"name": "accel_graph.models.TPDecoder", **cfg.as_dict()},
        "settings": asdict(s) | {"buckets": list(s.buckets)},
        "check": {"ok": ok and same_buckets, "same_buckets_on_every_rank": same_buckets},
        "step_us": step,
        "replay_over_eager": ratio,
        "single_process": single,
        "ranks": ranks,
        "group_wall_s": group_s,
        "wall_s": time.perf_counter() - t_start,
    }
