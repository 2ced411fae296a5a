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
- compiled replay: a backend whose ``capabilities().compile`` is True (the recorder) runs each
  device test twice, as ``recorder`` (``ACCEL_GRAPH_COMPILE`` unset: interpreted replay) and as
  ``recorder+inductor`` (``ACCEL_GRAPH_COMPILE=inductor``: every ``Graph`` made without
  ``compile=`` is compiled at instantiation, and ``ACCEL_GRAPH_COMPILE_REPLAY=compiled``: it
  replays the compiled program whatever timing would pick). ``accel_graph_compile`` is the active mode (None or
  ``"inductor"``); :func:`accel_graph.testing.assert_replay_matches` compares bitwise or within
  tolerances accordingly. In a compiled case, a graph whose compilation failed and fell back to
  interpreted replay fails the test with the logged reason: a fallback must never pass silently.
- the ``gpu`` marker, put automatically on the cases of native-graph backends and on cases that
  run on an accelerator, so ``pytest -m gpu`` runs exactly what needs a real accelerator.
- ``--accel-graph-backend NAME[,NAME...]``: run only these backends; ``--accel-graph-compile
  MODE[,MODE...]`` (``none``, ``inductor``): run only these replay modes (``-k "not inductor"``
  works too).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch

from ..backends import BUILTIN_BACKENDS, get_backend, registered_backends, safe_probe
from ..backends.base import Backend
from ..backends.presence import accelerator_presence
from ..foundation import config

