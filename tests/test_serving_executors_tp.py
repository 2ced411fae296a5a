"""Executors over one rank's TPDecoder shard (issue 27): two gloo ranks run the same mixed flat
steps, eagerly and from token-bucketed graphs (collectives captured in every piece between
the attention islands); every rank returns the same tokens, equal to the single-process model
run alone on each request."""

from __future__ import annotations

from typing import Any

from test_serving_executors import CFG, reference, serve

from accel_graph.testing.distributed import run_ranks


def _tp_serve(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from accel_graph.serving.executors import EagerExecutor, GraphExecutor

    eager = EagerExecutor.from_config(CFG, tensor_parallel=True, max_tokens=16)
    graph = GraphExecutor.from_config(CFG, tensor_parallel=True, process_group=dist.group.WORLD,
                                      max_tokens=16, buckets=[4, 16], compile=None)
    return {"eager": serve(eager)[0], "graph": serve(graph)[0],
            "heads": eager.model.layers[0].k_cache.shape[1],
            "describe": graph.describe()}


def test_tp_executors_two_ranks() -> None:
    r0, r1 = run_ranks(_tp_serve, 2, timeout=150, pg_timeout=30)
    ref = reference()
    for r in (r0, r1):
        assert r["heads"] == CFG.n_heads // 2  # each rank holds its own heads' cache
        assert r["eager"] == ref, r["eager"]
        assert r["graph"] == ref, r["graph"]
        assert r["describe"]["tensor_parallel"] == 2 and r["describe"]["eager_steps"] == 0
