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


def test_command_help_does_not_load_the_engine():
    """``accel-alloc <command> --help`` stays fast: the engine's module (and its C core) loads on
    the first simulation, not when a command's options are built (sim/scenario.py and
    tune/search.py import it inside the functions that run a replay)."""
    code = ("import sys\nfrom accel_graph.cli.alloc.main import main\n"
            "for cmd in ('tune', 'simulate', 'inspect', 'diff', 'validate'):\n"
            "    try:\n        main([cmd, '--help'])\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('accel_graph.allocator.core.engine', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
