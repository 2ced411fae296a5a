"""``accel_graph.allocator`` exports its public names lazily, and without importing torch."""

from __future__ import annotations

import subprocess
import sys

import accel_graph.allocator as allocator


def test_exports_resolve_to_the_submodule_objects():
    from accel_graph.allocator import alloc_conf, traces
    from accel_graph.allocator.sim import replayer, scenario

    assert allocator.parse_config is alloc_conf.parse_config
    assert allocator.load_trace is traces.load_trace
    assert allocator.replay_trace is replayer.replay_trace
    assert allocator.simulate is scenario.simulate
    assert set(allocator.__all__) <= set(dir(allocator))


def test_allocator_tools_do_not_import_torch():
    code = ("import sys, accel_graph.allocator as a, accel_graph.cli.alloc.main, "
            "accel_graph.allocator.sim.replayer, accel_graph.allocator.sim.scenario; "
            "a.parse_config('expandable_segments:True'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
