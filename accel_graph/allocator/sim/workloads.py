"""The synthetic workloads of :func:`~.generate.generate`: each one writes the alloc/free program of
a PyTorch job (a training step, MoE, serving, RL, known fragmentation, pinned-shape serving) on a
:class:`Tape`, in requested bytes, without touching the engine.

The workloads and their calibration targets are described in :mod:`.generate` (and
shared/reference/allocator-semantics.md section 3.2); :data:`WORKLOADS` names them,
:data:`DEFAULT_STEPS` gives each its default length. Deterministic: randomness comes only from
the ``numpy`` generator passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..units import MIB

__all__ = ["DEFAULT_STEPS", "WORKLOADS", "Model", "Tape", "make_model"]

#: Bytes per float32 element.
F32 = 4


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


def make_model(scale: float, layers: int | None) -> Model:
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
#: Steps per workload when the caller gives none.
DEFAULT_STEPS = {"train": 2, "shapes": 4, "moe": 2, "serve": 8, "rl": 2, "frag": 4, "pin": 100}
