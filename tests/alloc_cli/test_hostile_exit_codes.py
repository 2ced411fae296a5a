"""Issue 14, item 8: hostile traces exit 4 (or 5, documented) from every command, never 70, and
``inspect --json`` prints output in proportion to the input."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from accel_graph.allocator.sim.generate import generate

COMMANDS = [["inspect", "--json"], ["simulate", "--json"], ["validate", "--json"],
            ["tune", "--json", "--budget", "3"], ["diff", "{trace}", "--json"],
            ["plot", "-o", "{dir}/o.svg"]]  # fmt: skip


def _argv(command: list[str], trace: Path) -> list[str]:
    return [command[0], str(trace)] + [a.format(trace=trace, dir=trace.parent) for a in command[1:]]


def _snapshot() -> dict:
    return generate("frag", seed=0).to_snapshot()


def test_big_integers_exit_4_from_every_command(tmp_path: Path, cli: Callable) -> None:
    snap = _snapshot()
    snap["device_traces"][0][1]["size"] = 10**5000  # str() of it raises: the message crashed
    path = tmp_path / "big.pkl"
    path.write_bytes(pickle.dumps(snap))
    for command in COMMANDS:
        run = cli(*_argv(command, path))
        assert run.code == 4 and "an integer of" in run.err, (command, run.code, run.err[-500:])


def test_more_than_64_streams_exits_5_but_inspects(tmp_path: Path, cli: Callable) -> None:
    snap = _snapshot()
    for i, e in enumerate(snap["device_traces"][0]):
        e["stream"] = i % 100
    path = tmp_path / "streams.pkl"
    path.write_bytes(pickle.dumps(snap))
    for command in COMMANDS:
        run = cli(*_argv(command, path))
        want = 0 if command[0] == "inspect" else 5
        assert run.code == want, (command, run.code, run.err[-500:])
        if want == 5:
            assert "100 streams" in run.err


@pytest.mark.parametrize("value", ["x", (1, 2, 3), (1 << 70, 2)])
def test_malformed_segment_pool_id_exits_4(tmp_path: Path, cli: Callable, value: object) -> None:
    snap = _snapshot()
    snap["segments"][0]["segment_pool_id"] = value
    path = tmp_path / "pool.pkl"
    path.write_bytes(pickle.dumps(snap))
    for command in COMMANDS:
        run = cli(*_argv(command, path))
        assert run.code == 4 and "segment_pool_id" in run.err, (command, run.code, run.err[-500:])


def test_inspect_json_of_memo_shared_settings_is_refused(tmp_path: Path, cli: Callable) -> None:
    node: list = ["x" * 50]
    for _ in range(30):
        node = [node, node]  # 2**30 leaves when printed; a few hundred bytes of pickle
    snap = _snapshot()
    snap["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "", "shared": node}
    path = tmp_path / "settings.pkl"
    path.write_bytes(pickle.dumps(snap))
    run = cli("inspect", path, "--json")
    assert run.code == 4 and "repeats shared objects" in run.err
    assert len(run.out) < 100 * path.stat().st_size
