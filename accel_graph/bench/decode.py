"""The decode-step benchmark behind ``accel-graph bench``.

One process, one model, one thread (by default): the bundled decoder's decode step at each batch
size, run three ways and timed interleaved (see :mod:`accel_graph.bench.timing`):

- ``eager``: ``model.decode_step`` under ``torch.inference_mode()``, the baseline;
- ``replay``: the same step captured once with ``accel_graph.graph`` on the CPU recorder, timed
  as ``g.replay()`` (static inputs, no copies);
- ``compile``: ``torch.compile(model.decode_step, fullgraph=True, dynamic=False)``, compile time
  reported separately and not counted.

A variant that cannot run here (no recorder yet, no C++ compiler, ...) is reported with its
status and reason and no numbers; nothing is ever estimated. The report is a JSON-ready dict
whose schema is :data:`SCHEMA_VERSION` and is documented in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from time import perf_counter
from typing import Any

import torch

from ..models import Decoder, DecoderConfig
from .timing import (
    count_allocations,
    hardware_info,
    interleaved_samples,
    load_avg,
    summarize_ns,
)
from .variant_facts import (
    UNAVAILABLE,
    fxgraph_counters,
    graph_bytes,
    ops_per_graph,
    pool_reserved,
    reason,
)

__all__ = [
    "SCHEMA_VERSION",
    "VARIANTS",
    "DecodeBenchSettings",
    "prepare_decoder",
    "run_decode_bench",
]

#: Version of the report layout; bump it when a key changes meaning or disappears.
SCHEMA_VERSION = 1
VARIANTS = ("eager", "replay", "replay_compiled", "compile")


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What to run. ``iters`` timed calls per variant and batch (rounded up to whole rounds),
    taken in rounds of ``calls_per_round`` after ``warmup`` untimed calls; ``alloc_calls`` profiled calls per
    variant for the allocation count; ``prompt_len`` cache entries filled before timing."""

    batches: tuple[int, ...] = (1, 8)
    iters: int = 1000
    warmup: int = 20
    calls_per_round: int = 10
    threads: int = 1
    compile: bool = True
    alloc_calls: int = 20
    prompt_len: int = 16
    model: DecoderConfig = field(default_factory=DecoderConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        cfg = self.model
        if not self.batches:
            raise ValueError("no batch sizes given")
        if len(set(self.batches)) != len(self.batches):
            raise ValueError(f"batch sizes repeat: {list(self.batches)}")
        for b in self.batches:
            if not 1 <= b <= cfg.max_batch:
                raise ValueError(f"batch {b} is outside 1..{cfg.max_batch} (the model's max_batch)")
        for name in ("iters", "calls_per_round", "threads", "alloc_calls", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.prompt_len + cfg.max_batch > cfg.max_seq:
            raise ValueError(
                f"prompt_len {self.prompt_len} leaves no room in max_seq={cfg.max_seq}"
            )




def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())






def _capture(
    model: Decoder, tokens: torch.Tensor, positions: torch.Tensor, compile: str | None = None
) -> tuple[Any, torch.Tensor, float]:
    """One capture of the decode step into a fresh CPU graph: ``(graph, output, seconds)``.

    With ``compile="inductor"`` the seconds include the compilation at instantiation."""
    from ..graphs.graph import Graph, graph

    # The replay_compiled variant measures the compiled program: "auto" would keep the
    # interpreted one wherever it timed faster, and the row would measure that instead.
    g = Graph(device="cpu", compile=compile,
              compile_options={"replay": "compiled"} if compile else None)
    t0 = perf_counter()
    with graph(g):
        out = model.decode_step(tokens, positions)
    return g, out, perf_counter() - t0




def _setup_replay(
    model: Decoder,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    ref: torch.Tensor,
    compile: str | None = None,
) -> tuple[Callable[[], object] | None, dict[str, Any]]:
    """Capture the decode step on the CPU recorder. Returns ``(g.replay, info)`` or
    ``(None, info)`` with the status and reason when capture is not possible here.

    Captures twice: the first capture (``first_capture_ms``) also pays one-time costs (imports,
    per-op caches); the second, into a fresh graph, is the one timed as ``capture_ms`` and
    replayed.
    """
    info: dict[str, Any] = {
        "status": "ok",
        "reason": None,
        "capture_ms": None,
        "first_capture_ms": None,
        "ops_per_graph": None,
        "graph_memory_bytes": None,
        "standalone_bytes": None,
        "pool_reserved_bytes": None,
        "compiled": None,
        "bitwise_equal_to_eager": None,
        "max_abs_diff_vs_eager": None,
    }
    try:
        with torch.inference_mode():
            model.decode_step(tokens, positions)  # eager warm-up, as before a CUDA capture
            first, first_out, first_s = _capture(model, tokens, positions, compile)
            first.reset()
            del first, first_out
            g, out, capture_s = _capture(model, tokens, positions, compile)
            g.replay()
    except UNAVAILABLE as exc:
        info.update(status="unavailable", reason=reason(exc))
        return None, info
    except Exception as exc:  # a broken backend must not take the other variants down
        info.update(status="failed", reason=reason(exc))
        return None, info
    info.update(
        capture_ms=capture_s * 1e3,
        first_capture_ms=first_s * 1e3,
        ops_per_graph=ops_per_graph(g),
        graph_memory_bytes=graph_bytes(g, "memory_bytes"),
        standalone_bytes=graph_bytes(g, "standalone_bytes"),
        pool_reserved_bytes=pool_reserved(g),
        compiled=g.compile_info(),
        bitwise_equal_to_eager=bool(torch.equal(out, ref)),
        max_abs_diff_vs_eager=_max_abs_diff(out, ref),
    )
    info["_graph"], info["_out"] = g, out  # kept alive for timing; stripped from the report
    return g.replay, info






def _setup_compile(
    model: Decoder, tokens: torch.Tensor, positions: torch.Tensor, ref: torch.Tensor
) -> tuple[Callable[[], object] | None, dict[str, Any]]:
    """torch.compile the decode step for this batch size and run it once (the compile)."""
    info: dict[str, Any] = {
        "status": "ok",
        "reason": None,
        "compile_s": None,
        "fxgraph_cache": None,
        "max_abs_diff_vs_eager": None,
    }
    before = fxgraph_counters()
    try:
        compiled = torch.compile(model.decode_step, fullgraph=True, dynamic=False)
        t0 = perf_counter()
        with torch.inference_mode():
            out = compiled(tokens, positions)
        compile_s = perf_counter() - t0
    except Exception as exc:  # no compiler, unsupported op, ...: say why and carry on
        info.update(status="failed", reason=reason(exc))
        return None, info
    after = fxgraph_counters()
    info.update(
        compile_s=compile_s,
        fxgraph_cache={k: after[k] - before.get(k, 0) for k in after} or None,
        max_abs_diff_vs_eager=_max_abs_diff(out, ref),
    )
    return (lambda: compiled(tokens, positions)), info


def _row(variant: str, batch: int, status: str, reason: str | None) -> dict[str, Any]:
    return {
        "variant": variant,
        "batch": batch,
        "status": status,
        "reason": reason,
        "median_us": None,
        "p10_us": None,
        "p90_us": None,
        "samples": 0,
        "ratio_vs_eager": None,
        "ratio_vs_torch_compile": None,
        "allocs_per_call": None,
        "max_abs_diff_vs_eager": None,
    }


def run_decode_bench(settings: DecodeBenchSettings | None = None) -> dict[str, Any]:
    """Run the benchmark and return the report (see ``docs/benchmarks.md`` for the schema).

    Sets torch's intra-op thread count to ``settings.threads`` for the run and restores it after.
    """
    s = settings or DecodeBenchSettings()
    s.validate()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        return _run(s)
    finally:
        torch.set_num_threads(prev_threads)


def prepare_decoder(
    cfg: DecoderConfig, prompt_len: int
) -> tuple[Decoder, torch.Tensor, torch.Tensor]:
    """The benchmark's decoder state: ``(model, tokens, positions)`` for ``max_batch`` rows.

    The model is built from ``cfg`` and every row's cache is prefilled with ``prompt_len``
    tokens (from a local generator seeded ``cfg.seed + 1``). Row i then decodes ``tokens[i]`` at
    position ``prompt_len + i``; a batch-b step uses the first b rows (slice and clone). Row i
    gets the same token and position at every batch size, so all variants and batch sizes
    write identical values into the shared cache and the state stays fixed while timing.
    """
    model = Decoder(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (cfg.max_batch, prompt_len), generator=gen)
    base_tokens = torch.randint(0, cfg.vocab_size, (cfg.max_batch,), generator=gen)
    base_pos = prompt_len + torch.arange(cfg.max_batch)
    with torch.inference_mode():
        model.prefill(prompt)
    return model, base_tokens, base_pos


def _run(s: DecodeBenchSettings) -> dict[str, Any]:
    load_start = load_avg()
    cfg = s.model
    model, base_tokens, base_pos = prepare_decoder(cfg, s.prompt_len)

    fns: dict[str, Callable[[], object]] = {}
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    captures: list[dict[str, Any]] = []
    compiles: list[dict[str, Any]] = []
    refs: list[torch.Tensor] = []
    for b in s.batches:
        tokens, positions = base_tokens[:b].clone(), base_pos[:b].clone()
        with torch.inference_mode():
            ref = model.decode_step(tokens, positions).clone()
        refs.append(ref)
        fns[f"eager@{b}"] = lambda t=tokens, p=positions: model.decode_step(t, p)
        rows[("eager", b)] = _row("eager", b, "ok", None)
        rows[("eager", b)]["max_abs_diff_vs_eager"] = 0.0

        fn, cap = _setup_replay(model, tokens, positions, ref)
        rows[("replay", b)] = _row("replay", b, cap["status"], cap["reason"])
        rows[("replay", b)]["max_abs_diff_vs_eager"] = cap["max_abs_diff_vs_eager"]
        if fn is not None:
            fns[f"replay@{b}"] = fn
        captures.append({"batch": b, "compile": None, **cap})

        if s.compile:
            fn, ccap = _setup_replay(model, tokens, positions, ref, compile="inductor")
        else:
            fn, ccap = None, {"status": "skipped", "reason": "--no-compile",
                              "max_abs_diff_vs_eager": None}
        rows[("replay_compiled", b)] = _row("replay_compiled", b, ccap["status"], ccap["reason"])
        rows[("replay_compiled", b)]["max_abs_diff_vs_eager"] = ccap["max_abs_diff_vs_eager"]
        if fn is not None:
            fns[f"replay_compiled@{b}"] = fn
            captures.append({"batch": b, "compile": "inductor", **ccap})

        if s.compile:
            fn, comp = _setup_compile(model, tokens, positions, ref)
        else:
            fn, comp = (
                None,
                {
                    "status": "skipped",
                    "reason": "--no-compile",
                    "compile_s": None,
                    "fxgraph_cache": None,
                    "max_abs_diff_vs_eager": None,
                },
            )
        rows[("compile", b)] = _row("compile", b, comp["status"], comp["reason"])
        rows[("compile", b)]["max_abs_diff_vs_eager"] = comp["max_abs_diff_vs_eager"]
        if fn is not None:
            fns[f"compile@{b}"] = fn
        compiles.append({"batch": b, **comp})

    per_round = min(s.calls_per_round, s.iters)
    rounds = math.ceil(s.iters / per_round)
    with torch.inference_mode():
        samples = interleaved_samples(
            fns, rounds=rounds, calls_per_round=per_round, warmup=s.warmup
        )
        allocs = {key: count_allocations(fn, s.alloc_calls) for key, fn in fns.items()}
        # Replay must still agree with eager after thousands of interleaved calls on one cache.
        by_batch = dict(zip(s.batches, refs, strict=True))
        for cap in captures:
            if cap["status"] == "ok":
                ref = by_batch[cap["batch"]]
                cap["_graph"].replay()
                cap["bitwise_equal_to_eager"] &= bool(torch.equal(cap["_out"], ref))
                cap["max_abs_diff_vs_eager"] = max(
                    cap["max_abs_diff_vs_eager"] or 0.0, _max_abs_diff(cap["_out"], ref)
                )

    for key, values in samples.items():
        variant, b = key.split("@")
        row = rows[(variant, int(b))]
        row.update(summarize_ns(values))
        row["allocs_per_call"] = allocs[key]
    for (variant, b), row in rows.items():
        eager = rows[("eager", b)]["median_us"]
        if row["median_us"] is not None and eager:
            row["ratio_vs_eager"] = row["median_us"] / eager
        compiled = rows[("compile", b)]["median_us"]
        if variant == "replay_compiled" and row["median_us"] is not None and compiled:
            row["ratio_vs_torch_compile"] = row["median_us"] / compiled
    for cap in captures:
        eager = rows[("eager", cap["batch"])]["median_us"]
        cap["capture_vs_eager_call"] = (
            cap["capture_ms"] * 1e3 / eager if cap["capture_ms"] is not None and eager else None
        )
        cap.pop("_graph", None)
        cap.pop("_out", None)

    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "accel-graph bench",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info(),
        "load_avg": {"start": load_start, "end": load_avg()},
        "model": {
            "name": "accel_graph.models.Decoder",
            **cfg.as_dict(),
            "parameters": model.num_parameters(),
        },
        "settings": {k: v for k, v in asdict(s).items() if k != "model"}
        | {"rounds": rounds, "calls_per_round": per_round, "batches": list(s.batches)},
        "rows": [rows[(v, b)] for b in s.batches for v in VARIANTS],
        "capture": {"backend": "recorder", "device": "cpu", "batches": captures},
        "compile": {
            "backend": "inductor",
            "mode": "default",
            "fullgraph": True,
            "dynamic": False,
            "batches": compiles,
        },
    }
