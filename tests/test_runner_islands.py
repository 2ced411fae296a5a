"""Issue 26: ``GraphRunner(..., islands=[...])`` marks module types, instances and functions as
eager islands for the runner's captures, and a capture with islands puts back what its pieces
and islands wrote (a KV cache's length), for every bucket. Every result is compared with eager,
bitwise (the recorder's interpreted replay runs the same kernels)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from moe_models import MOE_FAMILIES, build_moe
from torch import nn

import accel_graph
from accel_graph.errors import CaptureError, ConfigError
from accel_graph.graphs.islands import is_eager_island
from accel_graph.runner.islands import RunnerIslands, resolve_islands


def doubled_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows with a positive sum doubled: ``nonzero`` has a data-dependent shape, so capture
    refuses it; as an island it runs eagerly. Row-wise, so padded rows change no live row."""
    out = x.clone()
    idx = (x.sum(1) > 0).nonzero()[:, 0]
    out[idx] = out[idx] * 2
    return out


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return doubled_rows(x)


class SubGate(Gate):
    """A subclass with its own forward: ``islands=[Gate]`` takes it in too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return doubled_rows(x) - 1


class Net(nn.Module):
    def __init__(self, gate: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = gate if gate is not None else Gate()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.inp(x)))


class FnNet(Net):
    """Calls the module-level function by name (a global lookup in this module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(doubled_rows(self.inp(x)))


def _net(cls: type = Net, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kw).eval()


def _serve_and_compare(runner: accel_graph.GraphRunner, model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (1, 2, 3, 4, 3, 1):
            x = torch.randn(n, 4, generator=gen)
            b = runner.bucket_for(n)  # eager at the padded shape: the same kernels, bitwise
            want = model(torch.cat([x, x.new_zeros(b - n, 4)]))[:n]
            assert torch.equal(runner(x), want), f"batch {n}"
    st = runner.stats()
    assert st["eager_calls"] == 0 and st["graph_calls"] == 6, st


@pytest.mark.parametrize("how", ["type", "instance", "string"])
def test_module_islands_capture_every_bucket_and_replay_equal_to_eager(how: str) -> None:
    model = _net()
    mark = {"type": Gate, "instance": model.gate, "string": f"{__name__}.Gate"}[how]
    runner = accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1, 2, 4],
                                     islands=[mark]).capture()
    assert runner.captured_buckets == [1, 2, 4]
    _serve_and_compare(runner, model)
    # Marked for the captures only: the class and the instance are as they were.
    assert "forward" not in vars(model.gate) and not hasattr(Gate.forward, "__wrapped__")
    assert not is_eager_island(model.gate)


def test_without_islands_the_same_model_cannot_be_captured() -> None:
    """The control: islands= is what makes the buckets capturable."""
    model = _net()
    runner = accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1, 2]).capture()
    assert runner.captured_buckets == []
    with pytest.raises(CaptureError):
        accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1], strict=True).capture()


def test_a_type_takes_in_subclasses_with_their_own_forward() -> None:
    model = _net(gate=SubGate())
    runner = accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1, 2, 4],
                                     islands=[Gate]).capture()
    assert runner.captured_buckets == [1, 2, 4]
    _serve_and_compare(runner, model)
    assert not hasattr(Gate.forward, "__wrapped__") and not hasattr(SubGate.forward, "__wrapped__")


@pytest.mark.parametrize("how", ["function", "string"])
def test_a_function_is_an_island_where_code_looks_it_up_by_name(how: str) -> None:
    model = _net(FnNet)
    mark = doubled_rows if how == "function" else f"{__name__}.doubled_rows"
    runner = accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1, 2, 4],
                                     islands=[mark]).capture()
    assert runner.captured_buckets == [1, 2, 4]
    _serve_and_compare(runner, model)
    assert sys.modules[__name__].doubled_rows.__code__ is doubled_rows.__code__
    assert not hasattr(sys.modules[__name__].doubled_rows, "__wrapped__")  # put back


