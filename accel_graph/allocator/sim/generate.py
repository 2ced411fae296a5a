"""Calibrated synthetic allocator traces in PyTorch's snapshot format.

:func:`generate` builds the alloc/free sequence of a workload in Python, drives the C engine
(``Engine(policy="native", upstream="counting")``, events on) with it, and converts the engine's
events with :meth:`Trace.from_events`: so ``segment_alloc``/``segment_free`` (or
``segment_map``) events and addresses are exactly what the native allocator would produce under
the given settings. The settings and the generator's parameters are recorded in the trace's
``allocator_settings`` (torch's fields plus an ``"accel_graph_generator"`` entry).

Workloads follow shared/reference/allocator-semantics.md section 3.2 ("Synthetic-but-realistic
generators"), calibrated on the measured traces of section 3.1:

- ``train``: dense LM training step (zero_grad, forward, backward, AdamW step). Calibration
  targets (3.1): ~25 distinct sizes per step, ~42 % of allocations freed within two subsequent
  allocations (median lifetime ~3 allocations), a long-lived tail (activations held from forward to
  backward; parameters, grads and optimiser state live across the window), ~25 % of allocations
  <= 1 MiB carrying < 1 % of bytes, utilisation ~0.88-0.90.
- ``shapes``: the training step with the sequence length drawn per step (3.2 item 2).
- ``moe``: expert FFNs with per-step token counts drawn per expert (3.2 item 3).
- ``serve``: weight load, profile run, KV cache, CUDA-graph capture per batch size into one
  private pool (decreasing order), then decode/prefill steps (3.2 item 4).
- ``rl``: alternating training and generation phases with offload/reload of weights and
  optimiser state (3.2 item 5).
- ``frag``: KNOWN fragmentation. Growing large allocations (each bigger than any cached block)
  interleaved with long-lived small blocks. Under the default native settings every request gets
  a new segment and peak reserved grows with the sum of the sizes; ``expandable_segments:True``
  removes it (the freed range is extended in place), giving peak reserved ~ the largest request.
  ``max_split_size_mb`` does not help without a memory cap (it only acts when cudaMalloc fails).

Deterministic: the same arguments give the same trace (numpy ``default_rng(seed)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..alloc_conf import AllocatorSettings, parse_config
from ..core.engine import Engine
from ..core.settings import EngineSettings
from ..traces.actions import ACTION_CODE
from ..traces.model import Trace
from ..units import MIB

__all__ = ["WORKLOADS", "Tape", "generate", "trace_stats"]

F32 = 4
_US_PER_EVENT = 5


class Tape:
    """An alloc/free program: ``alloc`` returns a handle, ``free`` releases it."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int, int]] = []  # (kind 0=alloc 1=free, handle, size, pool)
        self._next = 0
        self.pool = 0  # 0: default pools; else a private pool id (capture)

    def alloc(self, size: int) -> int:
        h = self._next
        self._next += 1
        self.ops.append((0, h, max(1, int(size)), self.pool))
        return h

    def free(self, h: int) -> None:
        self.ops.append((1, h, 0, 0))

    def temp(self, size: int, life: int = 1) -> None:
        """A temporary freed after ``life`` further allocations (lifetime ``life``)."""
        t = self.alloc(size)
        self.ops.append((2, t, life, 0))  # deferred free: resolved after ``life`` more allocs


@dataclass(frozen=True)
class Model:
    batch: int
    seq: int
    d: int
    ff: int
    heads: int
    vocab: int
    layers: int


