"""``accel-graph bench --models`` plumbing (tiny counts, no Inductor) and the bundled ResNet.

No timing assertions: only the report's shape, statuses, that numbers present are positive and
finite, that failures are rows (never a crash), and the ResNet's determinism and shapes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import accel_graph.backends.recorder.compiled.choice as compiled_choice
from accel_graph.bench import models as bench_models
from accel_graph.cli.bench import format_models_report
from accel_graph.cli.main import main
from accel_graph.models import ResNet, ResNetConfig

TINY = ["--iters", "4", "--warmup", "1", "--calls-per-round", "2", "--seconds", "0.5"]
TINY_RESNET = ResNetConfig(widths=(4, 8), blocks=(1, 1), image_size=16, num_classes=10)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_models_report_no_compile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "models.json"
    threads = torch.get_num_threads()
    argv = ["bench", "--models", "--no-compile", *TINY, "--batch", "1", "--resnet-batch", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    table = capsys.readouterr().out
    report = json.loads(out.read_text())

    assert report["schema"] == bench_models.MODELS_SCHEMA
    assert report["settings"]["compile"] is False and report["settings"]["threads"] == 1
    assert report["inductor_warmup"] is None  # nothing compiles: no warm-up either
    assert set(report["models"]) == {"decoder", "resnet", "moe"}
    assert report["models"]["resnet"]["parameters"] > 0
    assert report["models"]["moe"]["num_experts"] == 8 and report["models"]["decoder"]["num_experts"] == 0
    assert report["settings"]["moe_batches"] == [1]
    assert set(report["variants"]) == set(bench_models.MODEL_VARIANTS)
    keys = {(r["model"], r["batch"], r["variant"]) for r in report["rows"]}
    assert keys == {(m, b, v) for m, b in (("decoder", 1), ("resnet", 2), ("moe", 1))
                    for v in bench_models.MODEL_VARIANTS}
    for row in report["rows"]:
        if row["variant"] in ("eager", "replay"):
            assert row["status"] == "ok", row
            assert all(_positive(row[k]) for k in ("median_us", "p10_us", "p90_us",
                                                    "ratio_vs_eager")), row
            assert row["samples"] == 4  # iters rounded to whole rounds of 2
            # Interpreted replay runs eager's kernels: bitwise equal, after timing too.
            assert row["matches_eager"] is True and row["bitwise_equal_to_eager"] is True
            assert row["max_abs_diff_vs_eager"] == 0.0
        else:  # never a number for a variant that did not run
            assert row["status"] == "skipped" and row["reason"] == "--no-compile"
            assert row["median_us"] is None and row["samples"] == 0
            assert row["matches_eager"] is None
        assert row["ratio_vs_torch_compile"] is None  # no torch.compile row to divide by
    eager = [r for r in report["rows"] if r["variant"] == "eager"]
    assert all(r["ratio_vs_eager"] == 1.0 for r in eager)
    replay = next(r for r in report["rows"] if r["variant"] == "replay" and r["model"] == "resnet")
    assert _positive(replay["capture_s"]) and replay["compile_s"] is None
    assert "skipped: --no-compile" in table and "resnet" in table and "x eager" in table
    assert "moe" in table


def test_failures_are_rows_not_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile raising, and compiled replay falling back to interpreted, are reported."""

    def refuse_compile(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler here\nsecond line")

    def refuse_program(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Inductor refused the program")

    monkeypatch.setattr(torch, "compile", refuse_compile)
    monkeypatch.setattr(compiled_choice, "compile_program", refuse_program)
    s = bench_models.ModelBenchSettings(models=("resnet",), resnet_batches=(1,), iters=2,
                                        calls_per_round=1, warmup=0, seconds=0.2,
                                        autotune=False, resnet=TINY_RESNET)
    report = bench_models.run_models_bench(s)
    assert report["inductor_warmup"]["status"] == "failed"  # the same refusal, reported
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["compile"]["status"] == "failed"
    assert rows["compile"]["reason"] == "RuntimeError: no C++ compiler here"
    assert rows["compile"]["median_us"] is None
    assert rows["compile_max_autotune"]["status"] == "skipped"
    assert rows["compile_max_autotune"]["reason"] == "--no-autotune"
    # Compiled replay fell back to interpreted: it still runs and says so.
    fell = rows["replay_compiled"]
    assert fell["status"] == "ok" and _positive(fell["median_us"]) and fell["matches_eager"]
    assert "Inductor refused the program" in fell["note"]
    table = format_models_report(report)
    assert "failed: RuntimeError: no C++ compiler here" in table
    assert "compile fell back" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--models", "--resnet-batch", "0"],
        ["bench", "--models", "--batch", "9"],
        ["bench", "--models", "--seconds", "0"],
        ["bench", "--models", "--resnet-batch", "2", "2"],
        ["bench", "--models", "--moe-batch", "0"],
        ["bench", "--models", "--only", "moe", "--moe-batch", "9"],
    ],
)
def test_models_bad_settings_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "accel-graph bench: error:" in capsys.readouterr().err


