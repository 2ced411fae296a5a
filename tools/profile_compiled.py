"""Where compiled replay (``Graph(compile="inductor")``) spends its time, and what the Inductor
options we evaluated change (issue 15, item 4). CPU, one torch thread.

Models: the bundled decoder's decode step (``--models decoder``, batches ``--batches``) and a
small ResNet written here (``--models convnet``: a conv/BN/ReLU stem, three basic blocks, pool,
fc; 3x64x64 images). For each model and batch, in one process and timed interleaved (rounds of
``--calls`` calls, medians, see :mod:`accel_graph.bench.timing`):

- ``eager`` under ``inference_mode`` (the baseline), ``interpreted`` replay, ``torch.compile``
  (``fullgraph=True, dynamic=False``), and compiled replay in each variant of ``--variants``
  (``default``: the library's settings; ``freeze``: ``compile_options={"freeze": True}``;
  ``freeze_no_prepack``: the same without Inductor's mkldnn/MKL weight prepacking;
  ``python_wrapper``/``cpp_wrapper``: Inductor's wrapper forced either way; ``size_asserts``:
  Inductor's per-input size/stride asserts back on; ``no_emulate``: without
  ``emulate_precision_casts``). Each variant is a fresh capture compiled with the compile cache
  cleared; Inductor settings are patched around the capture only.
- the layers of the default compiled step (decoder only): ``g.replay()`` (front end), the
  backend's replay function (stale-input checks + the compiled module), the compiled module
  alone (AOT's runtime wrapper + Inductor's code); the differences are what each layer costs.
- a ``torch.profiler`` split of one compiled step (``--profile``; a variant compiled with
  Inductor's ``cpp.enable_kernel_profile``): extern GEMMs, Inductor's C++ kernels, allocations,
  other aten calls, and the rest (Python: wrappers, ours and Inductor's); and the step's extern
  GEMMs re-run alone without the profiler (the floor no wrapper change goes below). The
  profiler inflates the step several times over, so read its split as proportions.

Prints a table and writes JSON (``--json``). Cold compiles take 20-80 s each on 2 busy cores:

    bash tools/dev.sh run python tools/profile_compiled.py --json out.json
    bash tools/dev.sh run python tools/profile_compiled.py --models convnet --batches 1 4 \\
        --variants default freeze
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

import accel_graph
from accel_graph.backends.recorder.compiled import settings as compile_settings
from accel_graph.backends.recorder.compiled.inductor import clear_compile_cache, compile_program
from accel_graph.bench.timing import hardware_info, interleaved_samples
from accel_graph.models import Decoder, DecoderConfig

#: Compiled-replay variants: (compile_options, Inductor config patched around the capture).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "freeze": ({"freeze": True}, {}),
    "freeze_no_prepack": ({"freeze": True}, {"cpp.weight_prepack": False}),
    "python_wrapper": ({}, {"cpp_wrapper": False}),
    "cpp_wrapper": ({"cpp_wrapper": True}, {}),
    "size_asserts": ({}, {"size_asserts": True}),
    "no_emulate": ({}, {"emulate_precision_casts": False}),
}

_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
          "aten::_convolution", "aten::mkldnn_convolution", "mkldnn::_linear_pointwise",
          "mkldnn::_convolution_pointwise", "mkl::_mkl_linear", "aten::linear")
_ALLOCS = ("aten::empty_strided", "aten::empty")


# -- a small ResNet (no downloads) ----------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """A ResNet-style convnet for 3x64x64 images: stem, three basic blocks, pool, fc (10 classes).
    Deterministic weights (fixed seed, a local generator) and non-trivial BN statistics."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(_Block(width, width, 1), _Block(width, 2 * width, 2),
                                    _Block(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, 10)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                    m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


# -- setup -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _inductor_patch(patch: dict[str, Any]) -> Iterator[None]:
    """Compile under ``patch`` on top of compiled replay's own Inductor settings (which the
    library applies innermost, so a plain outer ``config.patch`` could not override them)."""
    if not patch:
        yield
        return
    own = compile_settings.inductor_settings
    compile_settings.inductor_settings = lambda *args: {**own(*args), **patch}
    try:
        yield
    finally:
        compile_settings.inductor_settings = own


def _workload(name: str, batch: int) -> tuple[Callable[[], torch.Tensor], dict[str, Any]]:
    """The step to time (reads fixed input tensors) and a description of it."""
    if name == "decoder":
        cfg = DecoderConfig()
        model = Decoder(cfg)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        prompt = torch.randint(0, cfg.vocab_size, (cfg.max_batch, 16), generator=gen)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        positions = 16 + torch.arange(batch)
        with torch.inference_mode():
            model.prefill(prompt)
        return (lambda: model.decode_step(tokens, positions)), {"model": "Decoder", **cfg.as_dict()}
    if name == "convnet":
        net = SmallResNet()
        x = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(1))
        return (lambda: net(x)), {"model": "SmallResNet(width=16)", "input": [batch, 3, 64, 64],
                                  "parameters": sum(p.numel() for p in net.parameters())}
    raise SystemExit(f"unknown model {name!r}; use decoder or convnet")


