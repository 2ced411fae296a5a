"""Benchmark: what the control-flow mode costs a native capture on the host.

Every native capture (cuda, hip, xpu) runs its body under
:class:`accel_graph.backends.native.control_flow.ControlFlowMode`, a Python dispatch mode that
passes each op through (it acts only on torch.cond / torch.while_loop). On a GPU, capture time
is host time: dispatching the ops. This measures the same host work on the CPU: one decode
step of the bundled decoder, eager under ``torch.inference_mode`` (the baseline) against the same
step with the mode entered, in interleaved rounds, medians; and the same with a bare
pass-through ``TorchDispatchMode`` (what any Python mode costs, torch's own conditional-node
mode included). The difference per op is what the mode adds to each captured op; replay is
untouched (the mode is gone after capture).

    bash tools/dev.sh run python tools/bench_native_cf_mode.py [--rounds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel_graph.backends.native.control_flow import ControlFlowMode
from accel_graph.backends.native.control_flow_support import ControlFlowSupport
from accel_graph.models import Decoder, DecoderConfig


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))


class _Bare(TorchDispatchMode):
    """The cheapest possible dispatch mode: what any Python mode (torch's own
    CUDAGraphCaptureControlFlowOpDispatchMode included) costs per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def measure(name: str, fn: Callable[[], None], make_mode: Callable[[], TorchDispatchMode],
            rounds: int) -> dict[str, Any]:
    """Median host time of ``fn`` without and with the mode ``make_mode()``, interleaved."""
    with torch.inference_mode():
        count = _OpCount()
        with count:
            fn()
        for _ in range(3):
            fn()
        plain, moded = [], []
        for _ in range(rounds):  # interleaved: drift hits both alike
            t0 = time.perf_counter_ns()
            fn()
            plain.append(time.perf_counter_ns() - t0)
            mode = make_mode()
            t0 = time.perf_counter_ns()
            with mode:
                fn()
            moded.append(time.perf_counter_ns() - t0)
    p, m = statistics.median(plain) / 1e3, statistics.median(moded) / 1e3
    return {"workload": name, "ops": count.n, "eager_median_us": round(p, 1),
            "with_mode_median_us": round(m, 1), "added_per_op_us": round((m - p) / max(count.n, 1), 2),
            "ratio": round(m / p, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder(DecoderConfig()).eval()
    tokens = torch.zeros(args.batch, dtype=torch.long)
    pos = torch.zeros(args.batch, dtype=torch.long)
    support = ControlFlowSupport("bench", "CUDA", None, "n/a", "n/a")

    small = torch.zeros(8)

    def decode() -> None:
        model.decode_step(tokens, pos)

    def tiny() -> None:  # dispatch-bound: the mode's cost stands out from the kernels'
        for _ in range(200):
            small.add_(1)

    rows = []
    for name, fn in (("decoder step", decode), ("200 tiny add_", tiny)):
        for mode_name, make in (("ControlFlowMode", lambda: ControlFlowMode(support, "bench")),
                                ("bare TorchDispatchMode", _Bare)):
            rows.append({"mode": mode_name, **measure(name, fn, make, args.rounds)})
    print("| workload | mode | ops | eager (us) | with mode (us) | added/op (us) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['mode']} | {r['ops']} | {r['eager_median_us']} | "
              f"{r['with_mode_median_us']} | {r['added_per_op_us']} | {r['ratio']} |")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        out = {"tool": "bench_native_cf_mode", "created_utc": datetime.now(timezone.utc).isoformat(),
               "hardware": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
               "settings": {"rounds": args.rounds, "batch": args.batch, "torch": torch.__version__},
               "rows": rows}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
