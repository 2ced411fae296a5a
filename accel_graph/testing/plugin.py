"""pytest plugin: run a test once per registered backend, on that backend's device.

Enable it with ``pytest_plugins = ["accel_graph.testing.plugin"]`` in a ``conftest.py``. It adds

- ``backend_name``: parametrized over every backend in the registry (built-ins and
  ``accel_graph.backends`` entry points), nothing hard-coded. A backend whose probe fails here is
  skipped with the probe's reason; a *built-in* that fails to import is an error, never a skip,
  because built-ins must import everywhere.
- ``backend``: the backend instance; ``device``: the ``torch.device`` to create tensors on (the
  backend's default device; any-device backends such as the recorder also run on the current
  accelerator, as ``recorder@cuda``). While a test runs, ``ACCEL_GRAPH_BACKEND`` names its
  backend, so ``accel_graph.Graph(device=device)``, ``graph_pool_handle(device)`` and
  ``is_current_stream_capturing(device)`` all route to it.
- ``make_graph``: ``make_graph(**kwargs)`` is ``accel_graph.Graph(device=device, **kwargs)``,
  checked to be on the parametrized backend.
- the ``gpu`` marker, put automatically on the cases of native-graph backends and on cases that
  run on an accelerator, so ``pytest -m gpu`` runs exactly what needs a real accelerator.
- ``--accel-graph-backend NAME[,NAME...]``: run only these backends.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from .. import config
from ..backends import BUILTIN_BACKENDS, get_backend, registered_backends, safe_probe
from ..backends.base import Backend

_OPTION = "--accel-graph-backend"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        _OPTION,
        action="store",
        default=None,
        metavar="NAME[,NAME...]",
        help="accel-graph: run backend-parametrized tests only on these backends",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu: needs a real accelerator (cases on native-graph backends get it automatically)",
    )


@functools.cache
def _probe(name: str) -> str | None:
    """The probe verdict of a registered backend (None: usable), cached for the session."""
    return safe_probe(registered_backends()[name])


def _broken_builtins() -> list[str]:
    """Built-ins that did not load: the registry drops them quietly, the tests must not."""
    loaded = registered_backends()
    return [name for name in BUILTIN_BACKENDS if name not in loaded]


def _is_native(name: str) -> bool:
    """Whether a backend replays real device graphs (so its cases need a GPU)."""
    classes = registered_backends()
    if name not in classes:
        return False
    if _probe(name) is None:
        return get_backend(name).capabilities().native_graphs
    # Unusable here, so it cannot be asked; a backend that serves neither the CPU nor any device
    # is a device-only one.
    return not {"cpu", "*"} & set(classes[name].device_types)


def _accelerator_type() -> str | None:
    """The current accelerator's device type, or None on a CPU-only host."""
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is not None and hasattr(acc, "current_accelerator"):
            dev = acc.current_accelerator() if acc.is_available() else None
            return None if dev is None else dev.type
        return "cuda" if torch.cuda.is_available() else None
    except Exception:  # no accelerator runtime: behave as a CPU-only host
        return None


def _targets(config: pytest.Config) -> list[tuple[str, str | None]]:
    """(backend name, device type or None for the backend's default device) to run on.

    Backends that serve any device (the recorder) run on their default device and, where an
    accelerator is present, on it too: that is the path MPS and PrivateUse1 devices take.
    """
    names = list(registered_backends()) + _broken_builtins()
    wanted = config.getoption(_OPTION)
    if wanted:
        keep = {w.strip().lower() for w in wanted.split(",") if w.strip()}
        names = [n for n in names if n in keep]
    targets: list[tuple[str, str | None]] = [(n, None) for n in names]
    acc = _accelerator_type()
    classes = registered_backends()
    for n in names:
        if acc is not None and n in classes and "*" in classes[n].device_types:
            targets.append((n, acc))
    return targets


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" not in metafunc.fixturenames:
        return
    targets = _targets(metafunc.config)
    with_device = "accel_graph_device_type" in metafunc.fixturenames
    if not with_device:  # the test never asks for a device: one case per backend
        targets = [(n, None) for n in dict.fromkeys(n for n, _ in targets)]
    params = []
    for name, dev in targets:
        ident = name if dev is None else f"{name}@{dev}"
        marks = [pytest.mark.gpu] if (dev is not None and dev != "cpu") or _is_native(name) else []
        values = (name, dev) if with_device else (name,)
        params.append(pytest.param(*values, id=ident, marks=marks))
    if not params:
        skip = pytest.mark.skip(reason=f"no backend selected (registry, {_OPTION})")
        values = (None, None) if with_device else (None,)
        params = [pytest.param(*values, id="no-backend", marks=skip)]
    argnames = ("backend_name", "accel_graph_device_type") if with_device else ("backend_name",)
    metafunc.parametrize(argnames, params)


def _import_error(name: str) -> BaseException | None:
    """Import a broken built-in again to get the real exception for the report."""
    module_name, _, attr = BUILTIN_BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
        if attr:
            getattr(module, attr)
    except Exception as exc:
        return exc
    return None


@pytest.fixture
def backend(backend_name: str) -> Backend:
    """The backend under test, or a skip with its probe's reason when it is unusable here."""
    if backend_name not in registered_backends():
        exc = _import_error(backend_name)
        pytest.fail(
            f"built-in backend {backend_name!r} ({BUILTIN_BACKENDS[backend_name]}) failed to load: "
            f"{type(exc).__name__ if exc else 'unknown'}: {exc}",
            pytrace=False,
        )
    reason = _probe(backend_name)
    if reason is not None:
        pytest.skip(f"backend {backend_name!r} unavailable: {reason}")
    return get_backend(backend_name)


@pytest.fixture
def accel_graph_device_type() -> str | None:
    """Parametrized by the plugin: a device type, or None for the backend's default device."""
    return None


@pytest.fixture
def device(
    backend: Backend, accel_graph_device_type: str | None, monkeypatch: pytest.MonkeyPatch
) -> torch.device:
    """The device to create tensors on; routing is pinned to ``backend`` for the test."""
    monkeypatch.setenv(config.BACKEND_VAR, type(backend).name)
    if accel_graph_device_type is None:
        return backend.default_device()
    return torch.device(accel_graph_device_type)


@pytest.fixture
def make_graph(backend: Backend, device: torch.device) -> Callable[..., Any]:
    """``make_graph(**kwargs)``: a new ``accel_graph.Graph`` on the backend and device under test."""
    from .. import Graph

    def make(**kwargs: Any) -> Graph:
        g = Graph(device=device, **kwargs)
        assert g.backend.name == type(backend).name, (
            f"Graph(device={device}) routed to {g.backend.name!r}, not {type(backend).name!r}"
        )
        return g

    return make
