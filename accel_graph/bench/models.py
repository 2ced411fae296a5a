"""The model benchmark behind ``accel-graph bench --models``: five ways to run a step, per model.

For every workload (a model at one batch size: the bundled decoder's decode step at batch 1 and
8, the bundled :class:`~accel_graph.models.resnet.ResNet` forward at batch 1 and 4, and the
bundled decoder with a mixture-of-experts MLP (``moe``: ``DecoderConfig(num_experts=8,
top_k=2)``, HF's host-reading experts loop marked as an eager island) at batch 1) and in one
process, on ``threads`` torch threads (1 by default):

- ``eager``: the step under ``torch.inference_mode()``, the baseline;
- ``replay``: the step captured once into ``Graph(device="cpu")`` (interpreted replay), timed
  as ``g.replay()`` on static inputs;
- ``replay_compiled``: the same with ``Graph(compile="inductor")``;
- ``compile``: ``torch.compile(step, fullgraph=True, dynamic=False)`` (default mode);
- ``compile_max_autotune``: the same with ``mode="max-autotune-no-cudagraphs"``.

A workload's variants are timed interleaved (:func:`~accel_graph.bench.timing.interleaved_samples`:
rounds of ``calls_per_round`` calls per variant, order shuffled per round), medians and
percentiles per call, never means. The number of rounds is the smaller of ``iters`` and what fits
``seconds`` per workload, from one probe call of each variant. Compile and capture costs are
reported separately and never counted in the per-call numbers. Every output is compared with
eager's within the per-dtype tolerance of :mod:`accel_graph.foundation.tolerances` (interpreted replay
must also be bitwise equal) after timing. A variant that cannot be built is a row with a
``status`` and ``reason`` and no numbers; nothing is estimated. Schema: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from time import perf_counter
from typing import Any

import torch

from ..foundation.tolerances import tolerance_for
from ..models import DecoderConfig, ResNet, ResNetConfig
from .decode import prepare_decoder
from .timing import hardware_info, interleaved_samples, load_avg, summarize_ns
from .variant_facts import UNAVAILABLE, counter_delta, fxgraph_counters, reason, replay_mode

__all__ = [
    "MODELS",
    "MODEL_VARIANTS",
    "MODELS_SCHEMA",
    "ModelBenchSettings",
    "run_models_bench",
]

#: The report's schema name; the version changes when a key changes meaning or disappears.
MODELS_SCHEMA = "accel_graph.bench.models/1"
#: The workloads' models, in the order they run.
MODELS = ("decoder", "resnet", "moe")
MODEL_VARIANTS = ("eager", "replay", "replay_compiled", "compile", "compile_max_autotune")
_COMPILE_MODES = {"compile": "default", "compile_max_autotune": "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class ModelBenchSettings:
    """What to run. ``models`` from :data:`MODELS`; per workload at most ``iters``
    timed calls per variant (whole rounds of ``calls_per_round``), fewer when ``seconds`` of
    timed calls per workload would be exceeded; ``warmup`` untimed calls per variant first.
    ``compile=False`` skips the three compiled variants, ``autotune=False`` only max-autotune."""

    models: tuple[str, ...] = MODELS
    decoder_batches: tuple[int, ...] = (1, 8)
    resnet_batches: tuple[int, ...] = (1, 4)
    moe_batches: tuple[int, ...] = (1,)
    iters: int = 300
    seconds: float = 8.0
    warmup: int = 5
    calls_per_round: int = 5
    threads: int = 1
    compile: bool = True
    autotune: bool = True
    prompt_len: int = 16
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    resnet: ResNetConfig = field(default_factory=ResNetConfig)
    #: The ``moe`` workload's decoder: the default decoder with 8 experts, 2 per token.
    moe: DecoderConfig = field(default_factory=lambda: DecoderConfig(num_experts=8, top_k=2))

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        unknown = set(self.models) - set(MODELS)
        if not self.models or unknown:
            raise ValueError(f"models must be from {', '.join(MODELS)}; got {list(self.models)}")
        if "moe" in self.models and not self.moe.num_experts:
            raise ValueError("the moe workload needs a config with num_experts > 0")
        for name, batches, top in (("decoder_batches", self.decoder_batches, self.decoder.max_batch),
                                   ("resnet_batches", self.resnet_batches, None),
                                   ("moe_batches", self.moe_batches, self.moe.max_batch)):
            if not batches or len(set(batches)) != len(batches):
                raise ValueError(f"{name} must be non-empty without repeats, got {list(batches)}")
            if any(b < 1 or (top is not None and b > top) for b in batches):
                raise ValueError(f"{name} {list(batches)}: each must be in 1..{top or 'any'}")
        for name in ("iters", "calls_per_round", "threads", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or not self.seconds > 0:
            raise ValueError(f"warmup must be >= 0 and seconds > 0, got {self.warmup}, {self.seconds}")
        for cfg in (self.decoder, self.moe):
            if self.prompt_len + cfg.max_batch > cfg.max_seq:
                raise ValueError(f"prompt_len {self.prompt_len} leaves no room in max_seq")


@dataclass
class _Workload:
    """One model at one batch size: ``target(*args)`` is the step, ``ref`` eager's output."""

    model: str
    batch: int
    target: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    ref: torch.Tensor