_OPTION = "--accel-graph-backend"
_COMPILE_OPTION = "--accel-graph-compile"
#: The compile modes a backend with ``capabilities().compile`` is run under (None: interpreted).
COMPILE_MODES: tuple[str | None, ...] = (None, "inductor")
#: What the recorder logs (logger ``accel_graph``) when compile="inductor" falls back.
FALLBACK_LOG_PREFIX = "compile='inductor' failed"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        _OPTION,
        action="store",
        default=None,
        metavar="NAME[,NAME...]",
        help="accel-graph: run backend-parametrized tests only on these backends",
    )
    parser.addoption(
        _COMPILE_OPTION,
        action="store",
        default=None,
        metavar="MODE[,MODE...]",
        help="accel-graph: replay modes for backends that compile (none, inductor; default: both)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu: needs a real accelerator (cases on native-graph backends get it automatically)",
    )
    config.addinivalue_line(
        "markers",
        "accel_graph_expected_fallback(reason): in compiled cases, graphs may fall back to "
        "interpreted replay for this documented reason (any other fallback still fails)",
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
    """The current accelerator's device type when a device of it is present, else None (a CPU
    build, or an accelerator build on a host with no such device: routing's own answer)."""
    dev = accelerator_presence().device
    return None if dev is None else dev.type


def _compiles(name: str) -> bool:
    """Whether ``compile=`` changes anything on a backend (only a usable one can be asked)."""
    return (
        name in registered_backends()
        and _probe(name) is None
        and bool(get_backend(name).capabilities().compile)
    )


def _compile_modes(config: pytest.Config, name: str) -> list[str | None]:
    """The replay modes to run ``name`` under: both where it compiles, else interpreted only."""
    if not _compiles(name):
        return [None]
    wanted = config.getoption(_COMPILE_OPTION)
    if not wanted:
        return list(COMPILE_MODES)
    keep = {w.strip().lower() for w in wanted.split(",") if w.strip()}
    unknown = keep - {"none", *(m for m in COMPILE_MODES if m)}
    if unknown:
        raise pytest.UsageError(
            f"{_COMPILE_OPTION}: unknown mode(s) {sorted(unknown)}; use none, inductor"
        )
    return [m for m in COMPILE_MODES if (m or "none") in keep]


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
    # Graphs are made on a device: only tests that ask for one get the device and compile variants.
    with_device = "accel_graph_device_type" in metafunc.fixturenames
    if not with_device:  # the test never asks for a device: one case per backend
        targets = [(n, None) for n in dict.fromkeys(n for n, _ in targets)]
    params = []
    for name, dev in targets:
        ident = name if dev is None else f"{name}@{dev}"
        marks = [pytest.mark.gpu] if (dev is not None and dev != "cpu") or _is_native(name) else []
        if not with_device:
            params.append(pytest.param(name, id=ident, marks=marks))
            continue
        for mode in _compile_modes(metafunc.config, name):
            suffix = "" if mode is None else f"+{mode}"
            params.append(pytest.param(name, dev, mode, id=ident + suffix, marks=marks))
    if not params:
        skip = pytest.mark.skip(
            reason=f"no backend selected (registry, {_OPTION}, {_COMPILE_OPTION})"
        )
        values = (None, None, None) if with_device else (None,)
        params = [pytest.param(*values, id="no-backend", marks=skip)]
    argnames = (
        ("backend_name", "accel_graph_device_type", "accel_graph_compile")
        if with_device
        else ("backend_name",)
    )
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
def accel_graph_compile() -> str | None:
    """Parametrized by the plugin: the compile mode of the case (None: interpreted replay)."""
    return None


class _FallbackLog(logging.Handler):
    """Collects the recorder's "compile='inductor' failed ..." warnings while a test runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(FALLBACK_LOG_PREFIX):
            self.reasons.append(record.getMessage())


_FALLBACKS = pytest.StashKey[_FallbackLog]()


@pytest.fixture
def device(
    request: pytest.FixtureRequest,
    backend: Backend,
    accel_graph_device_type: str | None,
    accel_graph_compile: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> Generator[torch.device, None, None]:
    """The device to create tensors on; routing is pinned to ``backend`` for the test, and the
    default ``compile=`` to the case's mode (``ACCEL_GRAPH_COMPILE``), set or cleared."""
    monkeypatch.setenv(config.BACKEND_VAR, type(backend).name)
    if accel_graph_compile is None:
        monkeypatch.delenv(config.COMPILE_VAR, raising=False)
        monkeypatch.delenv(config.COMPILE_REPLAY_VAR, raising=False)
    else:
        monkeypatch.setenv(config.COMPILE_VAR, accel_graph_compile)
        # Compiled cases test compiled code: replay="auto" would keep the interpreted program
        # wherever it timed faster, and the case would then test nothing compiled.
        monkeypatch.setenv(config.COMPILE_REPLAY_VAR, "compiled")
    dev = (
        backend.default_device()
        if accel_graph_device_type is None
        else torch.device(accel_graph_device_type)
    )
    if accel_graph_compile is None:
        yield dev
        return
    watch, logger = _FallbackLog(), logging.getLogger("accel_graph")
    level = logger.level
    if not logger.isEnabledFor(logging.WARNING):  # a quieted logger must not hide a fallback
        logger.setLevel(logging.WARNING)
    logger.addHandler(watch)
    request.node.stash[_FALLBACKS] = watch
    try:
        yield dev
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A compiled case in which a graph fell back to interpreted replay fails, with the reasons."""
    watch = item.stash.get(_FALLBACKS, None)
    try:
        result = yield
    except BaseException as exc:  # failed anyway: say whether a fallback was involved
        if watch is not None and watch.reasons and hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(_fallback_report(watch.reasons))
        raise
    if watch is not None and watch.reasons:
        marker = item.get_closest_marker("accel_graph_expected_fallback")
        expected = marker.args[0] if marker is not None and marker.args else None
        unexpected = [r for r in watch.reasons if expected is None or expected not in r]
        if unexpected:
            pytest.fail(_fallback_report(unexpected), pytrace=False)
    return result


def _fallback_report(reasons: list[str]) -> str:
    return (
        f"{len(reasons)} graph(s) fell back to interpreted replay in a compiled case:\n"
        + "\n".join(f"  {r}" for r in reasons)
    )


@pytest.fixture
def make_graph(backend: Backend, device: torch.device) -> Callable[..., Any]:
    """``make_graph(**kwargs)``: a new ``accel_graph.Graph`` on the backend and device under test."""
    from ..graphs.graph import Graph

    def make(**kwargs: Any) -> Graph:
        g = Graph(device=device, **kwargs)
        assert g.backend.name == type(backend).name, (
            f"Graph(device={device}) routed to {g.backend.name!r}, not {type(backend).name!r}"
        )
        return g

    return make