def _model(scale: float, layers: int | None) -> Model:
    # 3.1's anchor: d=2560, ff=10240, 32 layers, 32 heads, vocab 10k, batch 4, ctx 128, fp32.
    d = max(64, int(round(2560 * scale / 64)) * 64)
    return Model(batch=4, seq=128, d=d, ff=4 * d, heads=max(1, d // 80), vocab=10_000,
                 layers=layers if layers is not None else 8)  # fmt: skip


def _params(m: Model) -> list[int]:
    """Parameter sizes in bytes: per layer 4 d^2 attention, 2 d*ff MLP, norms and biases."""
    per = [m.d * m.d * F32] * 4 + [m.d * m.ff * F32] * 2 + [m.d * F32] * 4 + [m.ff * F32]
    return [m.vocab * m.d * F32] + per * m.layers + [m.d * F32]


def _forward(t: Tape, m: Model, seq: int, saved: list[list[int]],
             ffn: Callable[..., None] | None, rng: np.random.Generator) -> None:  # fmt: skip
    """Forward pass; ``saved`` gets one list of kept activations per layer (plus embed, head)."""
    b, s, d, ff, h = m.batch, seq, m.d, m.ff, m.heads
    bsd, bsf, att = b * s * d * F32, b * s * ff * F32, b * h * s * s * F32
    saved.append([t.alloc(bsd)])  # embedding output
    for _ in range(m.layers):
        keep: list[int] = []
        saved.append(keep)
        t.temp(b * s * F32)  # norm statistics (mean), short-lived
        ln = t.alloc(bsd)  # normed input, kept
        keep += [t.alloc(b * s * F32), ln]  # rstd kept for backward
        keep += [t.alloc(bsd), t.alloc(bsd), t.alloc(bsd)]  # q, k, v
        scores = t.alloc(att)
        t.temp(b * h * s * F32, 2)  # softmax max, short-lived
        probs = t.alloc(att)
        t.free(scores)
        keep.append(probs)
        t.temp(b * s * s, 3)  # attention mask (bool)
        t.temp(att, 2)  # dropout mask, short-lived
        keep.append(t.alloc(bsd))  # attention context
        keep.append(t.alloc(bsd))  # projection
        t.temp(b * s * F32, 4)  # second norm statistics
        t.temp(3 * bsd, 2)  # fused qkv view copy
        if ffn is None:
            keep += [t.alloc(bsf), t.alloc(bsf)]
            t.temp(bsf, 3)  # gelu intermediate
            t.temp(b * s * d * 2, 1)  # half-precision copy
        else:
            ffn(t, m, seq, keep, rng)
        keep.append(t.alloc(bsd))  # residual output
    logits = t.alloc(b * s * m.vocab * F32)
    t.temp(b * s * F32)  # log-sum-exp
    t.temp(b * s * 8)  # target indices (int64)
    saved.append([logits])


_PER_LAYER = 11  # parameters per layer in _params


def _backward(t: Tape, m: Model, seq: int, saved: list[list[int]], grads: list[int | None],
              sizes: list[int]) -> None:  # fmt: skip
    """Backward in reverse layer order: activations released LIFO, weight grads appear per
    layer (allocated again each step: zero_grad(set_to_none=True) freed them)."""
    bsd = m.batch * seq * m.d * F32

    def grad(i: int) -> None:
        if grads[i] is None:
            grads[i] = t.alloc(sizes[i])

    g = t.alloc(m.batch * seq * m.vocab * F32)
    for h in saved.pop():  # logits
        t.free(h)
    grad(len(sizes) - 1)
    prev = t.alloc(bsd)
    t.free(g)
    for layer in range(m.layers - 1, -1, -1):
        for j, act in enumerate(reversed(saved.pop())):
            t.temp(bsd, 1 + j % 4)  # local gradient, short-lived
            t.free(act)
        t.temp(m.batch * m.heads * seq * seq * F32, 2)  # d(scores)
        t.temp(m.batch * seq * m.ff * 2, 1)  # d(gelu) in half precision
        t.temp(3 * m.d * F32, 1)  # fused qkv bias gradient
        ga = t.alloc(bsd)
        t.free(prev)
        prev = ga
        for i in range(1 + layer * _PER_LAYER, 1 + (layer + 1) * _PER_LAYER):
            grad(i)
    for h in saved.pop():  # embedding output
        t.free(h)
    t.free(prev)
    grad(0)


def _adamw(t: Tape, sizes: list[int], grads: list[int | None], state: list[int]) -> None:
    """foreach AdamW: lazily created state (2 per param), then short-lived temporaries."""
    t.temp(len(sizes) * F32, 2)  # clip_grad_norm: per-parameter norms
    t.temp(F32, 1)  # total norm
    t.temp(8, 1)  # step counter
    if not state:
        for sz in sizes:
            state += [t.alloc(sz), t.alloc(sz)]
    for sz in sizes:
        t.temp(sz)  # exp_avg_sq.sqrt()
        t.temp(sz)  # update


def _train_step(t: Tape, m: Model, seq: int, weights: list[int], grads: list[int | None],
                state: list[int], rng: np.random.Generator,
                ffn: Callable[..., None] | None = None) -> None:  # fmt: skip
    sizes = _params(m)
    for i, g in enumerate(grads):  # zero_grad(set_to_none=True)
        if g is not None:
            t.free(g)
            grads[i] = None
    saved: list[list[int]] = []
    _forward(t, m, seq, saved, ffn, rng)
    _backward(t, m, seq, saved, grads, sizes)
    _adamw(t, sizes, grads, state)


def _load(t: Tape, m: Model) -> tuple[list[int], list[int | None], list[int]]:
    weights = [t.alloc(sz) for sz in _params(m)]
    return weights, [None] * len(weights), []


# ----------------------------------------------------------------------------------------------
# workloads


def _wl_train(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    weights, grads, state = _load(t, m)
    for _ in range(steps):
        _train_step(t, m, m.seq, weights, grads, state, rng)


def _wl_shapes(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    weights, grads, state = _load(t, m)
    choices = np.array([m.seq // 2, m.seq, m.seq + m.seq // 2, 2 * m.seq, 4 * m.seq])
    for _ in range(steps):
        seq = int(rng.choice(choices, p=[0.2, 0.3, 0.2, 0.2, 0.1]))
        _train_step(t, m, seq, weights, grads, state, rng)


def _moe_ffn(experts: int, topk: int) -> Callable[..., None]:
    def ffn(t: Tape, m: Model, seq: int, saved: list[int], rng: np.random.Generator) -> None:
        tokens = m.batch * seq * topk
        counts = rng.multinomial(tokens, rng.dirichlet(np.full(experts, 2.0)))
        router = t.alloc(m.batch * seq * experts * F32)
        saved.append(router)
        t.temp(m.batch * seq * topk * 8)  # top-k indices
        for c in counts:
            if c == 0:
                continue
            h1 = t.alloc(int(c) * m.ff * F32)
            a1 = t.alloc(int(c) * m.ff * F32)
            saved += [h1, a1]
            t.temp(int(c) * m.d * F32)  # gathered tokens
        t.temp(m.batch * seq * m.d * F32)  # combine buffer

    return ffn


def _wl_moe(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    m = Model(m.batch, m.seq, m.d, m.ff // 4, m.heads, m.vocab, m.layers)  # expert ff = d
    weights, grads, state = _load(t, m)
    ffn = _moe_ffn(experts=8, topk=2)
    for _ in range(steps):
        _train_step(t, m, m.seq, weights, grads, state, rng, ffn)


def _decode(t: Tape, m: Model, tokens: int) -> None:
    """One forward over ``tokens`` new tokens (KV cache is preallocated)."""
    d = m.d
    x = t.alloc(tokens * d * F32)
    for _ in range(m.layers):
        t.temp(tokens * F32)
        qkv = t.alloc(3 * tokens * d * F32)
        o = t.alloc(tokens * d * F32)
        t.free(qkv)
        h1 = t.alloc(tokens * m.ff * F32)
        t.temp(tokens * m.ff * F32)
        y = t.alloc(tokens * d * F32)
        t.free(h1)
        t.free(o)
        t.free(x)
        x = y
    logits = t.alloc(tokens * m.vocab * F32)
    t.temp(tokens * 8)
    t.free(logits)
    t.free(x)


def _wl_serve(t: Tape, rng: np.random.Generator, steps: int, m: Model,
              graphs: bool = True) -> None:  # fmt: skip
    _load(t, m)  # weights: permanent
    max_tokens = 2048
    _decode(t, m, max_tokens)  # profile run at max batched tokens
    kv_bytes = 2 * m.layers * 8192 * m.d * F32  # a few huge allocations
    for _ in range(4):
        t.alloc(kv_bytes // 4)
    if graphs:
        t.pool = -1  # capture into one shared private pool, batch sizes in decreasing order
        for bs in (256, 128, 64, 32, 16, 8, 4, 2, 1):
            _decode(t, m, bs)
        t.pool = 0
    for _ in range(steps):
        for _ in range(8):
            if rng.random() < 0.2:  # prefill of a new request
                _decode(t, m, int(rng.integers(64, max_tokens)))
            else:  # eager decode at a batch size not captured
                _decode(t, m, int(rng.integers(257, 512)))


def _wl_rl(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    weights, grads, state = _load(t, m)
    sizes = _params(m)
    for _ in range(steps):
        _train_step(t, m, m.seq, weights, grads, state, rng)
        # offload optimiser state and grads for the rollout ("stash" pattern)
        for h in state:
            t.free(h)
        state.clear()
        for i, g in enumerate(grads):
            if g is not None:
                t.free(g)
                grads[i] = None
        kv = [t.alloc(m.layers * 4096 * m.d * F32) for _ in range(2)]
        for _ in range(4):
            _decode(t, m, int(rng.integers(16, 256)))
        for h in kv:
            t.free(h)
        for sz in sizes:  # reload optimiser state
            state.append(t.alloc(sz))
            state.append(t.alloc(sz))


def _wl_frag(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    """KNOWN fragmentation: growing large requests interleaved with long-lived small blocks."""
    base = max(12 * MIB, m.d * m.d * F32 // 2)
    n = max(8, steps * 8)
    for i in range(n):
        big = t.alloc(base + i * 2 * MIB + int(rng.integers(0, 512 * 1024)))
        t.alloc(256 * 1024)  # long-lived small block (never freed)
        t.temp(4 * MIB)
        t.free(big)


def _wl_pin(t: Tape, rng: np.random.Generator, steps: int, m: Model) -> None:
    """The pytorch#193400 micro-pattern (allocator-semantics.md 3.2 item 6): per cycle a 91 MiB
    and a 45.5 MiB tensor, then a 2 MiB tensor that stays live (a "pin") while the two big ones
    are freed. Harmless by default; with ``max_split_size_mb`` and expandable segments, torch
    2.12+ keeps the freed big blocks from smaller requests and reserved grows every cycle (the
    ``cuda-2.13`` vs ``cuda-2.9`` profiles). ``steps`` is the cycle count; sizes are fixed."""
    for _ in range(steps):
        a = t.alloc(91 * MIB)
        b = t.alloc(91 * MIB // 2)
        t.alloc(2 * MIB)  # the pin: never freed
        t.free(a)
        t.free(b)


WORKLOADS: dict[str, Callable[..., None]] = {
    "train": _wl_train,
    "shapes": _wl_shapes,
    "moe": _wl_moe,
    "serve": _wl_serve,
    "rl": _wl_rl,
    "frag": _wl_frag,
    "pin": _wl_pin,
}
_DEFAULT_STEPS = {"train": 2, "shapes": 4, "moe": 2, "serve": 8, "rl": 2, "frag": 4, "pin": 100}


# ----------------------------------------------------------------------------------------------
# driving the engine


def _settings(settings: str | AllocatorSettings | None) -> AllocatorSettings:
    if settings is None:
        return AllocatorSettings()
    if isinstance(settings, str):
        return parse_config(settings)
    if isinstance(settings, AllocatorSettings):
        return settings
    raise TypeError(f"settings must be a config string or AllocatorSettings, got {settings!r}")


def _run(tape: Tape, parsed: AllocatorSettings) -> tuple[np.ndarray, list[dict[str, Any]]]:
    engine = Engine(policy="native", upstream="counting",
                    settings=EngineSettings.from_allocator_settings(parsed))  # fmt: skip
    engine.enable_events()
    ptr: dict[int, int] = {}
    pending: list[list[int]] = []  # [handle, allocations left]
    private = 0
    malloc, free = engine.malloc, engine.free
    for kind, h, size, pool in tape.ops:
        if kind == 0:
            if pool:
                if not private:
                    private = engine.create_pool()
                ptr[h] = malloc(size, 0, private)
            else:
                ptr[h] = malloc(size)
            if pending:
                for p in pending:
                    p[1] -= 1
                    if p[1] <= 0:
                        free(ptr.pop(p[0]))
                pending = [p for p in pending if p[1] > 0]
        elif kind == 1:
            free(ptr.pop(h))
        else:
            pending.append([h, size])
    for p in pending:
        free(ptr.pop(p[0]))
    events = engine.drain_events()
    # the engine stamps wall-clock time; a synthetic clock (5 us per event) keeps traces
    # deterministic while giving viewers and free_completed timing a usable time axis
    events = events[np.argsort(events["seq"], kind="stable")]
    events["time_us"] = np.arange(len(events), dtype=np.int64) * _US_PER_EVENT
    segments = engine.snapshot()
    engine.close()
    return events, segments


def generate(workload: str, *, seed: int = 0, steps: int | None = None, scale: float = 0.25,
             layers: int | None = None,
             settings: str | AllocatorSettings | None = None) -> Trace:  # fmt: skip
    """A synthetic trace of ``workload`` (one of :data:`WORKLOADS`).

    ``steps``: training steps / serving rounds / RL iterations (default per workload);
    ``scale``: hidden size relative to the 3.1 anchor model (d=2560; 0.25 gives d=640);
    ``layers``: transformer layers (default 8); ``settings``: allocator config string or
    :class:`AllocatorSettings` the engine runs under (default: torch's defaults).
    Deterministic in all arguments.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    if steps is None:
        steps = _DEFAULT_STEPS[workload]
    if steps < 1 or not 0 < scale < 1e6:  # also refuses nan and inf
        raise ValueError(f"steps must be >= 1 and 0 < scale < 1e6 (got steps={steps}, "
                         f"scale={scale})")
    parsed = _settings(settings)
    rng = np.random.default_rng(seed)
    tape = Tape()
    WORKLOADS[workload](tape, rng, steps, _model(scale, layers))
    events, segments = _run(tape, parsed)
    alloc_settings: dict[str, Any] = dict(parsed.to_snapshot_dict())
    alloc_settings["accel_graph_generator"] = {
        "workload": workload, "seed": seed, "steps": steps, "scale": scale,
        "layers": layers if layers is not None else 8, "policy": "native",
        "upstream": "counting", "reference": "allocator-semantics.md 3.2",
    }  # fmt: skip
    return Trace.from_events(events, device_type="cuda", segments=segments,
                             allocator_settings=alloc_settings)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# calibration statistics


def trace_stats(trace: Trace, device: int = 0) -> dict[str, float]:
    """The section 3.1 statistics of a trace recorded from empty.

    ``short_lived``: fraction of allocations freed within two subsequent allocations;
    ``lifetime_median`` / ``lifetime_p90`` in allocations (blocks freed in the window);
    ``never_freed``; ``small_fraction`` (allocations <= 1 MiB) and ``small_bytes``;
    ``peak_allocated`` (requested bytes), ``peak_reserved``, ``utilisation``.
    """
    a = trace.events(device)
    act = a["action"]
    alloc_c, free_c = ACTION_CODE["alloc"], ACTION_CODE["free_requested"]
    grow = {ACTION_CODE["segment_alloc"], ACTION_CODE["segment_map"]}
    shrink = {ACTION_CODE["segment_free"], ACTION_CODE["segment_unmap"]}
    live: dict[int, tuple[int, int]] = {}
    lifetimes: list[int] = []
    n_alloc = allocated = reserved = peak_a = peak_r = 0
    sizes: list[int] = []
    for code, addr, size in zip(act.tolist(), a["addr"].tolist(), a["size"].tolist(),
                                strict=True):  # fmt: skip
        if code == alloc_c:
            live[addr] = (n_alloc, size)
            n_alloc += 1
            sizes.append(size)
            allocated += size
            peak_a = max(peak_a, allocated)
        elif code == free_c:
            start, sz = live.pop(addr)
            lifetimes.append(n_alloc - start - 1)
            allocated -= sz
        elif code in grow:
            reserved += size
            peak_r = max(peak_r, reserved)
        elif code in shrink:
            reserved -= size
    lt = np.array(lifetimes or [0])
    sz = np.array(sizes or [0], dtype=np.float64)
    small = sz <= MIB
    return {
        "allocs": n_alloc,
        "distinct_sizes": len(set(sizes)),
        "short_lived": float((lt <= 2).sum() / max(1, n_alloc)),
        "lifetime_median": float(np.median(lt)),
        "lifetime_p90": float(np.percentile(lt, 90)),
        "never_freed": len(live),
        "small_fraction": float(small.mean()),
        "small_bytes": float(sz[small].sum() / max(1.0, sz.sum())),
        "peak_allocated": peak_a,
        "peak_reserved": peak_r,
        "utilisation": peak_a / peak_r if peak_r else 0.0,
        "segment_allocs": int(np.isin(act, list(grow)).sum()),
        "segment_frees": int(np.isin(act, list(shrink)).sum()),
    }
