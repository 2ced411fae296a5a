"""GraphRunner over the bundled decoder: greedy decoding through the runner equals eager."""

from __future__ import annotations

import torch

from accel_graph import GraphRunner
from accel_graph.models import Decoder, DecoderConfig, greedy_generate


def test_greedy_tokens_match_eager_for_mixed_batches() -> None:
    model = Decoder(DecoderConfig(max_batch=4, n_layers=1, max_seq=32))
    ex = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner = GraphRunner(model.decode_step, ex, buckets=[1, 2, 4], progress=False).capture()
    gen = torch.Generator().manual_seed(0)
    for b in (1, 3, 2, 4):
        prompt = torch.randint(0, 512, (b, 3), generator=gen)
        eager = greedy_generate(model, prompt, 8)
        graph = greedy_generate(model, prompt, 8, step=runner)
        assert torch.equal(eager, graph)
    st = runner.stats()
    assert st["eager_calls"] == 0
    assert st["padding_waste_rows"] == 10  # batch 3 padded to 4 for 10 steps
    assert all(b["verified"] for b in st["buckets"])
