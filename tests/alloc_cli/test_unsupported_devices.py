"""Traces from devices accel-alloc has no allocator model for are refused with exit 5 and a
way forward (``--device-type``), whether the file names the device or its frames imply it."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest

from accel_graph.allocator.sim.generate import generate
from accel_graph.allocator.traces import load_trace, save_trace
from accel_graph.cli.alloc import options


def _snapshot(tmp_path: Path, name: str, edit) -> Path:
    snap = generate("frag", seed=0).to_snapshot()
    snap.pop("allocator_settings", None)  # its CUDA variable name would imply cuda
    snap.pop("accel_graph", None)  # our metadata names the device
    edit(snap)
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap))
    return path


def test_named_unknown_device(cli, tmp_path):
    path = _snapshot(tmp_path, "tpu.pickle",
                     lambda s: s.__setitem__("accel_graph", {"device_type": "tpu"}))
    t = load_trace(path)
    assert t.device_type is None and t.unsupported_device == "tpu"
    for cmd in ("inspect", "simulate", "validate", "tune"):
        r = cli(cmd, path)
        assert r.code == options.EXIT_UNSUPPORTED, (cmd, r.code, r.err)
        assert "'tpu'" in r.err and "--device-type" in r.err
    r = cli("simulate", path, "--device-type", "cuda", "--json")
    assert r.code == 0 and r.json()["predicted"]["profile"] == "cuda-2.14"


def test_device_implied_by_frames(cli, tmp_path):
    def frames(s):
        for ev in s["device_traces"][0]:
            ev["frames"] = [{"filename": "/opt/conda/lib/python3.10/site-packages/torch_mlu/"
                             "memory.py", "line": 1, "name": "malloc"}]

    path = _snapshot(tmp_path, "mlu.pickle", frames)
    assert load_trace(path).unsupported_device == "mlu"
    r = cli("validate", path)
    assert r.code == options.EXIT_UNSUPPORTED and "'mlu'" in r.err


def test_known_devices_are_not_flagged(npu_dir):
    assert load_trace(npu_dir / "snapshot_expandable.pkl").unsupported_device is None


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_saved_traces_get_the_usual_file_mode(tmp_path):
    path = tmp_path / "t.json"
    old = os.umask(0o022)
    try:
        save_trace(generate("frag", seed=0), path, format="json")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_recorded_async_backend_is_said_and_not_validated(cli, tmp_path):
    t = generate("frag", seed=0)
    t.allocator_settings = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    path = tmp_path / "async.pickle"
    save_trace(t, path)
    r = cli("validate", path, "--json", "--max-error", "5")
    assert r.code == options.EXIT_CHECK_FAILED
    out = r.json()
    assert not out["comparable"] and not out["exact"]
    assert any("cudaMallocAsync" in n for n in out["notes"])
    r = cli("simulate", path, "--json")
    assert r.code == 0 and any("does not model" in n for n in r.json()["predicted"]["notes"])
    r = cli("simulate", path, "--cap", "1KiB")
    assert r.code == options.EXIT_CAP and "1.0 KiB" in r.err and "MiB" in r.err


def test_rmm_times_that_do_not_fit_drop_timestamps(cli, tmp_path):
    for bad in ("inf", "nan", "1e300", "-5"):
        log = tmp_path / f"t_{bad}.csv"
        log.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                       f"1,{bad},allocate,0x1000,512,0x0\n1,2.0,free,0x1000,512,0x0\n")
        assert not load_trace(log).has_time
        assert cli("simulate", log).code == 0


def test_absurd_cap_is_a_usage_error(cli, frag_trace):
    r = cli("simulate", frag_trace, "--cap", "1e30")
    assert r.code == options.EXIT_USAGE and "larger than any device" in r.err