def test_resnet_is_deterministic_and_shaped() -> None:
    a, b = ResNet(TINY_RESNET), ResNet(TINY_RESNET)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    other = ResNet(dataclasses.replace(TINY_RESNET, seed=1))
    assert not torch.equal(other.head.weight, a.head.weight)
    assert not a.training  # built in eval mode: batch norm reads running statistics
    x = a.example_input(3)
    assert x.shape == (3, 3, 16, 16) and torch.equal(x, b.example_input(3))
    with torch.inference_mode():
        y = a(x)
        assert y.shape == (3, 10) and y.dtype == torch.float32 and torch.isfinite(y).all()
        assert torch.equal(y, b(x))
        # Rows are independent (eval-mode batch norm): row 0 alone gives row 0's logits.
        torch.testing.assert_close(a(x[:1]), y[:1])
        assert y.std() > 0  # not a constant output
    # The default is resnet18's topology: a stem, four stages of two blocks, a head.
    default = ResNet()
    assert [len(stage) for stage in default.stages] == [2, 2, 2, 2]
    assert default.head.out_features == ResNetConfig().num_classes


@pytest.mark.parametrize(
    "kwargs",
    [{"widths": (4, 8), "blocks": (1,)}, {"widths": ()}, {"blocks": (0, 1, 1, 1)},
     {"image_size": 0}],
)
def test_resnet_config_refuses_bad_sizes(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ResNetConfig(**kwargs)
    with pytest.raises(ValueError, match="batch"):
        ResNet(TINY_RESNET).example_input(0)


def test_moe_workload_replays_its_islands_and_reports_every_variant() -> None:
    """The ``moe`` workload (the MoE decode step at batch 1, experts as eager islands): both
    replays run and match eager (interpreted bitwise), and torch.compile(fullgraph=True), which
    cannot trace the host-reading experts loop, is a failed row with its reason, not a crash."""
    from accel_graph.models import DecoderConfig

    tiny = DecoderConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, mlp_hidden=48,
                         max_seq=32, num_experts=4, top_k=2)
    s = bench_models.ModelBenchSettings(models=("moe",), iters=2, calls_per_round=1, warmup=0,
                                        seconds=0.5, autotune=False, moe=tiny)
    report = bench_models.run_models_bench(s)
    assert report["models"]["moe"]["num_experts"] == 4
    rows = {r["variant"]: r for r in report["rows"]}
    assert [r["model"] for r in report["rows"]] == ["moe"] * len(bench_models.MODEL_VARIANTS)
    for variant in ("eager", "replay", "replay_compiled"):
        assert rows[variant]["status"] == "ok" and _positive(rows[variant]["median_us"]), rows[variant]
        assert rows[variant]["matches_eager"] is True, rows[variant]
    assert rows["replay"]["bitwise_equal_to_eager"] is True
    assert rows["replay_compiled"]["note"] is None  # compiled piecewise, no fallback
    assert rows["compile"]["status"] == "failed" and rows["compile"]["reason"], rows["compile"]
    assert rows["compile"]["median_us"] is None
    with pytest.raises(ValueError, match="num_experts > 0"):
        dataclasses.replace(s, moe=DecoderConfig()).validate()
