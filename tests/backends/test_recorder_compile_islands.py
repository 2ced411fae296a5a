"""Issue 26 item 3: ops Inductor refuses replay interpreted inside the compiled program (op
islands, ``backends/recorder/compiled/op_islands.py``); the rest of the graph compiles.

Refused ops are made here: a custom op without a fake kernel (predicted before compiling, as
``_grouped_mm`` in fp32 on the CPU is), a custom op whose Inductor lowering raises (named by the
failure), and a stand-in compiler refusing one op without naming it (bisected). Every compiled
result is compared with eager within the dtype's tolerance; the stand-in compiler interprets, so
its results are bitwise.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import pytest
import torch

import accel_graph as ag
import accel_graph.backends.recorder.compiled.choice as compiled_choice
from accel_graph.backends.recorder.compiled import inductor as compiled
from accel_graph.backends.recorder.compiled import op_islands
from accel_graph.backends.recorder.program import build_replay, materialize
from accel_graph.foundation.tolerances import assert_close_for_dtype

NS = "accel_graph_test_compile_islands"


@functools.cache
def _ops() -> Any:
    """Two custom ops, defined once per process (a library namespace cannot be redefined)."""
    @torch.library.custom_op(f"{NS}::no_fake", mutates_args=())
    def no_fake(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2  # no register_fake: Inductor cannot trace it

    @torch.library.custom_op(f"{NS}::bad_lowering", mutates_args=())
    def bad_lowering(x: torch.Tensor) -> torch.Tensor:
        return x.cos() * 3

    @bad_lowering.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return getattr(torch.ops, NS)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE_REPLAY", raising=False)
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE", raising=False)


def _capture(fn: Any, *args: Any) -> tuple[ag.Graph, Any]:
    g = ag.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with ag.graph(g):
        out = fn(*args)
    return g, out


def _dump(g: ag.Graph, tmp_path: Any) -> dict:
    path = str(tmp_path / "g.dot")
    g.debug_dump(path)
    with open(path + ".json") as f:
        return json.load(f)


def _replays_equal_eager(g: ag.Graph, out: Any, fn: Any, x: torch.Tensor, exact: bool = False) -> None:
    for k in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(k)) * (k + 1))
        g.replay()
        want = fn(x)
        if exact:
            assert torch.equal(out, want), k
        else:
            assert_close_for_dtype(out, want)


# -- a refused op in the middle: the rest compiles -------------------------------------------
def test_op_without_a_fake_kernel_is_predicted_and_the_rest_compiles(caplog, tmp_path) -> None:
    ops = _ops()

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x * 2 + 1)
        return torch.tanh(ops.no_fake(y)) + y

    x = torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="accel_graph"):
        g, out = _capture(fn, x)
        g.replay()
    info = g.compile_info()
    assert "fallback" not in info, info
    assert info["stretches"] == 2 and info.get("failed_compiles") is None, info
    [entry] = info["interpreted_ops"]
    assert entry["op"] == f"{NS}.no_fake.default" and entry["count"] == 1
    assert entry["found"] == "probed before compiling"
    assert entry["reason"].startswith("RuntimeError: There was no fake impl registered"), entry
    # the step named is the op in debug_dump's list, and the dump carries the same report
    dump = _dump(g, tmp_path)
    assert dump["ops"][entry["steps"][0]]["op"] == f"{NS}.no_fake.default"
    assert dump["compiled"]["interpreted_ops"] == info["interpreted_ops"]
    # logged once, with the prefix the test plug-in counts as a fallback in compiled cases
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and r.name == "accel_graph"]
    assert len(warned) == 1 and warned[0].startswith("compile='inductor' failed for some ops"), warned
    assert f"{NS}.no_fake.default x1" in warned[0]
    assert g.replay_mode().mode == "compiled"
    _replays_equal_eager(g, out, fn, x)


def test_lowering_failure_names_its_op_which_alone_replays_interpreted(monkeypatch) -> None:
    ops = _ops()
    from torch._inductor import lowering

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this lowering refuses")

    monkeypatch.setitem(lowering.lowerings, ops.bad_lowering.default, refuse)
    compiled.clear_compile_cache()

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.exp() - 1
        z = ops.bad_lowering(y * y)
        return torch.sigmoid(z) * y + ops.bad_lowering(z)

    x = torch.randn(8)
    try:
        g, out = _capture(fn, x)
        g.replay()
    finally:
        compiled.clear_compile_cache()
    info = g.compile_info()
    assert "fallback" not in info, info
    [entry] = info["interpreted_ops"]
    # both calls of the op named by Inductor's "target:" line: one failed compile, not two
    assert entry["op"] == f"{NS}.bad_lowering.default" and entry["count"] == 2, entry
    assert entry["found"] == "named by a compile failure"
    assert entry["reason"] == "LoweringException: RuntimeError: this lowering refuses"
    assert info["failed_compiles"] == 1 and info["stretches"] == 3, info
    _replays_equal_eager(g, out, fn, x)


# -- failures that name no op: bisected, bounded -----------------------------------------------
class RefusingCompiler:
    """Stands in for ``compile_program``: refuses (naming nothing) any stretch holding one of
    ``refused`` (op names such as ``"tan.default"``), else "compiles" it as the interpreted
    program over the same memory (so results are bitwise). Counts its calls."""

    def __init__(self, *refused: str, message: str = "refused, no reason given") -> None:
        self.refused = refused
        self.message = message
        self.calls: list[int] = []  # the size of each stretch it was given

    def __call__(self, steps: list, inputs: list, outputs: list, pool: Any) -> tuple[Any, dict]:
        self.calls.append(len(steps))
        if any(getattr(s.func, "__name__", "") in self.refused for s in steps):
            raise RuntimeError(self.message)
        return build_replay(materialize(steps, pool), []), {
            "backend": "inductor", "compile_s": 0.0, "cache": "miss", "fx_nodes": len(steps),
            "placeholders": 0, "attempt": "fake", "reuse": "compiled"}


def _chain(x: torch.Tensor) -> torch.Tensor:
    a = x.sin() + 1
    b = a * x
    c = b.tan()  # the op refused below
    d = c.exp().clamp(max=10) - b
    return d.cos() * a


def test_unnamed_failure_is_bisected_to_the_op(monkeypatch) -> None:
    fake = RefusingCompiler("tan.default")
    monkeypatch.setattr(compiled_choice, "compile_program", fake)
    x = torch.randn(6)
    g, out = _capture(_chain, x)
    g.replay()
    info = g.compile_info()
    assert "fallback" not in info, info
    [entry] = info["interpreted_ops"]
    assert entry["op"] == "aten.tan.default" and entry["found"] == "bisected", entry
    assert entry["reason"] == "RuntimeError: refused, no reason given"
    # failed: the program, the half holding tan, the quarter holding it, tan alone
    assert info["failed_compiles"] == len(fake.calls) - info["stretches"]
    assert info["failed_compiles"] <= op_islands.MAX_FAILED_COMPILES
    _replays_equal_eager(g, out, _chain, x, exact=True)


def test_bisection_stops_at_the_budget(monkeypatch) -> None:
    monkeypatch.setattr(op_islands, "MAX_FAILED_COMPILES", 2)
    fake = RefusingCompiler("tan.default")
    monkeypatch.setattr(compiled_choice, "compile_program", fake)
    x = torch.randn(6)
    g, out = _capture(_chain, x)
    g.replay()
    info = g.compile_info()
    assert info["fallback"] == "RuntimeError: refused, no reason given", info
    assert len(fake.calls) <= 2 + 3  # 2 failures allowed, the third gives up
    _replays_equal_eager(g, out, _chain, x, exact=True)


def test_everything_failing_falls_back_whole_with_the_reason(monkeypatch) -> None:
    fake = RefusingCompiler("sin.default", "add.Tensor", "mul.Tensor", "tan.default",
                            "exp.default", "clamp.default", "sub.Tensor", "cos.default")
    monkeypatch.setattr(compiled_choice, "compile_program", fake)
    x = torch.randn(6)
    g, out = _capture(_chain, x)
    g.replay()
    assert g.compile_info() == {"backend": "inductor", "fallback": "RuntimeError: refused, no reason given"}
    assert g.replay_mode().mode == "interpreted"
    # the program, then both halves of it failing without naming an op: no more compiles
    assert len(fake.calls) == 3, fake.calls
    _replays_equal_eager(g, out, _chain, x, exact=True)


def test_compiler_failure_is_not_bisected(monkeypatch) -> None:
    fake = RefusingCompiler("tan.default", message="CppCompileError: g++ not found")
    monkeypatch.setattr(compiled_choice, "compile_program", fake)
    x = torch.randn(6)
    g, out = _capture(_chain, x)
    g.replay()
    assert g.compile_info()["fallback"] == "RuntimeError: CppCompileError: g++ not found"
    assert len(fake.calls) == 1
    _replays_equal_eager(g, out, _chain, x, exact=True)


def test_a_program_of_refused_ops_only_falls_back_whole() -> None:
    ops = _ops()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ops.no_fake(x).view(2, -1)

    x = torch.randn(8)
    g, out = _capture(fn, x)
    g.replay()
    info = g.compile_info()
    assert info["fallback"].startswith("RuntimeError: There was no fake impl registered"), info
    _replays_equal_eager(g, out, fn, x, exact=True)


# -- rules that hold per stretch ---------------------------------------------------------------
def test_random_draws_around_an_island_equal_eager() -> None:
    ops = _ops()

    def fn(x: torch.Tensor) -> torch.Tensor:
        noisy = x + torch.rand_like(x)
        y = ops.no_fake(noisy)
        return y * torch.randn_like(y) + torch.rand(1)

    x = torch.randn(32)
    g, out = _capture(fn, x)
    for seed in (0, 1):
        torch.manual_seed(seed)
        g.replay()
        torch.manual_seed(seed)
        assert_close_for_dtype(out, fn(x))
    assert g.compile_info()["stretches"] == 2


def test_in_place_writes_around_an_island(monkeypatch) -> None:
    """A captured buffer written in place before and after the island, and an island output the
    next stretch reads after memory reuse: equal to eager over replays."""
    ops = _ops()
    acc = torch.zeros(8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        acc.add_(x)
        y = ops.no_fake(acc * 0.5)
        acc.mul_(0.9)
        t = (y + 1).relu()  # y dies here; its memory may serve the next allocations
        return (t * t).sum(0, keepdim=True) + acc[:1]

    x = torch.randn(8)
    g, out = _capture(fn, x)
    ref = torch.zeros(8)
    for k in range(3):
        x.copy_(torch.randn(8, generator=torch.Generator().manual_seed(k)))
        g.replay()
        acc_eager = acc.clone()
        acc.copy_(ref)
        want = fn(x)
        assert_close_for_dtype(acc, acc_eager)
        assert_close_for_dtype(out, want)
        ref = acc.clone()
    assert "fallback" not in g.compile_info()


def test_first_run_failure_still_falls_back_whole(monkeypatch) -> None:
    """A program with an op island whose compiled code fails at its first run: the run is
    undone (the island step is an ordinary op), replay falls back to interpreted, once."""
    ops = _ops()
    import torch._inductor.compile_fx as cfx

    real = cfx.compile_fx

    def compile_fx(gm: Any, example: Any, **kwargs: Any) -> Any:
        module = real(gm, example, **kwargs)

        def run(*args: Any) -> Any:
            module(*args)
            raise NameError("name 's7' is not defined")

        return run

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)
    compiled.clear_compile_cache()
    acc = torch.zeros(4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        acc.add_(ops.no_fake(x * 2))
        return acc + 1

    x = torch.randn(4)
    try:
        g, out = _capture(fn, x)
        g.replay()
    finally:
        compiled.clear_compile_cache()
    info = g.compile_info()
    assert info["fallback"] == "NameError: name 's7' is not defined" and info["failed_at"] == "first run"
    assert g.replay_mode().mode == "interpreted"
    want = ops.no_fake(x * 2)
    torch.testing.assert_close(acc, want)  # written once: the compiled run was undone
    torch.testing.assert_close(out, want + 1)


def test_refused_op_inside_a_cond_branch_is_an_island_of_that_branch(tmp_path) -> None:
    ops = _ops()

    def fn(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(p, lambda x: ops.no_fake(x + 1) * 3, lambda x: x.cos(), (x,)) - 1

    def eager(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # eager torch.cond traces its branches, which this op (no fake kernel) refuses
        return (ops.no_fake(x + 1) * 3 if bool(p) else x.cos()) - 1

    p, x = torch.tensor(True), torch.randn(5)
    g, out = _capture(fn, p, x)
    for flag in (True, False, True):
        p.fill_(flag)
        g.replay()
        assert_close_for_dtype(out, eager(p, x))
    true_branch = g.compile_info()["control_flow"][0]["subprograms"][0]
    assert true_branch["compiled"] is True, true_branch
    assert [e["op"] for e in true_branch["interpreted_ops"]] == [f"{NS}.no_fake.default"]


# -- transformers 5 MoE decoders with grouped_mm experts ----------------------------------------
@pytest.mark.parametrize("family", [
    "mixtral",
    pytest.param("qwen2_moe", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
])
def test_grouped_mm_moe_compiles_everything_but_the_grouped_gemms(family: str) -> None:
    """A decode step with a StaticCache: the grouped GEMMs (fp32 on the CPU, which Inductor's
    meta kernel refuses on torch 2.13/2.14) replay interpreted, everything else compiled; the
    logits equal eager's within fp32 tolerance, replay after replay."""
    from moe_models import build_moe, moe_decode_step, require_transformers_5

    transformers = require_transformers_5()
    model, _ = build_moe(family, experts="grouped_mm")
    step = moe_decode_step(model)
    prompt = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(3))
    caches = []
    for _ in range(2):  # the graph's and eager's, each holding the same prompt
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            model(input_ids=prompt, cache=cache)
        caches.append(cache)
    ids = torch.tensor([[1], [2]])
    g = ag.Graph(device="cpu", compile="inductor", compile_options={"replay": "compiled"})
    with torch.no_grad(), ag.graph(g):
        out = step(ids, caches[0])
    for tokens in ([[1], [2]], [[9], [3]], [[127], [0]]):
        ids.copy_(torch.tensor(tokens))
        g.replay()
        with torch.no_grad():
            want = step(torch.tensor(tokens), caches[1])
        assert_close_for_dtype(out, want)
    info = g.compile_info()
    assert "fallback" not in info, info
    [entry] = info["interpreted_ops"]
    layers = model.config.num_hidden_layers
    # two grouped GEMMs per experts module (gate-up, then down), one experts module per layer
    assert entry["op"] == "aten._grouped_mm.default" and entry["count"] == 2 * layers, entry
    assert entry["found"] == "probed before compiling"
    # torch 2.13: "Expected inputs of BF16 type but got mat_a.dtype=torch.float32 ...";
    # 2.14: "Expected mat_a to be BFloat16 or supported Float16 matrix, got torch.float32."
    assert entry["reason"].startswith("RuntimeError: Expected") and "float32" in entry["reason"], entry
    assert info["stretches"] == 2 * layers + 1 and info.get("failed_compiles") is None, info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_is_an_island_only_where_its_meta_kernel_refuses(dtype: torch.dtype) -> None:
    """The prediction probes the op's meta kernel on the recorded inputs: fp32 ``_grouped_mm``
    on the CPU is refused (torch 2.13/2.14), bf16 compiles; both replay equal to eager."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm in this torch")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 8, generator=gen).to(dtype)
    offs = torch.tensor([2, 5, 8], dtype=torch.int32)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x * 2)
        return torch.sigmoid(torch._grouped_mm(h, w, offs=offs)) + 1

    x = torch.randn(8, 16, generator=gen).to(dtype)
    g, out = _capture(fn, x)
    g.replay()
    info = g.compile_info()
    assert "fallback" not in info, info
    ops_interpreted = [e["op"] for e in info.get("interpreted_ops", [])]
    assert ops_interpreted == (["aten._grouped_mm.default"] if dtype == torch.float32 else []), info
    for k in range(2):
        x.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(k)).to(dtype))
        g.replay()
        assert_close_for_dtype(out, fn(x))