def _compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool, bool]:
    """``(max |out - ref|, within the dtype's tolerance, bitwise equal)``."""
    tol = tolerance_for(ref.dtype)
    diff = float((out.double() - ref.double()).abs().max()) if out.numel() else 0.0
    close = out.shape == ref.shape and bool(torch.allclose(out, ref, rtol=tol.rtol, atol=tol.atol))
    return diff, close, bool(torch.equal(out, ref))








def _setup_replay(w: _Workload, compile: str | None, row: dict[str, Any]) -> Callable[[], object] | None:
    """Capture the step (compiled at instantiation with ``compile``); fill ``row``'s setup keys.
    Returns the timed callable (``g.replay``), or None with ``row`` saying why."""
    from ..graphs.graph import Graph, graph

    before = fxgraph_counters()
    try:
        w.target(*w.args)  # eager warm-up, as before a CUDA capture
        g = Graph(device="cpu", compile=compile)
        t0 = perf_counter()
        with graph(g):
            out = w.target(*w.args)
        row["capture_s"] = perf_counter() - t0
        g.replay()
    except UNAVAILABLE as exc:
        row.update(status="unavailable", reason=reason(exc))
        return None
    except Exception as exc:  # one broken variant must not take the others down
        row.update(status="failed", reason=reason(exc))
        return None
    info_fn = getattr(g, "compile_info", None)
    info = info_fn() if callable(info_fn) else None
    if info:
        row["compile_s"] = info.get("compile_s")
        row["compile_cache"] = info.get("cache")
        if info.get("fallback"):
            row["note"] = f"compile fell back to interpreted replay: {info['fallback']}"
    if compile is not None:
        row["fxgraph_cache"] = counter_delta(before)
    row["replay_mode"] = replay_mode(g)
    row["_read"], row["_keep"] = (lambda: out), g
    return g.replay


def _setup_compile(w: _Workload, mode: str, row: dict[str, Any]) -> Callable[[], object] | None:
    """``torch.compile`` the step in ``mode`` and run it once (the compile, timed)."""
    before = fxgraph_counters()
    try:
        fn = torch.compile(w.target, fullgraph=True, dynamic=False, mode=mode)
        t0 = perf_counter()
        fn(*w.args)
        row["compile_s"] = perf_counter() - t0
    except Exception as exc:  # no compiler, an unsupported op, ...: say why and carry on
        row.update(status="failed", reason=reason(exc))
        return None
    row["fxgraph_cache"] = counter_delta(before)
    last: list[torch.Tensor] = []

    def call() -> None:
        last[:] = [fn(*w.args)]

    call()
    row["_read"] = lambda: last[0]
    return call