def _capture(step: Callable[[], torch.Tensor], compile: str | None, options: dict[str, Any],
             patch: dict[str, Any]) -> tuple[Any, torch.Tensor, float]:
    clear_compile_cache()  # each variant compiles for itself (the cache ignores Inductor config)
    g = accel_graph.Graph(device="cpu", compile=compile, compile_options=options or None)
    t0 = time.perf_counter()
    with _inductor_patch(patch), torch.inference_mode():
        with accel_graph.graph(g):
            out = step()
        g.replay()
    return g, out, time.perf_counter() - t0


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# -- profiler split --------------------------------------------------------------------------
def _category(name: str) -> str | None:
    if name in _GEMMS:
        return "extern_gemm"
    if "cpp_fused" in name:
        return "cpp_kernels"
    if name in _ALLOCS:
        return "allocations"
    if name.startswith(("aten::", "mkldnn::", "mkl::")):
        return "other_aten"
    return None


def _profile_split(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Per-call microseconds by category under ``torch.profiler``: each event counted once, at
    its outermost categorized level (an addmm's inner copy_ is GEMM time). ``rest_python`` is
    the wall time no categorized event covers: Inductor's Python wrapper, AOT's runtime
    wrapper, our replay function, and the profiler's own cost."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        fn()
    t0 = time.perf_counter_ns()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    wall = (time.perf_counter_ns() - t0) / 1e3 / calls
    split = {"extern_gemm": 0.0, "cpp_kernels": 0.0, "allocations": 0.0, "other_aten": 0.0}
    counts = dict.fromkeys(split, 0)
    for ev in prof.events():
        cat = _category(ev.name)
        if cat is None:
            continue
        parent, inside = ev.cpu_parent, False
        while parent is not None and not inside:
            inside = _category(parent.name) is not None
            parent = parent.cpu_parent
        if not inside:
            split[cat] += ev.cpu_time_total / calls
            counts[cat] += 1
    split["rest_python"] = wall - sum(split.values())
    split["wall_under_profiler"] = wall
    split.update({f"{k}_calls": v / calls for k, v in counts.items()})
    return {k: round(v, 2) for k, v in split.items()}


def _gemm_floor(fn: Callable[[], object], reps: int = 200) -> dict[str, Any]:
    """The extern GEMMs of one step (names and shapes from one profiled call), re-run alone on
    fresh tensors of those shapes (the weight operand as a transposed view, as ``linear`` and
    Inductor pass it), timed without the profiler: the floor no wrapper change can go below."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    calls: list[Callable[[], object]] = []
    seen: list[str] = []
    for ev in prof.events():
        shapes = [list(x) for x in ev.input_shapes if isinstance(x, list)]
        if ev.name == "aten::mm" and len(shapes) >= 2 and len(shapes[0]) == 2:
            (m, k), n = shapes[0], shapes[1][1]
            a, b, o = torch.randn(m, k), torch.randn(n, k).t(), torch.empty(m, n)
            calls.append(lambda a=a, b=b, o=o: torch.mm(a, b, out=o))
        elif ev.name == "aten::addmm" and len(shapes) >= 3 and len(shapes[1]) == 2:
            (m, k), n = shapes[1], shapes[2][1]
            c, a, b, o = torch.randn(shapes[0]), torch.randn(m, k), torch.randn(n, k).t(), torch.empty(m, n)
            calls.append(lambda c=c, a=a, b=b, o=o: torch.addmm(c, a, b, out=o))
        else:
            continue
        seen.append(f"{ev.name}{shapes}")
    if not calls:
        return {"gemms": 0}

    def all_gemms() -> None:
        for call in calls:
            call()

    samples = interleaved_samples({"g": all_gemms}, rounds=reps // 10, calls_per_round=10, warmup=10)
    return {"gemms": len(calls), "median_us": round(statistics.median(samples["g"]) / 1e3, 2),
            "calls": seen}


# -- one model at one batch ------------------------------------------------------------------
def _run_case(model: str, batch: int, a: argparse.Namespace) -> dict[str, Any]:
    step, desc = _workload(model, batch)
    with torch.inference_mode():
        ref = step().clone()
    fns: dict[str, Callable[[], object]] = {"eager": step}
    info: dict[str, Any] = {"model": model, "batch": batch, "workload": desc, "variants": {}}
    graphs: list[Any] = []  # kept alive while timing
    g, out, secs = _capture(step, None, {}, {})
    graphs.append((g, out))
    fns["interpreted"] = g.replay
    info["variants"]["interpreted"] = {"capture_s": round(secs, 3), "max_abs_diff": _diff(out, ref)}
    for name in a.variants:
        options, patch = VARIANTS[name]
        g, out, secs = _capture(step, "inductor", options, patch)
        graphs.append((g, out))
        impl = g._impl  # the tool looks inside on purpose: it times the layers
        compiled = impl._compiled or {}
        info["variants"][name] = {"capture_and_compile_s": round(secs, 2), "max_abs_diff": _diff(out, ref),
                                  "compiled": {k: v for k, v in compiled.items() if k != "intermediates"}}
        if "fallback" in compiled:
            print(f"  {name}: fell back to interpreted replay: {compiled['fallback']}", file=sys.stderr)
            continue
        fns[f"compiled:{name}"] = g.replay
        if name == "default" and a.layers:
            # The backend's replay function (stale-input checks, then the compiled module), and
            # the compiled module alone (a compile-cache hit: the same module, no checks).
            fns["layer:backend_replay_fn"] = _under_inference(impl._replay_fn)
            run, _ = compile_program(impl._frozen_steps, impl._inputs, impl._outputs, impl._pool)
            fns["layer:compiled_module"] = _under_inference(run)
    if not a.no_torch_compile:
        tc = torch.compile(step, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = tc()
        info["variants"]["torch.compile"] = {"compile_s": round(time.perf_counter() - t0, 2),
                                             "max_abs_diff": _diff(out, ref)}
        fns["torch.compile"] = tc
    with torch.inference_mode():
        samples = interleaved_samples(fns, rounds=a.rounds, calls_per_round=a.calls, warmup=a.warmup)
    med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
    rows = []
    for k, us in med.items():
        rows.append({"variant": k, "median_us": round(us, 2), "x_eager": round(us / med["eager"], 4),
                     "x_interpreted": round(us / med["interpreted"], 4),
                     "x_torch_compile": round(us / med["torch.compile"], 4) if "torch.compile" in med else None})
    info["rows"] = rows
    if a.profile:
        g, out, _ = _capture(step, "inductor", {}, {"cpp.enable_kernel_profile": True})
        graphs.append((g, out))
        if "fallback" not in (g._impl._compiled or {}):
            with torch.inference_mode():
                info["profile_default"] = _profile_split(g.replay, a.profile_calls)
                info["extern_gemm_floor"] = _gemm_floor(g.replay)
    return info


def _under_inference(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> None:
        with torch._C._InferenceMode(True):
            fn()
    return run


def _print(case: dict[str, Any]) -> None:
    print(f"\n{case['model']} batch {case['batch']}")
    print(f"  {'variant':28s} {'median us':>10s} {'x eager':>8s} {'x interp':>9s} {'x t.compile':>11s}")
    for r in case["rows"]:
        tc = f"{r['x_torch_compile']:.3f}" if r["x_torch_compile"] is not None else "-"
        print(f"  {r['variant']:28s} {r['median_us']:10.1f} {r['x_eager']:8.3f} {r['x_interpreted']:9.3f} {tc:>11s}")
    for name, v in case["variants"].items():
        extra = {k: v[k] for k in v if k in ("capture_s", "capture_and_compile_s", "compile_s", "max_abs_diff")}
        print(f"  {name}: {extra}")
    if "profile_default" in case:
        print(f"  profiler split of compiled:default, us per call: {case['profile_default']}")
        floor = case["extern_gemm_floor"]
        print(f"  extern GEMMs of one step re-run alone: {floor.get('gemms')} calls, "
              f"{floor.get('median_us')} us")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["decoder", "convnet"], choices=["decoder", "convnet"])
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="default: 1 8 for the decoder, 1 4 for the convnet")
    p.add_argument("--variants", nargs="+", default=["default", "freeze"], choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-layers", dest="layers", action="store_false")
    p.add_argument("--profile", action="store_true", help="add the torch.profiler split (one more compile)")
    p.add_argument("--profile-calls", type=int, default=200)
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    load_start = os.getloadavg()
    cases = []
    for model in a.models:
        for b in a.batches or ([1, 8] if model == "decoder" else [1, 4]):
            case = _run_case(model, b, a)
            _print(case)
            cases.append(case)
    report = {"tool": "tools/profile_compiled.py", "argv": sys.argv[1:],
              "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "hardware": hardware_info(), "load_avg": {"start": load_start, "end": os.getloadavg()},
              "cases": cases}
    print(f"\nload average: start {load_start}, end {report['load_avg']['end']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
