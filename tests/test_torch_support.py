"""The verified torch releases and the one warning ``import accel_graph`` gives outside them.

Each import runs in a subprocess (the warning fires once per process, at import). Other
versions are presented by a stub ``torch`` module in ``sys.modules`` or by a stand-in ``torch``
package whose ``version.py`` names the version (the path taken when torch is not imported yet).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accel_graph.foundation import torch_support
from accel_graph.foundation.torch_support import VERIFIED, UnsupportedTorchWarning, release_of

REPORT = (
    "import sys, warnings\n"
    "with warnings.catch_warnings(record=True) as w:\n"
    "    warnings.simplefilter('always')\n"
    "    import accel_graph\n"
    "ours = [x for x in w if issubclass(x.category, accel_graph.UnsupportedTorchWarning)]\n"
    "print(len(ours)); print(ours[0].message if ours else '-'); print('torch' in sys.modules)\n"
)


def run(code: str, env_path: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-c", code]
    env = None
    if env_path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(env_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def stub_torch(version: str) -> str:
    return ("import sys, types\n"
            f"sys.modules['torch'] = types.SimpleNamespace(__version__={version!r})\n" + REPORT)


def test_release_parsing() -> None:
    assert release_of("2.14.1+cu130") == "2.14"
    assert release_of("2.11.0") == "2.11"
    assert release_of("2.15.0a0+git1234") == "2.15"
    assert release_of("nightly") is None
    assert set(VERIFIED) == {"2.11", "2.13", "2.14"}


def test_installed_torch_warns_exactly_when_unverified() -> None:
    lines = run(REPORT)
    verified = release_of(torch.__version__) in VERIFIED
    assert lines[0] == ("0" if verified else "1")
    assert lines[2] == "False"  # reading the version imported no torch


@pytest.mark.parametrize("version", ["2.9.1", "2.15.0a0+git1234", "3.0.0", "nightly"])
def test_unverified_torch_warns_once_naming_the_verified_ones(version: str) -> None:
    count, message, _ = run(stub_torch(version))
    assert count == "1"
    assert f"installed torch is {version}" in message
    assert "verified on torch 2.11, 2.13, 2.14" in message


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.14.1"])
def test_verified_torch_does_not_warn(version: str) -> None:
    assert run(stub_torch(version))[0] == "0"


def test_version_is_read_without_importing_torch(tmp_path: Path) -> None:
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    (fake / "version.py").write_text("__version__ = '2.99.0+cpu'\ncuda = None\n")
    count, message, imported = run(REPORT, tmp_path)
    assert count == "1" and "installed torch is 2.99.0+cpu" in message
    assert imported == "False"


def test_unreadable_version_never_crashes_the_import(tmp_path: Path) -> None:
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "version.py").write_bytes(b"\xff\xfe not python at all")
    count, _, _ = run(REPORT, tmp_path)
    assert count == "0"  # no version to judge: no warning, and above all no crash


def test_warning_category_and_return_value() -> None:
    assert issubclass(UnsupportedTorchWarning, UserWarning)
    with pytest.warns(UnsupportedTorchWarning, match="2.11, 2.13, 2.14"):
        assert torch_support.warn_if_unverified("2.12.0") is True
    assert torch_support.warn_if_unverified("2.14.1+cu130") is False
