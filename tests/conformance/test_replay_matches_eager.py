"""Replay at the captured shape matches eager on the same fresh inputs: bitwise when interpreted,
within the per-dtype tolerances when compiled (the ``+inductor`` cases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_graph
from accel_graph.testing import assert_bitwise_equal, assert_replay_matches, capture

from ._util import (
    check_replay_matches_eager,
    copy_into,
    expect_low_precision_fallback,
    gen,
    randint,
    randn,
)
from .models import MLP, DecodeStep, TransformerBlock, build


@pytest.mark.parametrize("keep_graph", [False, True], ids=["default", "keep_graph"])
def test_mlp(make_graph, device, keep_graph):
    model = build(MLP, device)
    check_replay_matches_eager(
        make_graph, model, lambda g: [randn(g, 4, 16, device=device)], keep_graph=keep_graph
    )


def test_weights_are_inputs_by_reference(make_graph, device):
    """Parameters are read at replay: weights copied in after capture (a LoRA swap, a weight
    reload) take effect without recapture."""
    model, fresh_model = build(MLP, device), build(MLP, device, seed=5)
    x = randn(gen(0), 4, 16, device=device)
    g = make_graph()
    out = capture(g, model, x)
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
            p.copy_(q)
    g.replay()
    assert_replay_matches(out, fresh_model(x))


def test_bucketed_graphs_on_views_of_one_static_input(make_graph, device):
    """The serving pattern: one static input of the largest batch, one graph per batch-size
    bucket on a leading slice of it, captured largest first into one shared pool."""
    model = build(MLP, device)
    x_max = randn(gen(0), 8, 16, device=device)
    pool = accel_graph.graph_pool_handle(device)
    graphs = {}
    for b in (8, 4, 2, 1):
        g = make_graph()
        graphs[b] = (g, capture(g, model, x_max[:b], pool=pool))
    for r, b in enumerate((2, 8, 1, 4, 8), start=1):
        fresh = randn(gen(r), b, 16, device=device)
        x_max[:b].copy_(fresh)
        g, out = graphs[b]
        g.replay()
        assert_replay_matches(out, model(fresh), msg=f"bucket {b}")


def test_capture_with_autograd_enabled(make_graph, device):
    """Capturing without no_grad() on parameters that require grad still replays right."""
    model = build(MLP, device).requires_grad_(True)
    check_replay_matches_eager(make_graph, model, lambda g: [randn(g, 4, 16, device=device)])


def test_two_models_share_a_pool(make_graph, device):
    block, mlp = build(TransformerBlock, device), build(MLP, device, 32, 64, 32)
    pool = accel_graph.graph_pool_handle(device)
    x = randn(gen(0), 2, 5, 32, device=device)
    g1, g2 = make_graph(pool=pool), make_graph(pool=pool)
    h = capture(g1, block, x)
    y = capture(g2, mlp, h)  # reads g1's output
    for r in range(1, 4):
        fresh = randn(gen(r), 2, 5, 32, device=device)
        x.copy_(fresh)
        g1.replay()
        g2.replay()
        eh = block(fresh)
        assert_replay_matches([h, y], [eh, mlp(eh)], msg=f"round {r}")


def test_transformer_block(make_graph, device):
    model = build(TransformerBlock, device)
    check_replay_matches_eager(make_graph, model, lambda g: [randn(g, 2, 5, 32, device=device)])


def test_decode_step_updates_kv_cache_in_place_at_replay(make_graph, device):
    captured, reference = build(DecodeStep, device), build(DecodeStep, device)
    x, pos = randn(gen(0), 2, 1, 32, device=device), torch.zeros(1, dtype=torch.long, device=device)
    captured(x, pos)  # warm-up writes the caches for real: start the comparison from empty ones
    captured.k_cache.zero_()
    captured.v_cache.zero_()
    g = make_graph()
    out = capture(g, captured, x, pos, warmup=0)
    # Capture runs no kernels: the in-place cache writes must wait for replay.
    assert torch.count_nonzero(captured.k_cache) == 0 and torch.count_nonzero(captured.v_cache) == 0

    for step in range(captured.max_len):
        fresh_x = randn(gen(100 + step), 2, 1, 32, device=device)
        fresh_pos = torch.tensor([step], device=device)
        copy_into([x, pos], [fresh_x, fresh_pos])
        g.replay()
        expected = reference(fresh_x, fresh_pos)
        assert_replay_matches(out, expected, msg=f"step {step}")
        assert_replay_matches(captured.k_cache, reference.k_cache, msg=f"k_cache after step {step}")
        assert_replay_matches(captured.v_cache, reference.v_cache, msg=f"v_cache after step {step}")
    assert torch.count_nonzero(captured.k_cache[:, :, -1]) > 0


def test_integer_tensor_indexing_is_legal(make_graph, device):
    def fn(x, rows, cols):
        a = x[rows]  # aten.index with an int64 tensor
        b = x[:, cols]
        c = x[rows, cols[: rows.numel()]]
        d = torch.index_select(x, 1, cols)
        e = torch.gather(x, 1, cols.expand(x.shape[0], -1))
        f = x.clone()
        f[rows] = 0.5  # index_put_ with an int64 tensor
        h = x[rows.int()]  # int32 indices
        return a, b, c, d, e, f, h

    check_replay_matches_eager(
        make_graph,
        fn,
        lambda g: [
            randn(g, 6, 5, device=device),
            randint(g, 6, 3, device=device),
            randint(g, 5, 4, device=device),
        ],
    )


def test_mixed_dtypes(make_graph, device, request):
    expect_low_precision_fallback(request, device)
    table = randn(gen(7), 10, 8, device=device)

    def fn(x, w, ids):
        h = x.to(torch.bfloat16) @ w  # bf16 matmul
        e = table[ids]  # fp32 gather by int64
        y = h.float() + e
        counts = (ids * 3 + 1).cumsum(0)  # int64 arithmetic
        promoted = x + ids[:, None]  # int64 + fp32 -> fp32
        return y, h, counts, promoted, (h * 2).sum(dtype=torch.float32), ids.max()

    check_replay_matches_eager(
        make_graph,
        fn,
        lambda g: [
            randn(g, 4, 8, device=device),
            randn(g, 8, 8, device=device, dtype=torch.bfloat16),
            randint(g, 10, 4, device=device),
        ],
    )


def test_ops_with_out_overloads(make_graph, device):
    """Functional ops that replay through their ``.out`` overload, including ones where the
    matching overload is not the first out-tagged one (``sum``, ``max.dim``, ``var_mean``)."""

    def fn(a, b):
        m = a @ b
        return (
            m,
            m.sum(),
            m.sum(dim=1),
            m.max(dim=0),
            torch.var_mean(m, dim=1),
            torch.topk(m, 2, dim=1),
            torch.sort(m, dim=0),
            torch.cumsum(m, 1),
            torch.where(m > 0, m, a[:, :1]),
            m.softmax(-1),
            F.layer_norm(m, (6,)),
            torch.cdist(a, b.t()),
        )

    check_replay_matches_eager(
        make_graph, fn, lambda g: [randn(g, 5, 4, device=device), randn(g, 4, 6, device=device)]
    )


def test_ops_without_out_overloads(make_graph, device, request):
    """Ops with no ``.out`` form: fused attention, casts, scalar tensors."""
    expect_low_precision_fallback(request, device)

    def fn(q, k, v):
        att = F.scaled_dot_product_attention(q, k, v)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (
            att,
            causal,
            q.to(torch.bfloat16),
            torch.where(q > 0, q, 0.0),
            q.to(torch.float64) * 2,
        )

    check_replay_matches_eager(
        make_graph, fn, lambda g: [randn(g, 1, 2, 5, 8, device=device) for _ in range(3)]
    )


def test_maybe_aliasing_ops_that_copy(make_graph, device):
    """reshape/contiguous/to copy here; writing the copy must not touch the source."""

    def fn(a):
        t = (a * 2).t()
        r = t.reshape(-1)  # non-contiguous: a copy
        r.add_(1)
        c = t.contiguous()  # transposed: a copy
        c.mul_(3)
        d = a.to(torch.float64)  # dtype change: a copy
        d.add_(1)
        return t, r, c, d

    g, _, (a,) = check_replay_matches_eager(
        make_graph, fn, lambda g: [randn(g, 3, 4, device=device)]
    )
    before = a.clone()
    g.replay()
    assert_bitwise_equal(a, before, msg="the static input was written through a copy")


def test_maybe_aliasing_ops_that_alias(make_graph, device):
    """view/reshape/flatten/contiguous/to alias here; writing the alias must reach the source."""
    w = randn(gen(3), 4, 5, device=device)

    def fn(a):
        y = a * 2
        v = y.view(-1)
        v[:3].add_(1)
        f = y.flatten()  # contiguous: a view
        f.mul_(2)
        r = y.reshape(4, 3)  # contiguous: a view
        r.sub_(1)
        s = y.to(torch.float32)  # same dtype: returns y itself
        s.add_(0.5)
        z = y.contiguous()  # already contiguous: returns y itself
        z.mul_(0.5)
        u = torch.matmul(a.t().unsqueeze(0).expand(2, 4, 3).contiguous(), a * 0 + 1)  # _unsafe_view
        u.view(-1)[0].add_(10)
        u2 = torch.matmul(y.t().contiguous().view(2, 2, 3), w[:3])
        return y, v, f, r, s, z, u, u2

    check_replay_matches_eager(make_graph, fn, lambda g: [randn(g, 3, 4, device=device)])


def test_constants_created_inside_capture(make_graph, device):
    """Factories inside the capture replay too: their values are right on every replay, even
    after the user overwrote the outputs and after temporaries' memory was reused."""

    def fn(x):
        ar = torch.arange(6, device=device, dtype=torch.float32)
        full = torch.full((6,), 2.5, device=device)
        tmp = x + torch.ones(6, device=device)  # the ones tensor dies here; its memory is reused
        tmp2 = tmp * torch.zeros_like(x).add_(3)
        eye = torch.eye(3, device=device)
        return x * full + ar - tmp2, ar, full, eye

    g, out, (x,) = check_replay_matches_eager(
        make_graph, fn, lambda g: [randn(g, 6, device=device)]
    )
    for t in out:
        t.fill_(-7.0)
    g.replay()
    assert_replay_matches(out, fn(x.clone()), msg="after the outputs were overwritten")