def _warm_inductor() -> dict[str, Any]:
    """Pay Inductor's once-per-process costs (its imports, torch's source hash, the vector-ISA
    probe build, compiler probes) on a tiny function before any measured compile, so each
    variant's ``compile_s`` is its own and not the first variant's alone."""
    t0 = perf_counter()
    try:
        fn = torch.compile(lambda x: x * 2 + 1, fullgraph=True, dynamic=False)
        fn(torch.ones(8))
    except Exception as exc:  # the compiled variants will say why in their rows
        return {"status": "failed", "reason": reason(exc), "seconds": perf_counter() - t0}
    return {"status": "ok", "reason": None, "seconds": perf_counter() - t0}


def _row(w: _Workload, variant: str) -> dict[str, Any]:
    return {
        "model": w.model, "batch": w.batch, "variant": variant, "status": "ok", "reason": None,
        "median_us": None, "p10_us": None, "p90_us": None, "samples": 0,
        "ratio_vs_eager": None, "ratio_vs_torch_compile": None,
        "capture_s": None, "compile_s": None, "compile_cache": None, "fxgraph_cache": None,
        "replay_mode": None, "max_abs_diff_vs_eager": None, "matches_eager": None,
        "bitwise_equal_to_eager": None, "note": None,
    }


def _bench_workload(w: _Workload, s: ModelBenchSettings) -> tuple[list[dict[str, Any]], int]:
    """Set up, time (interleaved) and check every variant of one workload. Returns the rows
    (in :data:`MODEL_VARIANTS` order) and the rounds timed."""
    rows = {v: _row(w, v) for v in MODEL_VARIANTS}
    fns: dict[str, Callable[[], object]] = {}
    last: list[torch.Tensor] = []

    def eager() -> None:
        last[:] = [w.target(*w.args)]

    fns["eager"] = eager
    rows["eager"]["_read"] = lambda: last[0]
    for variant in MODEL_VARIANTS[1:]:
        row = rows[variant]
        if variant != "replay" and not s.compile:
            row.update(status="skipped", reason="--no-compile")
            continue
        if variant == "compile_max_autotune" and not s.autotune:
            row.update(status="skipped", reason="--no-autotune")
            continue
        if variant.startswith("replay"):
            fn = _setup_replay(w, "inductor" if variant == "replay_compiled" else None, row)
        else:
            fn = _setup_compile(w, _COMPILE_MODES[variant], row)
        if fn is not None:
            fns[variant] = fn

    # Rounds: at most ``iters`` calls per variant, and what fits ``seconds`` by one probe each.
    per_round = min(s.calls_per_round, s.iters)
    probe = 0.0
    for fn in fns.values():
        fn()
        t0 = perf_counter()
        fn()
        probe += perf_counter() - t0
    by_time = int(s.seconds / max(probe * per_round, 1e-9))
    rounds = max(1, min(math.ceil(s.iters / per_round), by_time))
    samples = interleaved_samples(fns, rounds=rounds, calls_per_round=per_round, warmup=s.warmup)

    for variant, fn in fns.items():
        row = rows[variant]
        row.update(summarize_ns(samples[variant]))
        fn()  # outputs compared after thousands of interleaved calls on shared state
        diff, close, bitwise = _compare(row["_read"](), w.ref)
        if "_keep" in row:  # after the timed calls: replay="auto" may decide on real replays
            row["replay_mode"] = replay_mode(row["_keep"])
        row.update(max_abs_diff_vs_eager=diff, matches_eager=close, bitwise_equal_to_eager=bitwise)
        if variant == "replay" and not bitwise:  # interpreted replay runs eager's kernels
            row["matches_eager"] = False
    eager_us, compile_us = rows["eager"]["median_us"], rows["compile"]["median_us"]
    for row in rows.values():
        row.pop("_read", None)
        row.pop("_keep", None)
        if row["median_us"] is not None:
            row["ratio_vs_eager"] = row["median_us"] / eager_us if eager_us else None
            row["ratio_vs_torch_compile"] = row["median_us"] / compile_us if compile_us else None
    return [rows[v] for v in MODEL_VARIANTS], rounds


