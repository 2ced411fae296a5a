"""Issue 15 items 1-2: ``compile_options={"replay": ...}`` keeps the faster program without
changing anything observable, ``Graph.replay_mode()`` says which and why; a compile that fails
under the static-shape tracing context is retried without it, and a failure is reported by its
real cause with torch's ERROR records held back.

Most tests are plumbing tests: ``compile_program`` is replaced by a fake that replays the
interpreted program (optionally slowed down), so they are fast, deterministic (a sleep decides
which program is faster, never a measurement of real kernels) and bitwise comparable. A few use
real Inductor on small programs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

import accel_graph as ag
import accel_graph.backends.recorder.compiled.choice as compiled_choice
from accel_graph.backends.base import GraphImpl, ReplayMode
from accel_graph.backends.recorder.compiled import replay_choice
from accel_graph.backends.recorder.compiled.failures import failure_reason, quiet_torch_errors
from accel_graph.backends.recorder.program import build_replay, materialize
from accel_graph.errors import ConfigError
from accel_graph.foundation.compile_options import parse_compile_options

#: How much slower the slowed-down program is than the other (a tiny op runs in microseconds).
SLOW_S = 0.01


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE_REPLAY", raising=False)
    monkeypatch.delenv("ACCEL_GRAPH_COMPILE", raising=False)


class FakeCompiler:
    """Stands in for ``compile_program``: the "compiled" program is the interpreted one over
    the same memory, slowed down by ``delay`` seconds; counts its runs. It reports a compile
    time of ``compile_s`` (20 s: the largest timing budget, so a loaded machine still fits the
    rounds in it)."""

    def __init__(self, delay: float = 0.0, compile_s: float = 20.0) -> None:
        self.delay = delay
        self.compile_s = compile_s
        self.compiles = 0
        self.runs = 0

    def __call__(self, steps: list, inputs: list, outputs: list, pool: Any) -> tuple[Any, dict]:
        self.compiles += 1
        program = build_replay(materialize(steps, pool), [])

        def run() -> None:
            self.runs += 1
            if self.delay:
                time.sleep(self.delay)
            program()

        return run, {"backend": "inductor", "compile_s": self.compile_s, "cache": "miss",
                     "attempt": "fake"}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCompiler:
    compiler = FakeCompiler()
    monkeypatch.setattr(compiled_choice, "compile_program", compiler)
    return compiler


def _slow_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreted program (not the stale-input checks alone) ``SLOW_S`` slower."""
    real = compiled_choice.build_replay

    def slowed(steps: list, inputs: list) -> Any:
        fn = real(steps, inputs)
        if not steps:
            return fn

        def slow() -> None:
            time.sleep(SLOW_S)
            fn()

        return slow

    monkeypatch.setattr(compiled_choice, "build_replay", slowed)


def _graph(**options: Any) -> ag.Graph:
    return ag.Graph(device="cpu", compile="inductor", compile_options=options or None)


# -- item 1: which program replays --------------------------------------------------------------
def test_auto_keeps_interpreted_when_compiled_is_slower(fake: FakeCompiler) -> None:
    fake.delay = SLOW_S
    x = torch.randn(16)
    g = _graph()
    with g:
        y = x * 2 + 1
    mode = g.replay_mode()
    assert mode.mode == "interpreted" and mode.decided_at == "instantiate", mode
    assert mode.compiled_s is not None and mode.interpreted_s is not None
    assert mode.compiled_s > mode.interpreted_s and mode.rounds >= replay_choice.MIN_ROUNDS
    runs = fake.runs
    x.copy_(torch.arange(16.0))
    g.replay()
    assert fake.runs == runs, "the slower compiled program still replays"
    assert torch.equal(y, torch.arange(16.0) * 2 + 1)