def test_python_constant_inside_capture(make_graph, backend, device):
    if backend.capabilities().native_graphs:
        pytest.skip(
            "torch.tensor(list, device=...) on an accelerator is a pageable host-to-device copy, "
            "which synchronises and is illegal under native capture"
        )

    def fn(x):
        c = torch.tensor([1.0, -2.0, 3.0, 0.5], device=device)
        return x * c, c

    g, out, (x,) = check_replay_matches_eager(
        make_graph, fn, lambda g: [randn(g, 4, device=device)]
    )
    out[1].zero_()
    g.replay()
    assert_replay_matches(out, fn(x.clone()), msg="after the constant output was overwritten")


def test_inplace_write_to_a_python_constant_inside_capture(make_graph, backend, device):
    """A constant made inside the capture and then modified in place must start from its
    literal value on every replay, as it does on every eager call."""
    if backend.capabilities().native_graphs:
        pytest.skip(
            "torch.tensor(list, device=...) is a pageable copy, illegal under native capture"
        )

    def fn(x):
        c = torch.tensor([1.0, -2.0, 3.0, 0.5], device=device)
        c.mul_(2)
        return x + c

    check_replay_matches_eager(make_graph, fn, lambda g: [randn(g, 4, device=device)])


def test_inplace_writes_to_existing_tensors_happen_at_replay(make_graph, device):
    acc = torch.zeros(6, device=device)
    out_buf = torch.full((6,), -1.0, device=device)
    grid = torch.zeros(6, 3, device=device)
    x = randn(gen(0), 6, device=device)

    def fn(x):
        acc.add_(x)
        torch.mul(x, 2, out=out_buf)
        grid[:, 1].copy_(x)
        return x * 3

    g = make_graph()
    y = capture(g, fn, x, warmup=0)
    assert torch.count_nonzero(acc) == 0, (
        "an in-place write to a pre-existing tensor ran at capture"
    )
    assert bool((out_buf == -1).all()), "an out= write to a pre-existing tensor ran at capture"
    assert torch.count_nonzero(grid) == 0, (
        "a copy_ into a view of a pre-existing tensor ran at capture"
    )

    e_acc, e_grid = torch.zeros(6, device=device), torch.zeros(6, 3, device=device)
    for r in range(1, 4):
        fresh = randn(gen(r), 6, device=device)
        x.copy_(fresh)
        g.replay()
        e_acc.add_(fresh)
        e_grid[:, 1].copy_(fresh)
        assert_replay_matches(
            [acc, out_buf, grid, y], [e_acc, fresh * 2, e_grid, fresh * 3], msg=f"replay {r}"
        )