def _workloads(s: ModelBenchSettings) -> list[tuple[str, dict[str, Any], Callable[[], list[_Workload]]]]:
    """Per model: its name, its description for the report, and a builder of its workloads
    (built lazily, one model at a time, so only one model's state is alive while timing)."""
    out: list[tuple[str, dict[str, Any], Callable[[], list[_Workload]]]] = []

    def decoder(name: str, cfg: DecoderConfig, batches: tuple[int, ...]) -> Callable[[], list[_Workload]]:
        def build() -> list[_Workload]:
            model, tokens, pos = prepare_decoder(cfg, s.prompt_len)
            ws = []
            for b in batches:
                args = (tokens[:b].clone(), pos[:b].clone())
                ws.append(_Workload(name, b, model.decode_step, args, model.decode_step(*args).clone()))
            return ws

        return build

    if "decoder" in s.models:
        desc = {"name": "accel_graph.models.Decoder", "step": "decode_step", **s.decoder.as_dict()}
        out.append(("decoder", desc, decoder("decoder", s.decoder, s.decoder_batches)))
    if "resnet" in s.models:
        def resnet() -> list[_Workload]:
            model = ResNet(s.resnet)
            ws = []
            for b in s.resnet_batches:
                x = model.example_input(b)
                ws.append(_Workload("resnet", b, model, (x,), model(x).clone()))
            return ws

        desc = {"name": "accel_graph.models.ResNet", "step": "forward", **s.resnet.as_dict(),
                "parameters": ResNet(s.resnet).num_parameters()}
        out.append(("resnet", desc, resnet))
    if "moe" in s.models:
        # The same decode step; its experts (an eager island) run eagerly inside every replay.
        desc = {"name": "accel_graph.models.Decoder", "step": "decode_step", **s.moe.as_dict(),
                "islands": "layers.<i>.moe.experts (HF-style host-reading experts loop)"}
        out.append(("moe", desc, decoder("moe", s.moe, s.moe_batches)))
    return out


def run_models_bench(settings: ModelBenchSettings | None = None) -> dict[str, Any]:
    """Run the model benchmark and return its JSON-ready report (``docs/benchmarks.md``).

    Sets torch's intra-op threads to ``settings.threads`` for the run and restores them after.
    Everything runs under ``torch.inference_mode()``, eager included.
    """
    s = settings or ModelBenchSettings()
    s.validate()
    prev = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    start, t0 = load_avg(), perf_counter()
    rows: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    rounds: dict[str, int] = {}
    warmup: dict[str, Any] | None = None
    try:
        with torch.inference_mode():
            if s.compile:
                warmup = _warm_inductor()
            for name, desc, build in _workloads(s):
                models[name] = desc
                for w in build():
                    w_rows, rounds[f"{w.model}@{w.batch}"] = _bench_workload(w, s)
                    rows.extend(w_rows)
    finally:
        torch.set_num_threads(prev)
    return {
        "schema": MODELS_SCHEMA,
        "tool": "accel-graph bench --models",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_info() | {"threads": s.threads},
        "load_avg": {"start": start, "end": load_avg()},
        "wall_s": perf_counter() - t0,
        "settings": {
            "models": list(s.models), "decoder_batches": list(s.decoder_batches),
            "resnet_batches": list(s.resnet_batches), "moe_batches": list(s.moe_batches),
            "iters": s.iters, "seconds": s.seconds,
            "warmup": s.warmup, "calls_per_round": s.calls_per_round, "threads": s.threads,
            "compile": s.compile, "autotune": s.autotune, "prompt_len": s.prompt_len,
            "cold_cache": False, "rounds": rounds,
        },
        "inductor_warmup": warmup,
        "models": models,
        "variants": {v: _variant_doc(v) for v in MODEL_VARIANTS},
        "rows": rows,
    }


def _variant_doc(variant: str) -> str:
    return {
        "eager": "the step under torch.inference_mode() (baseline)",
        "replay": "Graph(device='cpu') capture, timed g.replay() (interpreted)",
        "replay_compiled": "Graph(device='cpu', compile='inductor') capture, timed g.replay()",
        "compile": "torch.compile(step, fullgraph=True, dynamic=False)",
        "compile_max_autotune": "torch.compile(..., mode='max-autotune-no-cudagraphs')",
    }[variant]
