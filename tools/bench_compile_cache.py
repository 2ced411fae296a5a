"""Cold vs warm compile of a transformers decode step across processes (issue 29 item 12).

Runs the same child twice with one new, empty ``TORCHINDUCTOR_CACHE_DIR``: a 1-layer Qwen2 decode
step (transformers 5, ``StaticCache``, built from a config: no download) captured by a compiled
``GraphRunner`` (docs/recipes/transformers.md). Each child reports its capture wall time and every
bucket's ``compile_info()``: ``compile_s``, ``reuse`` (``compiled``, ``fx-graph-cache``,
``in-process``) and ``fx_graph_cache`` (Inductor's hit, miss or bypass, with its reason). Prints a
table and writes JSON::

    python tools/bench_compile_cache.py [--layers 1] [--hidden 32] [--buckets 1,2] [--freeze]
                                        [--json out.json]

A benchmark, not a test (``tests/backends/test_recorder_compile_cache.py`` asserts the reuse).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache
import accel_graph
layers, hidden, buckets, freeze = json.loads(sys.argv[1])
torch.manual_seed(0)
config = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=64)
model = Qwen2ForCausalLM(config).eval()
def decode_step(input_ids, *, state):
    return model(input_ids=input_ids, cache=state).logits[:, -1]
t0 = time.perf_counter()
runner = accel_graph.GraphRunner(
    decode_step, (torch.zeros(1, 1, dtype=torch.long),), buckets=buckets,
    state=lambda bucket: StaticCache(config=config, max_cache_len=16), compile="inductor",
    compile_options={"freeze": True} if freeze else None,
).capture()
wall = time.perf_counter() - t0
infos = {b: runner.graph(b).compile_info() for b in runner.captured_buckets}
print("RESULT" + json.dumps({"capture_wall_s": wall, "buckets": infos}, default=str))
"""


def _child(cache: str, spec: list[Any]) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--buckets", default="1", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--freeze", action="store_true", help="compile_options={'freeze': True}")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    import torch

    spec = [a.layers, a.hidden, [int(b) for b in a.buckets.split(",")], a.freeze]
    with tempfile.TemporaryDirectory(prefix="accel-graph-cache-") as cache:
        runs = {"cold": _child(cache, spec), "warm": _child(cache, spec)}
    lines = [f"torch {torch.__version__}, Qwen2 layers={a.layers} hidden={a.hidden} "
             f"buckets={a.buckets} freeze={a.freeze}",
             f"{'process':<8} {'wall_s':>8} {'bucket':>6} {'compile_s':>9}  reuse / fx_graph_cache"]
    for name, run in runs.items():
        for b, info in run["buckets"].items():
            info = info or {}
            why = f" ({info['fx_graph_cache_bypass']})" if info.get("fx_graph_cache_bypass") else ""
            lines.append(f"{name:<8} {run['capture_wall_s']:>8.1f} {b:>6} "
                         f"{float(info.get('compile_s', 0.0)):>9.2f}  {info.get('reuse')} / "
                         f"{info.get('fx_graph_cache')}{why}{' FALLBACK' if 'fallback' in info else ''}")
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"torch": torch.__version__, "settings": vars(a),
                                            "runs": runs}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