def test_auto_keeps_compiled_when_it_is_faster(fake: FakeCompiler,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_interpreted(monkeypatch)
    x = torch.randn(16)
    g = _graph()
    with g:
        y = x - 3
    mode = g.replay_mode()
    assert mode.mode == "compiled" and mode.decided_at == "instantiate", mode
    assert mode.interpreted_s > mode.compiled_s  # type: ignore[operator]
    runs = fake.runs
    x.fill_(5.0)
    g.replay()
    assert fake.runs == runs + 1
    assert torch.equal(y, torch.full((16,), 2.0))


def test_a_program_too_slow_for_the_budget_decides_on_real_replays(fake: FakeCompiler) -> None:
    fake.compile_s = 0.0  # a cache hit: the smallest budget, which one slow run exceeds
    fake.delay = replay_choice.TIMING_MIN_S
    x = torch.randn(4)
    g = _graph()
    with g:
        y = x + 2
    assert fake.runs == 1, "timing went on after a run took over the budget"
    mode = g.replay_mode()
    assert mode.mode == "undecided" and "timing budget" in mode.reason, mode
    fake.delay = SLOW_S  # still the slower one, but quicker to replay
    for _ in range(2 * (1 + replay_choice.REPLAY_ROUNDS)):
        g.replay()
    mode = g.replay_mode()
    assert mode.mode == "interpreted" and mode.decided_at == "replay", mode
    assert torch.equal(y, x + 2)


@pytest.mark.parametrize("forced", ["compiled", "interpreted"])
def test_forcing_a_program_times_nothing(fake: FakeCompiler, monkeypatch: pytest.MonkeyPatch,
                                         forced: str) -> None:
    fake.delay = SLOW_S if forced == "compiled" else 0.0  # the forced one is the slower one
    if forced == "interpreted":
        _slow_interpreted(monkeypatch)
    x = torch.randn(8)
    g = _graph(replay=forced)
    with g:
        y = x.exp()
    mode = g.replay_mode()
    assert mode.mode == forced and "forced" in mode.reason and mode.compiled_s is None, mode
    assert fake.runs == 0, "a forced mode ran a program at instantiation"
    assert fake.compiles == (1 if forced == "compiled" else 0), "replay='interpreted' compiled"
    g.replay()
    assert fake.runs == (1 if forced == "compiled" else 0)
    assert torch.equal(y, x.exp())


def test_env_var_sets_the_default_and_is_checked(fake: FakeCompiler,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE_REPLAY", "compiled")
    g = _graph()
    with g:
        torch.ones(2) + 1
    assert g.replay_mode().mode == "compiled"
    # An explicit option wins over the variable.
    assert parse_compile_options({"replay": "auto"}, default_replay="compiled").replay == "auto"
    monkeypatch.setenv("ACCEL_GRAPH_COMPILE_REPLAY", "fastest")
    with pytest.raises(ConfigError, match="ACCEL_GRAPH_COMPILE_REPLAY='fastest'"):
        _graph()


def test_replay_mode_through_the_life_of_a_graph(fake: FakeCompiler) -> None:
    x = torch.randn(4)
    g = ag.Graph(keep_graph=True, device="cpu", compile="inductor")
    assert g.replay_mode().mode == "undecided"
    with g:
        x + 1
    before = g.replay_mode()
    assert before.mode == "undecided" and "not instantiated" in before.reason
    g.instantiate()
    assert g.replay_mode().mode in ("compiled", "interpreted")
    assert g.replay_mode().decided_at == "instantiate"
    g.reset()
    after = g.replay_mode()
    assert after.mode == "undecided" and "reset" in after.reason
    plain = ag.Graph(device="cpu")
    assert plain.replay_mode().mode == "interpreted" and "compile=None" in plain.replay_mode().reason


def test_native_backends_report_native() -> None:
    # The GraphImpl contract's default, which native backends (CUDA/HIP/XPU graphs) inherit.
    assert GraphImpl.replay_mode(None).mode == "native"  # type: ignore[arg-type]
    assert ReplayMode("native", "x").as_dict()["mode"] == "native"


def test_debug_dump_carries_the_mode(fake: FakeCompiler, tmp_path: Any) -> None:
    import json

    g = _graph()
    with g:
        torch.ones(3) * 2
    path = tmp_path / "g.dot"
    g.debug_dump(str(path))
    info = json.loads((tmp_path / "g.dot.json").read_text())["compiled"]
    assert info["replay_mode"] == g.replay_mode().as_dict()


# -- item 1: timing changes nothing observable ----------------------------------------------
def test_timing_keeps_poisoned_outputs_until_the_first_replay(fake: FakeCompiler) -> None:
    x = torch.ones(6)
    g = _graph()
    g.enable_debug_mode()
    with g:
        y = x + 1
    assert g.replay_mode().decided_at == "instantiate", g.replay_mode()
    assert torch.isnan(y).all(), "timing runs at instantiation wrote the outputs"
    g.replay()
    assert torch.equal(y, torch.full((6,), 2.0))


def _run_in_place(mode: str) -> tuple[torch.Tensor, ReplayMode]:
    cache = torch.zeros(5)
    step = torch.arange(5.0)
    g = _graph(replay=mode)
    with g:
        cache.add_(step)
        cache.mul_(1.5)
    first = g.replay_mode()  # instantiated at capture_end; nothing replayed yet
    for _ in range(13):
        g.replay()
    return cache, first


@pytest.mark.parametrize("slow", ["compiled", "interpreted"])
def test_in_place_input_writes_are_not_repeated_by_timing(fake: FakeCompiler,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          slow: str) -> None:
    if slow == "compiled":
        fake.delay = SLOW_S
    else:
        _slow_interpreted(monkeypatch)
    want, _ = _run_in_place("interpreted")
    got, first = _run_in_place("auto")
    assert first.mode == "undecided" and "writes memory the program did not allocate" in first.reason
    assert torch.equal(got, want)  # 13 replays' worth of writes, no more
    cache = torch.zeros(1)
    g = _graph()
    with g:
        cache.add_(1)
    for _ in range(replay_choice.REPLAY_ROUNDS * 2 + 2):
        g.replay()
    mode = g.replay_mode()
    assert mode.decided_at == "replay" and mode.mode == ("interpreted" if slow == "compiled" else "compiled")
    assert cache.item() == replay_choice.REPLAY_ROUNDS * 2 + 2


def test_random_draws_are_not_advanced_by_timing(fake: FakeCompiler) -> None:
    def run(mode: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(7)
        g = _graph(replay=mode)
        with g:
            y = torch.randn(4) + torch.rand(4)
        state = torch.get_rng_state()
        draws = []
        for _ in range(10):
            g.replay()
            draws.append(y.clone())
        return draws, state

    want, want_state = run("interpreted")
    got, got_state = run("auto")
    assert torch.equal(got_state, want_state), "timing at instantiation drew random numbers"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_batch_norm_running_stats_are_updated_once_per_replay(fake: FakeCompiler) -> None:
    def run(mode: str) -> torch.Tensor:
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(3).train()
        x = torch.randn(8, 3)
        g = _graph(replay=mode)
        with g:
            bn(x)
        for _ in range(9):
            g.replay()
        return bn.running_mean.clone()

    assert torch.equal(run("auto"), run("interpreted"))


def test_a_shared_pool_is_not_timed_at_instantiation(fake: FakeCompiler) -> None:
    pool = ag.graph_pool_handle("cpu")
    x = torch.ones(4)
    g1 = ag.Graph(device="cpu", compile="inductor", pool=pool)
    with g1:
        x * 2
    g2 = ag.Graph(keep_graph=True, device="cpu", compile="inductor", pool=pool)
    with g2:
        (x + 1).sum()
    g2.instantiate()
    mode = g2.replay_mode()
    assert mode.mode == "undecided" and "share its pool" in mode.reason, mode


def test_hazard_analysis_of_a_pure_program_and_a_reuse_of_pool_memory() -> None:
    x = torch.randn(8)
    g = ag.Graph(keep_graph=True, device="cpu")
    with g:
        a = x * 2
        b = a.relu_()  # an in-place write into memory the program allocated: harmless
        (b + 1).neg()
    assert replay_choice.instantiation_hazard(g._impl._frozen_steps) is None
    ext = replay_choice.Extents()
    from accel_graph.backends.recorder.pool_protocol import PoolRef

    f32 = torch.float32
    ext.add(PoolRef(-1, 0, (4,), (1,), f32))
    ext.add(PoolRef(-1, 32, (4,), (1,), f32))
    assert not ext.covers(PoolRef(-1, 0, (8,), (1,), f32))  # a gap at bytes 16-31
    ext.add(PoolRef(-1, 16, (4,), (1,), f32))
    assert ext.covers(PoolRef(-1, 0, (12,), (1,), f32))
    assert ext.overlaps(PoolRef(-1, 44, (4,), (1,), f32)) and not ext.overlaps(PoolRef(-1, 48, (2,), (1,), f32))


def test_a_decider_frees_with_its_graph(fake: FakeCompiler) -> None:
    import weakref

    cache = torch.zeros(2)
    g = _graph()
    with g:
        cache.add_(1)
    ref = weakref.ref(g._impl)
    g.replay()
    del g
    assert ref() is None, "the graph deciding on replays is kept alive by a reference cycle"


def test_real_inductor_auto_matches_forced_compiled() -> None:
    """Real Inductor, auto mode: a program writing an input in place gives what the forced
    compiled program gives, replay for replay (float-close to interpreted; here exact)."""
    def run(mode: str) -> torch.Tensor:
        acc = torch.zeros(32)
        w = torch.linspace(-1, 1, 32)
        g = _graph(replay=mode)
        with g:
            acc.add_(w.relu() * 2)
        for _ in range(10):
            g.replay()
        return acc

    assert torch.equal(run("auto"), run("compiled"))


# -- item 2: failures retried, reported by cause, quietly -------------------------------------
class _Inner(ValueError):
    pass


def _fails_under_static_context(real: Any) -> Any:
    def compile_fx(gm: Any, example: Any) -> Any:
        from torch._guards import TracingContext

        if TracingContext.try_get() is not None:
            logging.getLogger("torch._inductor.compile_fx").error("Traceback (most recent call last): ...")
            try:
                raise _Inner("Exponent must be non-negative")
            except _Inner as exc:
                raise RuntimeError("InductorError: wrapped") from exc
        return real(gm, example)

    return compile_fx


def test_any_failure_under_the_static_context_is_retried_without_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import json

    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", _fails_under_static_context(cfx.compile_fx))
    x = torch.randn(5)
    g = _graph(replay="compiled")
    with g:
        y = x.sin() * 3.25 + 0.5  # constants unlike any other test's: a cache miss
    g.debug_dump(str(tmp_path / "g.dot"))
    info = json.loads((tmp_path / "g.dot.json").read_text())["compiled"]
    assert "fallback" not in info, info
    assert info["attempt"] == "retried without the static-shape tracing context"
    g.replay()
    torch.testing.assert_close(y, x.sin() * 3.25 + 0.5)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _failing_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def compile_fx(gm: Any, example: Any) -> Any:
        logging.getLogger("torch._inductor.compile_fx").error("Traceback: the compiler's own")
        try:
            raise _Inner("Exponent must be non-negative")
        except _Inner as exc:
            raise RuntimeError("InductorError: ValueError: Exponent must be non-negative\n\n"
                               "Set TORCHDYNAMO_VERBOSE=1 for more") from exc

    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", compile_fx)


@pytest.mark.parametrize("debug", [False, True])
def test_a_failure_names_its_cause_and_torch_errors_stay_quiet_unless_debugging(
        monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    _failing_compile(monkeypatch)
    torch_records, ours = _Records(), _Records()
    # torch's own loggers do not propagate: "torch._inductor" is where its records end.
    logging.getLogger("torch._inductor").addHandler(torch_records)
    logger = logging.getLogger("accel_graph")
    logger.addHandler(ours)
    level = logger.level
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        x = torch.randn(3)
        g = _graph()
        with g:
            y = x.cos() - 7.75
        g.replay()
    finally:
        logging.getLogger("torch._inductor").removeHandler(torch_records)
        logger.removeHandler(ours)
        logger.setLevel(level)
    assert torch.equal(y, x.cos() - 7.75)
    errors = [r for r in torch_records.records if r.levelno >= logging.ERROR]
    # Two records per compile_program call (the static-shape attempt and its retry), three
    # calls: the program, then both halves of its bisection (op_islands.py), which fail naming
    # no op, so the graph falls back whole.
    assert (len(errors) == 6) if debug else (errors == []), [r.getMessage() for r in errors]
    warned = [r.getMessage() for r in ours.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "_Inner: Exponent must be non-negative" in warned[0], warned
    assert "C++ compiler" not in warned[0]
    mode = g.replay_mode()
    assert mode.mode == "interpreted" and "compilation failed" in mode.reason


def test_quiet_torch_errors_holds_back_only_this_threads_torch_errors() -> None:
    import threading

    records = _Records()
    # torch's loggers do not propagate past "torch"; "other" reaches the root.
    for name in ("torch", ""):
        logging.getLogger(name).addHandler(records)
    torch_child = logging.getLogger("torch.accel_graph_test.child")
    try:
        with quiet_torch_errors():
            torch_child.error("held")
            torch_child.warning("passes: a warning")
            logging.getLogger("other").error("passes: not torch")
            t = threading.Thread(target=lambda: torch_child.error("passes: other thread"))
            t.start()
            t.join()
        torch_child.error("passes: after")
    finally:
        for name in ("torch", ""):
            logging.getLogger(name).removeHandler(records)
    msgs = [r.getMessage() for r in records.records]
    assert "held" not in msgs and all(m.startswith("passes") for m in msgs) and len(msgs) == 4, msgs


def test_failure_reason_walks_to_the_innermost_meaningful_error() -> None:
    try:
        try:
            raise ValueError("Exponent must be non-negative")
        except ValueError as exc:
            raise RuntimeError("InductorError: ValueError: Exponent must be non-negative") from exc
    except RuntimeError as outer:
        assert failure_reason(outer) == "ValueError: Exponent must be non-negative"
    empty = AssertionError()
    try:
        raise RuntimeError("meta kernel refused fp32") from empty
    except RuntimeError as outer:
        assert failure_reason(outer) == "RuntimeError: meta kernel refused fp32"


@pytest.mark.slow
def test_real_failure_grouped_mm_fp32_is_reported_by_its_cause() -> None:
    """torch 2.13's and 2.14's ``_grouped_mm`` meta kernels refuse fp32 (eager CPU runs it):
    Inductor fails with and without the static-shape context, and the log names the meta
    kernel's words (read from the meta kernel itself: 2.13 says "BF16", 2.14 "BFloat16")."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    a, b = torch.randn(8, 16), torch.randn(2, 16, 4)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    try:
        want = torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as exc:
        pytest.skip(f"eager _grouped_mm fails on this CPU build: {exc}")
    try:
        torch._grouped_mm(a.to("meta"), b.to("meta"), offs=offs.to("meta"))
    except RuntimeError as exc:
        meta_words = str(exc).strip().splitlines()[0]
    else:
        pytest.skip("this torch's _grouped_mm meta kernel accepts fp32: nothing fails to report")
    ours = _Records()
    logger = logging.getLogger("accel_graph")
    logger.addHandler(ours)
    try:
        g = _graph()
        with g:
            y = torch._grouped_mm(a, b, offs=offs)
    finally:
        logger.removeHandler(ours)
    warned = [r.getMessage() for r in ours.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and meta_words in warned[0] and "C++ compiler" not in warned[0], warned
    g.replay()
    assert torch.equal(y, want)
