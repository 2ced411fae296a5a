"""Benchmark: ``compile_options={"replay": ...}`` on the CPU recorder: eager (inference mode),
interpreted replay, compiled replay and ``"auto"`` (the program the choice kept), per model.

Models: a small ResNet-style convnet (eval mode: a pure program, decided at instantiation) at
batch 1 and 4, and the bundled decoder's decode step at batch 1 (it writes its KV cache in
place: decided on the first real replays). Interleaved rounds, medians, 1 torch thread. The
three graphs of a model share one compiled module (the process-wide program cache), so each
model compiles once.

    bash tools/dev.sh run python tools/bench_replay_choice.py [--rounds 31] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn as nn

import accel_graph
from accel_graph.models import Decoder, DecoderConfig


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


def convnet() -> nn.Module:
    """A small ResNet: stem, four residual blocks at 32 channels, pooling, a linear head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), *[_Block(32) for _ in range(4)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()


def _case(name: str, fn: Callable[[], Any], rounds: int) -> dict[str, Any]:
    graphs, outputs = {}, []
    t0 = time.perf_counter()
    for mode in ("compiled", "interpreted", "auto"):
        g = accel_graph.Graph(device="cpu", compile="inductor", compile_options={"replay": mode})
        with torch.no_grad(), accel_graph.graph(g):
            # Kept: a graph whose outputs nobody holds has none, and Inductor then drops all
            # the work (the compiled program would be timed doing nothing).
            outputs.append(fn())
        graphs[mode] = g
    setup_s = time.perf_counter() - t0
    runs: dict[str, Callable[[], Any]] = {"eager": fn, **{m: g.replay for m, g in graphs.items()}}
    for run in runs.values():  # warm-up; auto's first real replays decide where they must
        for _ in range(10):
            with torch.inference_mode():
                run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            with torch.inference_mode():
                t = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    with torch.inference_mode():
        want = fn()
    for out in outputs:  # every graph computed what eager computes (float-close)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    mode = graphs["auto"].replay_mode()
    return {"case": name, "median_ms": med, "auto": mode.as_dict(), "setup_s": setup_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    net = convnet()
    dec = Decoder(DecoderConfig())
    tok, pos = torch.tensor([3]), torch.tensor([5])
    cases = []
    for b in (1, 4):
        x = torch.randn(b, 3, 32, 32)
        cases.append(_case(f"convnet b{b}", lambda x=x: net(x), a.rounds))
    cases.append(_case("decoder step b1", lambda: dec.decode_step(tok, pos), a.rounds))
    print(f"{'case':<16} {'eager':>9} {'interp':>9} {'compiled':>9} {'auto':>9}  auto kept (decided at)")
    for c in cases:
        m = c["median_ms"]
        print(f"{c['case']:<16} {m['eager']:>8.3f}m {m['interpreted']:>8.3f}m {m['compiled']:>8.3f}m "
              f"{m['auto']:>8.3f}m  {c['auto']['mode']} ({c['auto']['decided_at']})")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average: {load}")
    if a.json:
        report = {
            "schema": "accel_graph.bench_replay_choice/1",
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "hardware": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
                         "torch": torch.__version__, "threads": 1, "load_average": load,
                         "python": sys.version.split()[0]},
            "rounds": a.rounds,
            "cases": cases,
        }
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
