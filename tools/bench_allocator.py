#!/usr/bin/env python3
"""Allocator engine benchmarks: prints a table and optionally writes JSON.

    python tools/bench_allocator.py [--json out.json] [--runs 7] [--quick]

Rows (medians over ``--runs`` runs, each on a fresh engine, one thread; the runs of all rows
are interleaved, so a burst of load on a shared machine spreads over every row):

- ``python_pair``: one ``Engine.malloc(4096)`` + ``Engine.free`` pair through the Python API, on
  the counting upstream (steady state: the block comes from the cache). Target < 2 us/pair.
- ``pool_tensor_pair``: a tensor over graph-pool memory made and dropped (``EnginePool.allocate``
  of a (1024,) float32, no capture listening: the DLPack maker, booking deaths in batches).
  Target < 5 us/pair.
- ``pool_tensor_pair_capturing``: the same while a capture listens (each death is booked, and
  logged, before the next allocation is).
- ``cffi_floor_pair``: the same pair calling the cffi functions directly, without the wrapper:
  the floor any Python API over this core can reach.
- ``native_c_training_mix``: the native policy in C, one ``Engine.replay`` call over a synthetic
  training-step trace shaped like allocator-semantics.md section 3.1 (25 distinct sizes, 25 % of
  allocations <= 1 MiB, 42 % freed within two later allocations, median lifetime 3, p90 about
  1,300-2,000 allocations, 880 long-lived blocks). Events = mallocs + frees. Target >= 5 M/s.
- ``native_c_training_mix_traced``: the same with event recording on (a ring of 65,536 entries),
  the cost of tracing.
- ``native_c_pair``: the same replay path over plain malloc/free pairs of one size (the cost of
  the bookkeeping alone, no search depth).

JSON schema (``accel-graph.bench_allocator/1``)::

    {"schema": str, "command": str, "timestamp": str,
     "hardware": {"nproc": int, "cpu": str, "platform": str, "python": str},
     "rows": [{"name": str, "value": float, "unit": str, "target": str, "met": bool | null,
               "runs": [float], "params": {...}}]}
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

import numpy as np

from accel_graph.allocator.core.engine import OP, OP_DTYPE, Engine
from accel_graph.allocator.core.loader import load_core
from accel_graph.allocator.core.settings import EngineSettings

MIB = 1 << 20
KIB = 1 << 10

# (size, weight): 25 sizes; the large ones are the dense-LM activation/weight shapes of the
# public traces (5 MiB = B*S*d*4 the most frequent, 25 MiB = d*d*4, 100 MiB = d*ff*4, ...),
# the small ones (25 % of allocations, < 0.2 % of bytes) are biases, norms and scalars.
SIZE_MIX = [
    (512, 4),
    (2 * KIB, 3),
    (4 * KIB, 3),
    (10 * KIB, 3),
    (20 * KIB, 3),
    (40 * KIB, 2),
    (80 * KIB, 2),
    (160 * KIB, 2),
    (320 * KIB, 1),
    (640 * KIB, 1),
    (MIB, 1),
    (2 * MIB + 512 * KIB, 10),
    (5 * MIB, 30),
    (7 * MIB + 512 * KIB, 3),
    (8 * MIB, 8),
    (10 * MIB, 4),
    (12 * MIB + 512 * KIB, 2),
    (15 * MIB, 2),
    (20 * MIB, 5),
    (25 * MIB, 5),
    (30 * MIB, 1),
    (40 * MIB, 2),
    (50 * MIB, 1),
    (80 * MIB, 1),
    (100 * MIB, 2),
]
PERMANENT_BLOCKS = 880  # parameters and optimiser state: live across the whole window
SLOT_RING = 4096  # > the longest sampled lifetime (2,500 allocations)


def training_mix_trace(n_allocs: int, seed: int = 0) -> np.ndarray:
    """A replay op array: permanent blocks first, then allocations with sampled lifetimes."""
    rng = np.random.default_rng(seed)
    sizes = np.array([s for s, _ in SIZE_MIX], dtype=np.int64)
    weights = np.array([w for _, w in SIZE_MIX], dtype=np.float64)
    size = sizes[rng.choice(len(sizes), size=n_allocs, p=weights / weights.sum())]
    # lifetime = allocations made between a block's malloc and its free: 42 % at most two,
    # median 3, a long tail to ~2,500 (p90 in the public traces: 1,300-2,000)
    u = rng.random(n_allocs)
    life = np.where(
        u < 0.42,
        rng.integers(0, 3, n_allocs),
        np.where(
            u < 0.50,
            3,
            np.where(
                u < 0.80,
                np.exp(rng.uniform(np.log(4), np.log(1000), n_allocs)).astype(np.int64),
                rng.integers(1000, 2500, n_allocs),
            ),
        ),
    )
    life[:PERMANENT_BLOCKS] = n_allocs * 4  # never freed inside the window
    idx = np.arange(n_allocs, dtype=np.int64)
    death = idx + life + 1  # freed just before allocation number `death`
    mortal = death < n_allocs
    # order: at step t, first the frees due at t, then malloc t
    keys = np.concatenate([idx * 2 + 1, death[mortal] * 2])
    kinds = np.concatenate(
        [np.full(n_allocs, OP["malloc"]), np.full(int(mortal.sum()), OP["free"])]
    )
    which = np.concatenate([idx, idx[mortal]])  # the allocation each op belongs to
    order = np.argsort(keys, kind="stable")
    alloc = which[order]
    ops = np.zeros(len(order), dtype=OP_DTYPE)
    ops["op"] = kinds[order]
    ops["size"] = np.where(ops["op"] == OP["malloc"], size[alloc], 0)
    # Slot ids are recycled, as a trace converter numbers live blocks: permanent blocks keep
    # slots 0..879, the others cycle through SLOT_RING slots, more than any lifetime, so a slot
    # is reused only after its previous block died (trace_stats checks this).
    ops["id"] = np.where(alloc < PERMANENT_BLOCKS, alloc, PERMANENT_BLOCKS + alloc % SLOT_RING)
    return ops


def pair_trace(n_pairs: int, size: int = 4096) -> np.ndarray:
    ops = np.zeros(2 * n_pairs, dtype=OP_DTYPE)
    ops["op"][0::2] = OP["malloc"]
    ops["op"][1::2] = OP["free"]
    ops["size"][0::2] = size
    return ops


def trace_stats(ops: np.ndarray) -> dict[str, float]:
    """Check the generated trace against the statistics it claims (lifetimes in allocations)."""
    mallocs = np.flatnonzero(ops["op"] == OP["malloc"])
    frees = np.flatnonzero(ops["op"] == OP["free"])
    # walk the slot numbering: which allocation (by rank) holds each slot when it is freed
    holder = np.full(int(ops["id"].max()) + 1, -1, dtype=np.int64)
    life = np.empty(len(frees), dtype=np.int64)
    rank = j = 0
    for kind, slot in zip(ops["op"].tolist(), ops["id"].tolist()):
        if kind == OP["malloc"]:
            assert holder[slot] == -1, "a slot was reused while its block was alive"
            holder[slot] = rank
            rank += 1
        else:
            # lifetime = allocations made between the block's malloc and its free
            life[j] = rank - holder[slot] - 1
            holder[slot] = -1
            j += 1
    sizes = ops["size"][mallocs]
    return {
        "events": int(len(ops)),
        "allocations": int(len(mallocs)),
        "distinct_sizes": int(len(np.unique(sizes))),
        "freed_within_two_allocs": float(np.mean(life <= 2) * len(frees) / len(mallocs)),
        "median_lifetime_allocs": float(np.median(life)),
        "p90_lifetime_allocs": float(np.percentile(life, 90)),
        "small_fraction": float(np.mean(sizes <= MIB)),
    }


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one call of fn."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench_python_pair(n: int) -> tuple[float, float]:
    e = Engine("native", "counting")
    malloc, free = e.malloc, e.free
    free(malloc(4096))  # warm: the segment exists

    def loop():
        for _ in range(n):
            free(malloc(4096))

    wall, cpu = _timed(loop)
    return wall / n * 1e6, cpu / n * 1e6


def bench_pool_tensor_pair(n: int, capturing: bool = False) -> tuple[float, float]:
    """A tensor over graph-pool memory made and dropped: the recorder's CPU pool on the engine
    (zero-copy tensor that owns the block, freed into the engine when the tensor dies)."""
    import torch

    from accel_graph.backends.recorder.engine_pool import EnginePool

    pool = EnginePool(torch.device("cpu"))
    # As during a capture: the pool is in use, so a dead block stays cached in the engine
    # (an idle pool hands each segment back at once, which is not what this row measures).
    pool.add_graph()
    log: list = []
    if capturing:
        pool.begin_capture(log)
    cpu = torch.device("cpu")
    alloc = pool.allocate
    alloc((1024,), (1,), torch.float32, cpu)  # warm: the segment exists

    def loop():
        for i in range(n):
            alloc((1024,), (1,), torch.float32, cpu)  # dies at once: block back to the engine
            if not i & 1023:
                log.clear()  # a capture's log: kept short, as in one capture

    wall, cpu_s = _timed(loop)
    return wall / n * 1e6, cpu_s / n * 1e6


def bench_cffi_floor(n: int) -> tuple[float, float]:
    e = Engine("native", "counting")
    lib, h = load_core().lib, e.c_handle  # the raw cffi functions, deliberately bypassing the wrapper
    m, f = lib.ag_malloc, lib.ag_free
    f(h, m(h, 4096, 0, 0))

    def loop():
        for _ in range(n):
            f(h, m(h, 4096, 0, 0))

    wall, cpu = _timed(loop)
    return wall / n * 1e6, cpu / n * 1e6


def bench_replay(
    ops: np.ndarray, settings: EngineSettings | None = None, trace_events: bool = False
) -> tuple[float, float]:
    """Million events per second, by wall clock and by process CPU time."""
    e = Engine("native", "counting", settings)
    if trace_events:
        e.enable_events(max_entries=1 << 16)  # a ring: memory stays bounded
    n_slots = int(ops["id"].max()) + 1
    out = {}

    def run():
        out["res"] = e.replay(ops, n_slots=n_slots)

    wall, cpu = _timed(run)
    assert (out["res"] >= 0).all(), "the benchmark trace must not run out of memory"
    return len(ops) / wall / 1e6, len(ops) / cpu / 1e6


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--runs", type=int, default=7, help="runs per row (median reported)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke test")
    args = ap.parse_args(argv)
    n_pairs = 20_000 if args.quick else 200_000
    n_allocs = 50_000 if args.quick else 500_000

    mix = training_mix_trace(n_allocs)
    mix_stats = trace_stats(mix)
    pairs = pair_trace(n_allocs)
    # (name, fn, unit, target, better, params); runs are interleaved across rows so that
    # a burst of load on the shared machine spreads over all of them, then medians are taken
    specs = [
        (
            "python_pair",
            lambda: bench_python_pair(n_pairs),
            "us/pair",
            2.0,
            "lower",
            {"pairs": n_pairs, "size": 4096, "upstream": "counting"},
        ),
        (
            "pool_tensor_pair",
            lambda: bench_pool_tensor_pair(n_pairs // 10),
            "us/pair",
            5.0,
            "lower",
            {"pairs": n_pairs // 10, "size": 4096, "what": "EnginePool tensor made and dropped"},
        ),
        (
            "pool_tensor_pair_capturing",
            lambda: bench_pool_tensor_pair(n_pairs // 10, capturing=True),
            "us/pair",
            5.0,
            "lower",
            {"pairs": n_pairs // 10, "size": 4096, "what": "the same while a capture listens"},
        ),
        (
            "cffi_floor_pair",
            lambda: bench_cffi_floor(n_pairs),
            "us/pair",
            None,
            "lower",
            {"pairs": n_pairs, "size": 4096},
        ),
        (
            "native_c_training_mix",
            lambda: bench_replay(mix),
            "M events/s",
            5.0,
            "higher",
            mix_stats,
        ),
        (
            "native_c_training_mix_traced",
            lambda: bench_replay(mix, trace_events=True),
            "M events/s",
            None,
            "higher",
            {**mix_stats, "event_recording": "on, ring of 65536"},
        ),
        (
            "native_c_pair",
            lambda: bench_replay(pairs),
            "M events/s",
            None,
            "higher",
            {"events": int(len(pairs)), "size": 4096},
        ),
    ]
    load_before = os.getloadavg()
    measured: list[list[tuple[float, float]]] = [[] for _ in specs]
    for _ in range(args.runs):
        for i, spec in enumerate(specs):
            measured[i].append(spec[1]())
    rows = []
    for (name, _, unit, target, better, params), pairs_ in zip(specs, measured):
        runs = [w for w, _ in pairs_]
        value = statistics.median(runs)
        value_cpu = statistics.median(c for _, c in pairs_)
        met = None if target is None else (value < target if better == "lower" else value >= target)
        rows.append(
            {
                "name": name,
                "value": value,
                "value_cpu": value_cpu,
                "unit": unit,
                "target": ""
                if target is None
                else f"{'<' if better == 'lower' else '>='} {target:g}",
                "better": better,
                "met": met,
                "runs": runs,
                "runs_cpu": [c for _, c in pairs_],
                "params": params,
            }
        )

    hardware = {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        # other work on the machine slows wall-clock figures; the CPU-time column is less
        # sensitive to it (but shared caches still are)
        "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(
        f"allocator benchmarks ({hardware['cpu']}, {hardware['nproc']} CPUs, one thread, "
        f"median of {args.runs}; load average {hardware['loadavg_1min_before_after']})"
    )
    print(f"{'row':<28}{'wall':>10}{'cpu-time':>10}  {'unit':<11}{'target':<9}{'met (wall)':<10}")
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(
            f"{r['name']:<28}{r['value']:>10.3f}{r['value_cpu']:>10.3f}  {r['unit']:<11}"
            f"{r['target']:<9}{met:<10}"
        )
    print("training mix: " + ", ".join(f"{k}={v:g}" for k, v in mix_stats.items()))
    if args.json:
        doc = {
            "schema": "accel-graph.bench_allocator/1",
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": hardware,
            "rows": rows,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
