"""One file, two devices recorded under different settings (snapshot_with_multi_devices.pkl:
device 0 with expandable segments, device 1 native): each is validated under its own."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("device, allocs, maps, peak_mib", [(0, 0, 75, 614), (1, 52, 0, 526)])
def test_each_device_replays_under_its_own_settings(cli, npu_dir, device, allocs, maps, peak_mib):
    r = cli("validate", npu_dir / "snapshot_with_multi_devices.pkl", "--device", device, "--json")
    assert r.code == 0, r.err
    out = r.json()
    assert out["exact"], out["metrics"]
    assert out["metrics"]["segment_alloc"]["recorded"] == allocs
    assert out["metrics"]["segment_map"]["recorded"] == maps
    assert out["metrics"]["peak_reserved"]["simulated"] == peak_mib << 20


def test_tune_accuracy_on_the_native_device(cli, npu_dir):
    r = cli("tune", npu_dir / "snapshot_with_multi_devices.pkl", "--device", "1", "--json",
            "--budget", "8")
    assert r.code == 0, r.err
    assert r.json()["accuracy"]["peak_error_pct"] == 0.0
