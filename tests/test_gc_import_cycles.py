"""A module imported for the first time inside a captured step (torch imports ``torch._dynamo``
lazily this way; ``torch.fx.wrap`` keeps the importing frame in a local) leaves a reference
cycle holding the importing frames and the tensors they hold. Capture and the memory plan run
with the cyclic GC paused, so without ``ImportCycles.reclaim()`` between buckets that memory
stayed pinned and the first capture of a ladder took more pool than the next (one 2 MiB
segment on the bundled decoder)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import accel_graph
from accel_graph.foundation.gc_pause import ImportCycles, gc_paused

CYCLE = """import inspect


def _keep():
    here = inspect.currentframe()  # noqa: F841 - the cycle is the point


_keep()
"""


def _runner(name: str) -> accel_graph.GraphRunner:
    def step(x: torch.Tensor) -> torch.Tensor:
        big = x.repeat(1, 4096)  # 16 MiB of pool at bucket 16, held by this frame
        if accel_graph.is_current_stream_capturing():  # recording only, as the recorder's
            importlib.import_module(name)              # per-op planning imports torch._dynamo
        return big.sum(dim=1)

    return accel_graph.GraphRunner(step, (torch.ones(1, 64),), buckets=[1, 2, 4, 8, 16],
                                   verify=False, progress=False)


@pytest.mark.parametrize("how", ["capture", "plan"])
def test_first_time_import_inside_a_capture_pins_no_pool(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         how: str) -> None:
    name = f"agtest_frame_cycle_{how}"
    # A function of the module keeps its own frame in a local (garbage in a cycle once it
    # returns), and with it the frames that imported the module, as torch.fx.wrap does.
    (tmp_path / f"{name}.py").write_text(CYCLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)

    def pool(runner: accel_graph.GraphRunner) -> int:
        if how == "plan":
            return runner.plan_memory()["pool_reserved_bytes"]
        runner.capture()
        return runner.memory_report()["pool_reserved_bytes"]

    first = pool(_runner(name))   # imports the module inside the first bucket
    again = pool(_runner(name))   # imported already
    assert name in sys.modules
    assert first == again, (first, again)


def test_reclaim_collects_only_after_an_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("agtest_stays", "agtest_dropped"):
        (tmp_path / f"{name}.py").write_text("import inspect\n_frame = inspect.currentframe()\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with gc_paused():
        cycles = ImportCycles()
        assert cycles.reclaim() == 0  # nothing imported: no collection
        importlib.import_module("agtest_stays")
        importlib.import_module("agtest_dropped")
        del sys.modules["agtest_dropped"]  # now only its own cycle holds it
        assert cycles.reclaim() > 0  # a module was imported: the cycle is collected
        assert cycles.reclaim() == 0  # and nothing more until the next import