def test_marking_is_off_on_other_threads_and_outside_the_block() -> None:
    """Another thread capturing the same model while a runner's marking is on sees no island
    (its capture refuses the host read); after the block, the class is plain again."""
    model = _net()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            g = accel_graph.Graph()
            with torch.no_grad(), accel_graph.graph(g):
                model(torch.zeros(2, 4))
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    with resolve_islands([Gate]).marking():
        assert hasattr(Gate.forward, "__wrapped__")  # wrapped, but not for the other thread
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], CaptureError), errors
    assert not hasattr(Gate.forward, "__wrapped__")


@pytest.mark.parametrize("bad, words", [
    (Gate, "not a list"),
    ("x", "not a list"),
    ([int], "not an nn.Module subclass"),
    ([3], "got 3"),
    ([lambda x: x], "no module global"),
    (["no_such_package_xyz.thing"], "cannot import"),
    ([f"{__name__}.nothing_here"], "cannot import"),
])
def test_bad_islands_get_a_clear_error(bad: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        accel_graph.GraphRunner(_net(), (torch.zeros(1, 4),), buckets=[1], islands=bad)


def test_no_islands_is_an_empty_marking() -> None:
    assert not resolve_islands(None) and not resolve_islands([])
    assert isinstance(resolve_islands([Gate]), RunnerIslands)
    assert resolve_islands([Gate]).names() == ["Gate"]


# --------------------------------------------------------------------------------------------
# capture with islands puts back what its pieces and islands wrote
# --------------------------------------------------------------------------------------------
class Cache:
    """A toy KV cache that counts its own length (as a transformers 5 StaticCache does)."""

    def __init__(self, bucket: int) -> None:
        self.keys = torch.zeros(bucket, 8, 4)
        self.length = torch.zeros((), dtype=torch.long)


def _cache_step(model: nn.Module):
    def step(x: torch.Tensor, *, state: Cache) -> torch.Tensor:
        h = model.inp(x)
        state.keys.index_copy_(1, state.length.view(1), h[:, None])  # written before the island
        state.length += 1
        g = model.gate(h)  # the island
        return model.out(g) * (state.length + 1) + state.keys.sum(1)

    return step


@pytest.mark.parametrize("capture", ["eager", "lazy"])
@pytest.mark.parametrize("marked", ["islands=", "eager_island"])
def test_capture_with_islands_puts_back_what_it_wrote(capture: str, marked: str) -> None:
    model = _net()
    if marked == "eager_island":  # marked for good, no islands=: the runner finds it anyway
        accel_graph.eager_island(model.gate)
    runner = accel_graph.GraphRunner(
        _cache_step(model), (torch.zeros(1, 4),), buckets=[1, 2, 4], state=Cache,
        capture=capture, islands=[Gate] if marked == "islands=" else None).capture()
    if capture == "eager":
        assert runner.captured_buckets == [1, 2, 4]
        for b in (1, 2, 4):  # the warm-up's one step is kept (as without islands), no more
            assert int(runner.state(b).length) == 1, b
            runner.state(b).length.zero_()
            runner.state(b).keys.zero_()
    eager = {b: Cache(b) for b in (1, 2, 4)}
    step = _cache_step(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, n in enumerate((1, 2, 3, 4, 1, 4, 2)):
            x = torch.randn(n, 4, generator=gen)
            b = runner.bucket_for(n)
            padded = torch.cat([x, x.new_zeros(b - n, 4)])
            want = step(padded, state=eager[b])[:n]
            got = runner(x)
            assert torch.equal(got, want), f"call {k}, batch {n}"
    for b in (1, 2, 4):
        assert torch.equal(runner.state(b).keys, eager[b].keys), b
        assert int(runner.state(b).length) == int(eager[b].length), b
    st = runner.stats()
    assert st["eager_calls"] == 0 and runner.captured_buckets == [1, 2, 4], st


def test_lazy_capture_with_islands_keeps_a_prefilled_transformers_cache_exact() -> None:
    """Lazy capture happens on a bucket's first decode call, after its prefill: the capture's
    real run of the pieces (which advances a StaticCache's ``cumulative_length``) is undone, so
    the tokens equal eager decoding."""
    from transformers import StaticCache

    model, config = build_moe("mixtral")
    block = type(model.model.layers[0].mlp)
    assert block.__name__ == MOE_FAMILIES["mixtral"].sparse_block

    def decode_step(input_ids: torch.Tensor, *, state: Any) -> torch.Tensor:
        return model(input_ids=input_ids, cache=state).logits[:, -1]

    runner = accel_graph.GraphRunner(
        decode_step, (torch.zeros(1, 1, dtype=torch.long),), buckets=[1, 2], capture="lazy",
        state=lambda b: StaticCache(config=config, max_cache_len=16), islands=[block]).capture()
    prompts = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, ref = runner.state(2), StaticCache(config=config, max_cache_len=16)
        tok = model(prompts, cache=cache).logits[:, -1].argmax(-1)
        ref_tok = model(prompts, cache=ref).logits[:, -1].argmax(-1)
        for _ in range(5):
            logits = runner(tok[:, None])
            want = model(ref_tok[:, None], cache=ref).logits[:, -1]
            assert torch.equal(logits, want)
            tok, ref_tok = logits.argmax(-1), want.argmax(-1)
    assert {int(layer.cumulative_length) for layer in cache.layers} == {4 + 5}
    assert runner.captured_buckets == [2] and runner.stats()["eager_calls"] == 0


def test_check_capturable_advice_names_the_runner_form_and_following_it_captures() -> None:
    model = _net()
    text = accel_graph.check_capturable(model, torch.zeros(2, 4), steps=1).format()
    assert "GraphRunner(..., islands=[<class>])" in text
    assert "mark Net.gate (Gate) as an eager island" in text and "islands=[Gate]" in text
    runner = accel_graph.GraphRunner(model, (torch.zeros(1, 4),), buckets=[1, 2, 4],
                                     islands=[Gate]).capture()
    assert runner.captured_buckets == [1, 2, 4]
    _serve_and_compare(runner, model)


def test_compiled_capture_with_islands_puts_back_what_it_wrote() -> None:
    """compile="inductor": each stretch between islands is its own program; the capture's real
    run of the pieces is put back all the same, and replays equal eager at the padded shape
    within the per-dtype tolerances (Inductor's kernels are not bitwise the eager ones)."""
    model = _net()
    runner = accel_graph.GraphRunner(_cache_step(model), (torch.zeros(1, 4),), buckets=[1, 2],
                                     state=Cache, islands=[Gate], compile="inductor").capture()
    assert runner.captured_buckets == [1, 2]
    info = runner.graph(2).compile_info()
    assert info["host_steps"] == 1 and not info.get("fallback"), info
    assert [int(runner.state(b).length) for b in (1, 2)] == [1, 1]  # the warm-up's step only
    eager = {b: Cache(b) for b in (1, 2)}
    for b in (1, 2):
        eager[b].keys.copy_(runner.state(b).keys)
        eager[b].length.copy_(runner.state(b).length)
    step = _cache_step(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (1, 2, 2, 1):
            x = torch.randn(n, 4, generator=gen)
            torch.testing.assert_close(runner(x), step(x, state=eager[n]))
    for b in (1, 2):
        torch.testing.assert_close(runner.state(b).keys, eager[b].keys)
        assert int(runner.state(b).length) == int(eager[b].length) == 3, b
    assert runner.stats()["eager_calls"] == 0


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_the_experts_class_as_island_decodes_equal_to_eager(family: str) -> None:
    """The smallest island check_capturable names (the experts module, by class): the router
    and Qwen2-MoE's shared expert stay in the graph; tokens and logits equal eager decoding."""
    from transformers import StaticCache

    model, config = build_moe(family)
    experts = type(model.model.layers[0].mlp.experts)
    assert experts.__name__ == MOE_FAMILIES[family].experts
    before = vars(experts).get("forward")

    def decode_step(input_ids: torch.Tensor, *, state: Any) -> torch.Tensor:
        return model(input_ids=input_ids, cache=state).logits[:, -1]

    runner = accel_graph.GraphRunner(
        decode_step, (torch.zeros(1, 1, dtype=torch.long),), buckets=[2],
        state=lambda b: StaticCache(config=config, max_cache_len=16), islands=[experts]).capture()
    assert runner.captured_buckets == [2]
    prompts = torch.randint(0, 128, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, ref = runner.state(2), StaticCache(config=config, max_cache_len=16)
        cache.reset()
        tok = model(prompts, cache=cache).logits[:, -1].argmax(-1)
        model(prompts, cache=ref)
        for _ in range(4):
            logits = runner(tok[:, None])
            assert torch.equal(logits, model(tok[:, None], cache=ref).logits[:, -1])
            tok = logits.argmax(-1)
    assert runner.stats()["eager_calls"] == 0
    assert vars(experts).get("forward") is before  # the class is as it was


class Hits(nn.Module):
    """An island whose output shape follows the data (the positive entries' indices)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > 0).nonzero().to(x.dtype)


def test_an_island_output_of_another_shape_raises_from_the_call_and_the_next_call_works() -> None:
    """No eager fallback for that call: the pieces before the island already ran (their writes
    to state happened), so running the step eagerly as well would apply them twice."""
    model = nn.Sequential(nn.Identity(), Hits())
    runner = accel_graph.GraphRunner(model, (torch.ones(2, 3),), buckets=[2], islands=[Hits],
                                     output_batch_dim=None, verify=False).capture()
    assert runner.captured_buckets == [2]
    x = torch.ones(2, 3)
    assert torch.equal(runner(x), model(x))
    with pytest.raises(accel_graph.ReplayError, match=r"eager island Hits\.forward .* shape \(3, 2\)"):
        runner(torch.tensor([[1.0, -1, -1], [1, 1, -1]]))
    y = torch.tensor([[2.0, 1, 3], [1, 4, 5]])
    assert torch.equal(runner(y), model(y)) and runner.captured_buckets == [2]


class Counter:
    def __init__(self, bucket: int) -> None:
        self.n = torch.zeros((), dtype=torch.long)


def _counted_hits(x: torch.Tensor, *, state: Counter) -> torch.Tensor:
    state.n += 1  # written before the island: by the replay's first piece
    return Hits()(x * 1) + state.n


def test_a_checked_replay_that_raises_disables_the_bucket_and_applies_the_step_once() -> None:
    """On a verified replay, the island's ReplayError is a failed check: the bucket is disabled
    with the island's error, the call returns eager's result, and the state holds eager's writes
    only (the replay's first piece had already counted)."""
    runner = accel_graph.GraphRunner(_counted_hits, (torch.ones(2, 3),), buckets=[2],
                                     islands=[Hits], output_batch_dim=None, state=Counter).capture()
    runner.state(2).n.zero_()
    ref = Counter(2)
    x = torch.tensor([[1.0, -1, -1], [1, 1, -1]])  # 3 hits where capture saw 6
    with torch.no_grad():
        assert torch.equal(runner(x), _counted_hits(x, state=ref))
    assert int(runner.state(2).n) == int(ref.n) == 1
    assert runner.captured_buckets == []
    reason = runner.stats()["eager_fallbacks"][0]["reason"]
    assert "ReplayError" in reason and "Hits.forward" in reason, reason
    with torch.no_grad():  # the padded fallback serves on, with the same state
        assert torch.equal(runner(torch.ones(2, 3)), _counted_hits(torch.ones(2, 3), state=ref))
    assert int(runner.state(2).n) == 2


def test_two_runners_naming_one_class_share_its_wrapper_until_the_last_capture_ends() -> None:
    plain = vars(Gate)["forward"]
    a, b = resolve_islands([Gate]), resolve_islands([Gate, SubGate])
    with a.marking():
        wrapped = vars(Gate)["forward"]
        assert wrapped is not plain and wrapped.__wrapped__ is plain
        with b.marking():
            assert vars(Gate)["forward"] is wrapped  # shared, not wrapped twice
        assert vars(Gate)["forward"] is wrapped  # a's capture still runs
    assert vars(Gate)["forward"] is plain and not hasattr(SubGate.forward, "__wrapped__")
