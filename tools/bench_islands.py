"""Eager islands on the recorder: what an island costs per replay, and a tiny MoE decoder with
its experts as islands, against eager under ``inference_mode`` (interleaved rounds, medians).

    python tools/bench_islands.py [--rounds 31] [--no-compile] [--no-decode]
                                  [--families mixtral qwen3_moe bundled] [--json PATH]

1. Overhead of one island per replay, beyond the island's own eager time: three programs on a
   16-element tensor, ``a = x * 2; b = f(a); out = b + 1`` with ``f`` an island, the same
   without ``f`` (``out = a + 1``), and ``f`` alone, eager. Overhead = with - without - f alone.
2. A transformers 5 Mixtral (2 layers, hidden 32, 4 experts, the per-expert loop that reads the
   router's choice on the host) at batch 1, one forward over 8 tokens without a cache: eager,
   interpreted replay and compiled replay (``compile="inductor"``), the experts modules marked
   as islands. Replays are checked against eager (bitwise interpreted, float-close compiled).
   Skipped, saying why, without transformers 5.
3. The decode step the issue names (``--decode``, on by default; ``--families``): batch 1, one
   new token on a prefilled cache, for transformers 5 Mixtral and Qwen3-MoE (the tiny configs of
   ``tests/moe_models.py``, a ``StaticCache`` of 64 holding an 8-token prompt) and the bundled
   MoE decoder (``accel_graph.models.Decoder``, ``DecoderConfig(num_experts=8, top_k=2)``, 16
   prefilled positions). Per model, two experts implementations:

   - ``eager``: transformers' host-reading experts loop, every experts module an island;
   - ``grouped_mm`` (HF families only): ``torch._grouped_mm`` experts, no island needed.

   Variants: eager (``inference_mode``), interpreted replay, compiled replay
   (``compile="inductor"``, ``replay: "compiled"``; each row says the mode it actually ran in:
   ``replay_mode()`` and any compile fallback), and compiled replay with Inductor's C++ wrapper
   (``cpp_wrapper: True``, column ``cpp wrap``). Every call decodes at the same length: the
   cache's length counters (``cumulative_length``, the bundled decoder's explicit position)
   are set back before each call, untimed, so the cache never overflows and every variant does
   the same work. Each variant is checked against eager on three different tokens (routing
   changes; bitwise interpreted, float-close compiled). A profile row splits each replay: the
   islands' own time (the experts' forwards, timed inside the island) and the rest (the
   captured pieces and the replay machinery), beside eager's split.

Timings are for the machine this runs on; state it with any figure (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import accel_graph
from accel_graph.bench.timing import hardware_info

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


# -- 3. the decode step ----------------------------------------------------------------------------
DECODE_FAMILIES = ("mixtral", "qwen3_moe", "bundled")
HF_PROMPT, HF_CACHE = 8, 64  # HF families: prompt tokens in the StaticCache, its length
TOKENS = (5, 77, 120)  # the check's tokens (different routings)
CALLS = 20  # decode calls per timed sample


class IslandClock:
    """Time spent inside islands (the experts' own forwards) while ``on``; a flag check when off."""

    def __init__(self) -> None:
        self.on = False
        self.ns = 0

    def instrument(self, module: torch.nn.Module) -> None:
        """Mark ``module`` an eager island whose forward is timed (re-marked if marked already)."""
        module.__dict__.pop("forward", None)
        inner = type(module).forward.__get__(module)

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - t0

        module.forward = forward  # type: ignore[method-assign]
        accel_graph.eager_island(module)


class DecodeCase:
    """A model ready to decode one token at batch 1 at a fixed length: ``step()`` returns the
    logits ``[1, vocab]``; ``reset()`` sets the cache length back (untimed, before each call);
    ``set_token(t)`` writes the static input token."""

    def __init__(self, name: str, impl: str, step: Callable[[], torch.Tensor],
                 reset: Callable[[], None], ids: torch.Tensor, islands: int,
                 clock: IslandClock | None, info: dict[str, Any]) -> None:
        self.name, self.impl, self.step, self.reset = name, impl, step, reset
        self.ids, self.islands, self.clock, self.info = ids, islands, clock, info

    def set_token(self, tok: int) -> None:
        self.ids.fill_(tok)


def _hf_case(family: str, impl: str) -> DecodeCase:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import transformers
    from moe_models import MOE_FAMILIES, build_moe  # the suite's tiny configs

    model, config = build_moe(family, experts=impl)
    fam = MOE_FAMILIES[family]
    clock = IslandClock() if impl == "eager" else None
    experts = [m for m in model.modules() if type(m).__name__ == fam.experts]
    if clock is not None:
        for m in experts:
            clock.instrument(m)
    cache = transformers.StaticCache(config=config, max_cache_len=HF_CACHE)
    prompt = torch.randint(0, config.vocab_size, (1, HF_PROMPT),
                           generator=torch.Generator().manual_seed(3))
    model(input_ids=prompt, cache=cache)  # prefill (the caller holds inference mode)
    # transformers 5 caches count their own length: a tensor per layer, advanced in place by
    # every step (captured by reference in a graph). Set back before each call.
    lengths = [layer.cumulative_length for layer in cache.layers]
    at = [int(n) for n in lengths]
    ids = torch.tensor([[TOKENS[0]]])

    def reset() -> None:
        for t, n in zip(lengths, at):
            t.fill_(n)

    def step() -> torch.Tensor:
        return model(input_ids=ids, cache=cache).logits[:, -1]

    info = {"model": fam.model_class, "experts_class": fam.experts, "hidden": config.hidden_size,
            "layers": config.num_hidden_layers, "experts": fam.moe_kwargs,
            "decode_at": at[0], "cache": f"StaticCache(max_cache_len={HF_CACHE})"}
    return DecodeCase(family, impl, step, reset, ids, len(experts) if clock else 0, clock, info)


def _bundled_case() -> DecodeCase:
    from accel_graph.bench.decode import prepare_decoder
    from accel_graph.models import DecoderConfig

    cfg = DecoderConfig(num_experts=8, top_k=2)
    model, tokens, positions = prepare_decoder(cfg, 16)
    clock = IslandClock()
    for layer in model.layers:
        clock.instrument(layer.moe.experts)
    ids, pos = tokens[:1].clone(), positions[:1].clone()
    info = {"model": "accel_graph.models.Decoder", "config": cfg.as_dict(), "decode_at": int(pos)}
    # Positions are explicit: every call writes the same cache row; nothing to set back.
    return DecodeCase("bundled", "eager", lambda: model.decode_step(ids, pos), lambda: None, ids,
                      len(model.layers), clock, info)


def _mean_call(case: DecodeCase, fn: Callable[[], Any], calls: int) -> float:
    """Mean seconds per call of ``fn``, each call timed alone after ``case.reset()``."""
    total = 0
    for _ in range(calls):
        case.reset()
        t0 = time.perf_counter_ns()
        fn()
        total += time.perf_counter_ns() - t0
    return total / calls / 1e9


def _capture(case: DecodeCase, compile_: str | None,
             options: dict[str, Any] | None = None) -> tuple[Any, torch.Tensor, float]:
    g = accel_graph.Graph(device="cpu", compile=compile_,
                          compile_options={"replay": "compiled", **(options or {})} if compile_ else None)
    case.set_token(TOKENS[0])
    case.reset()
    t0 = time.perf_counter()
    with accel_graph.graph(g):
        out = case.step()
    case.reset()
    g.replay()  # instantiates (compiles) here
    return g, out, time.perf_counter() - t0


def _checked(case: DecodeCase, out: torch.Tensor, replay: Callable[[], Any]) -> tuple[bool, float]:
    """Replay on each of :data:`TOKENS` against eager: ``(all bitwise equal, max |diff|)``."""
    bitwise, diff = True, 0.0
    for tok in TOKENS:
        case.set_token(tok)
        case.reset()
        want = case.step().clone()
        case.reset()
        replay()
        bitwise &= bool(torch.equal(out, want))
        diff = max(diff, float((out - want).abs().max()))
    case.set_token(TOKENS[0])
    return bitwise, diff


#: The replays of a decode case: name, ``compile=``, extra ``compile_options``. ``compiled_cpp``
#: is Inductor's C++ wrapper (``CompileOptions(cpp_wrapper=True)``): the code calling the
#: kernels is C++, which removes most of a compiled piece's Python call overhead per replay.
DECODE_VARIANTS: tuple[tuple[str, str | None, dict[str, Any] | None], ...] = (
    ("interpreted", None, None),
    ("compiled", "inductor", None),
    ("compiled_cpp", "inductor", {"cpp_wrapper": True}),
)


def decode_case_rows(case: DecodeCase, rounds: int, compile_: bool) -> dict[str, Any]:
    """Eager vs interpreted vs compiled replay of one decode case, interleaved medians, checks,
    the mode each replay ran in, and the per-replay split (islands vs the rest)."""
    row: dict[str, Any] = {"status": "ok", "experts_impl": case.impl, "islands": case.islands,
                           **case.info}
    fns: dict[str, Callable[[], Any]] = {"eager": case.step}
    graphs: dict[str, Any] = {}
    for name, how, options in DECODE_VARIANTS:
        if how and not compile_:
            continue
        try:
            g, out, seconds = _capture(case, how, options)
        except Exception as exc:  # a variant that cannot run is a row saying why
            row[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            continue
        bitwise, diff = _checked(case, out, g.replay)
        mode = g.replay_mode()
        info = g.compile_info() or {}
        row[name] = {"status": "ok", "capture_s": seconds, "bitwise_equal": bitwise,
                     "max_abs_diff": diff, "ran": mode.mode, "mode_reason": mode.reason,
                     "compile_fallback": info.get("fallback")}
        fns[name], graphs[name] = g.replay, (g, out)
    for fn in fns.values():  # warm-up
        _mean_call(case, fn, 3)
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            runs[name].append(_mean_call(case, fn, CALLS))
    med = {k: statistics.median(v) for k, v in runs.items()}
    row["eager_us"] = med["eager"] * 1e6
    for name in graphs:
        row[name]["us"] = med[name] * 1e6
        row[name]["x_eager"] = med[name] / med["eager"]
    if case.clock is not None:  # where a call's time goes: islands vs the rest
        split = {}
        for name, fn in fns.items():
            case.clock.ns, case.clock.on = 0, True
            total = _mean_call(case, fn, CALLS * 5)
            case.clock.on = False
            islands = case.clock.ns / (CALLS * 5) / 1e3
            split[name] = {"total_us": total * 1e6, "islands_us": islands,
                           "rest_us": total * 1e6 - islands}
        row["split"] = split
    row["targets_x_eager"] = {"interpreted": 0.6, "compiled": 0.35, "compiled_cpp": 0.35}
    return row


def decode_rows(families: list[str], rounds: int, compile_: bool) -> dict[str, Any]:
    """Row 3: the decode step per family and experts implementation."""
    out: dict[str, Any] = {}
    try:
        import transformers
        hf_ok = int(transformers.__version__.split(".")[0]) >= 5
        why = None if hf_ok else f"transformers {transformers.__version__}: needs 5.x"
    except ImportError:
        hf_ok, why = False, "transformers is not installed (a test dependency)"
    with torch.inference_mode():
        for family in families:
            impls = ("eager",) if family == "bundled" else ("eager", "grouped_mm")
            for impl in impls:
                key = f"{family}/{impl}"
                if family != "bundled" and not hf_ok:
                    out[key] = {"status": "skipped", "reason": why}
                    continue
                case = _bundled_case() if family == "bundled" else _hf_case(family, impl)
                out[key] = decode_case_rows(case, rounds, compile_)
    return out


def print_decode(rows: dict[str, Any], rounds: int) -> None:
    print(f"decode step, batch 1, one token at a fixed cache length (medians of {rounds} "
          f"interleaved rounds of {CALLS} calls; targets: interpreted <= 0.6x, compiled <= 0.35x)")
    print(f"  {'model/experts':<22}{'islands':>8}{'eager us':>10}{'interp us':>10}{'x':>7}"
          f"{'compiled us':>12}{'x':>7}{'cpp wrap us':>12}{'x':>7}  checks, mode")
    for key, r in rows.items():
        if r["status"] != "ok":
            print(f"  {key:<22} {r['status']}: {r['reason']}")
            continue
        cells, notes = [], []
        for name in ("interpreted", "compiled", "compiled_cpp"):
            v = r.get(name)
            if v is None or v["status"] != "ok":
                cells.append(f"{'-':>{10 if name == 'interpreted' else 12}}{'-':>7}")
                if v is not None:
                    notes.append(f"{name} {v['status']}: {v['reason']}")
                continue
            cells.append(f"{v['us']:>{10 if name == 'interpreted' else 12}.0f}{v['x_eager']:>7.3f}")
            check = "bitwise" if v["bitwise_equal"] else f"|d|={v['max_abs_diff']:.1e}"
            fell = f", fell back: {v['compile_fallback'][:60]}" if v.get("compile_fallback") else ""
            notes.append(f"{name} {check} ran {v['ran']}{fell}")
        print(f"  {key:<22}{r['islands']:>8}{r['eager_us']:>10.0f}{''.join(cells)}  {'; '.join(notes)}")
        if "split" in r:
            parts = " | ".join(f"{n} {v['total_us']:.0f} = islands {v['islands_us']:.0f} + rest "
                               f"{v['rest_us']:.0f}" for n, v in r["split"].items())
            print(f"  {'':<22}us per call: {parts}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled replay rows")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step rows")
    ap.add_argument("--no-forward", action="store_true",
                    help="skip the 8-token forward row (row 2)")
    ap.add_argument("--families", nargs="+", choices=DECODE_FAMILIES, default=list(DECODE_FAMILIES),
                    help="decode-step models (default: all)")
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    overhead = island_overhead(a.rounds)
    moe = ({"status": "skipped", "reason": "--no-forward"} if a.no_forward
           else moe_rows(a.rounds, not a.no_compile))
    decode = {} if a.no_decode else decode_rows(a.families, a.rounds, not a.no_compile)
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
    if decode:
        print_decode(decode, a.rounds)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "tool": "tools/bench_islands.py", "rounds": a.rounds,
            "hardware": {"cpu": hardware_info().get("cpu"), "nproc": os.cpu_count(),
                         "python": platform.python_version(),
                         "torch": torch.__version__, "threads": torch.get_num_threads(),
                         "loadavg": os.getloadavg()},
            "island_overhead": overhead, "moe": moe, "decode": decode}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
