"""Where a compiled program came from, in ``compile_info()`` (issue 29 item 12): the process-wide
module cache (``reuse == "in-process"``), Inductor's FX graph cache on disk (``"fx-graph-cache"``,
also across processes), or a fresh compile (``"compiled"``), with Inductor's reason when it
bypassed its cache. And a restarted process reuses a transformers decode step's programs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import accel_graph
from accel_graph.backends.recorder.compiled.cache import merge_reuse, watch_fx_graph_cache
from accel_graph.backends.recorder.compiled.inductor import clear_compile_cache

ROOT = Path(__file__).resolve().parents[2]


def _capture(fn, **compile_options):
    g = accel_graph.Graph(device="cpu", compile="inductor", compile_options=compile_options or None)
    with torch.inference_mode():
        with accel_graph.graph(g):
            out = fn()
        g.replay()
    info = g.compile_info()
    assert info is not None and "fallback" not in info, info
    return info, out


def test_reuse_reports_fresh_compile_then_in_process_then_fx_graph_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty on-disk cache
    clear_compile_cache()
    x = torch.randn(6)

    def program() -> torch.Tensor:
        return (x * 3 + 1).sin()

    first, out = _capture(program)
    assert (first["cache"], first["reuse"], first["fx_graph_cache"]) == ("miss", "compiled", "miss")
    assert "fx_graph_cache_bypass" not in first
    assert torch.allclose(out, (x * 3 + 1).sin())
    again, _ = _capture(program)  # the same program: this process's module cache
    assert (again["cache"], again["reuse"], again["fx_graph_cache"]) == ("hit", "in-process", None)
    clear_compile_cache()  # as a restarted process sees it: only the on-disk cache is left
    disk, out = _capture(program)
    assert (disk["cache"], disk["reuse"], disk["fx_graph_cache"]) == ("miss", "fx-graph-cache", "hit")
    assert torch.allclose(out, (x * 3 + 1).sin())


def test_freeze_bypass_is_reported_with_inductor_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    net, x = nn.Linear(8, 16).eval(), torch.randn(3, 8)
    codecache = logging.getLogger("torch._inductor.codecache")
    level = codecache.level
    info, out = _capture(lambda: net(x), freeze=True)
    assert codecache.level == level and not codecache.filters  # the probe leaves logging alone
    assert torch.allclose(out, net(x).detach(), atol=1e-5)
    assert info["frozen"] == 2 and info["reuse"] == "compiled"
    if torch.backends.mkldnn.is_available():
        # CPU freezing prepacks the weight as an mkldnn tensor, which Inductor's key cannot
        # pickle: every process compiles this program again, and compile_info says why.
        assert info["fx_graph_cache"] == "bypass"
        assert "mkldnn" in info["fx_graph_cache_bypass"], info
    else:
        assert info["fx_graph_cache"] == "miss"


def test_watch_reports_bypass_reason_and_unknown_is_not_a_hit() -> None:
    from torch._dynamo.utils import counters

    log = logging.getLogger("torch._inductor.codecache")
    with watch_fx_graph_cache() as seen:  # what Inductor does on a bypass (codecache.py)
        counters["inductor"]["fxgraph_cache_bypass"] += 1
        log.info("Bypassing FX Graph Cache because '%s'", "No shape env")
    assert seen == {"fx_graph_cache": "bypass", "bypass_reason": "No shape env", "reuse": "compiled"}
    with watch_fx_graph_cache() as seen:  # nothing consulted the cache
        pass
    assert seen["fx_graph_cache"] == "disabled" and seen["reuse"] == "compiled"


def test_merge_reuse_of_parts() -> None:
    assert merge_reuse([{"reuse": "in-process"}, {"reuse": "in-process"}])["reuse"] == "in-process"
    merged = merge_reuse([{"reuse": "fx-graph-cache"}, {"reuse": "compiled"}])
    assert merged == {"reuse": "mixed",
                      "reuse_counts": {"in-process": 0, "fx-graph-cache": 1, "compiled": 1}}


# A one-layer Qwen2 decode step (transformers 5 StaticCache) in a GraphRunner, as the recipe runs
# it (docs/recipes/transformers.md): the child prints each bucket's compile_info().
_CHILD = r"""
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache
import accel_graph
torch.manual_seed(int(sys.argv[1]))  # other weights in each process: only layouts are the key
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
model = Qwen2ForCausalLM(config).eval()
def decode_step(input_ids, *, state):
    return model(input_ids=input_ids, cache=state).logits[:, -1]
runner = accel_graph.GraphRunner(
    decode_step, (torch.zeros(1, 1, dtype=torch.long),), buckets=[1],
    state=lambda bucket: StaticCache(config=config, max_cache_len=16), compile="inductor",
).capture()
print("INFO" + json.dumps(runner.graph(1).compile_info(), default=str))
"""


def _child(seed: int, cache_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(seed)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("INFO"))
    return json.loads(line[4:])


def test_restarted_process_reuses_a_transformers_decode_step(tmp_path) -> None:
    pytest.importorskip("transformers")
    cold = _child(0, tmp_path)
    assert "fallback" not in cold, cold
    assert (cold["reuse"], cold["fx_graph_cache"]) == ("compiled", "miss"), cold
    warm = _child(1, tmp_path)  # a second process, the same on-disk cache
    assert "fallback" not in warm, warm
    assert (warm["reuse"], warm["fx_graph_cache"]) == ("fx-graph-cache", "hit"), warm
