"""Backend registry and routing.

Built-ins live in :data:`BUILTIN_BACKENDS` as lazy ``"module:Class"`` strings, so importing
this package imports no vendor module. Third parties add a device through the
``accel_graph.backends`` entry-point group: the entry point names a module that defines exactly
one concrete :class:`Backend` subclass, or the class itself.

Routing (see :func:`select_backend`): an explicit ``device=`` wins; then ``ACCEL_GRAPH_BACKEND``;
then the current device of the build's accelerator *if one is present* (device count > 0, read
by :mod:`.presence`); with no device present, the CPU recorder. A CUDA build on a GPU-less host
therefore routes to the recorder on the CPU; :func:`routing_report` says why.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from importlib.metadata import entry_points
from typing import Any

import torch

from ..errors import BackendUnavailable
from ..foundation import config
from .base import Backend, Capabilities, DeviceSpec, GraphImpl, PoolHandle, PoolStats
from .presence import ALWAYS_PRESENT, accelerator_presence, build_label, count_devices

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "Capabilities",
    "DeviceSpec",
    "GraphImpl",
    "PoolHandle",
    "PoolStats",
    "available_backends",
    "memory_planner",
    "current_backend",
    "get_backend",
    "probe_all",
    "register_backend",
    "registered_backends",
    "routing_report",
    "select_backend",
    "unregister_backend",
]

log = logging.getLogger("accel_graph")

#: Built-in backends: name -> "module:Class". Adding a device is one module and one line here.
BUILTIN_BACKENDS: dict[str, str] = {
    "cuda": "accel_graph.backends.cuda:CudaBackend",
    "hip": "accel_graph.backends.hip:HipBackend",
    "xpu": "accel_graph.backends.xpu:XpuBackend",
    "recorder": "accel_graph.backends.recorder:RecorderBackend",
}

ENTRY_POINT_GROUP = "accel_graph.backends"

_lock = threading.Lock()
_classes: dict[str, type[Backend]] | None = None
_instances: dict[str, Backend] = {}


def _load_class(target: str) -> type[Backend]:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        return getattr(module, attr)
    return _single_backend_class(module)


def _single_backend_class(module: object) -> type[Backend]:
    """The one concrete Backend subclass a plugin module defines (Triton's discovery rule)."""
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, Backend)
        and not inspect.isabstract(obj)
        and obj.__module__ == getattr(module, "__name__", None)
    ]
    if len(found) != 1:
        raise BackendUnavailable(
            f"backend plugin module {getattr(module, '__name__', module)!r} must define exactly one "
            f"concrete Backend subclass, found {len(found)}"
        )
    return found[0]


def _discover() -> dict[str, type[Backend]]:
    classes: dict[str, type[Backend]] = {}
    for name, target in BUILTIN_BACKENDS.items():
        try:
            classes[name] = _load_class(target)
        except Exception as exc:  # a broken built-in must not break the others
            log.debug("built-in backend %s failed to load: %s", name, exc)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            cls = obj if inspect.isclass(obj) else _single_backend_class(obj)
        except Exception as exc:
            log.warning("backend entry point %r failed to load: %s", ep.name, exc)
            continue
        if cls.name in classes:
            log.warning("backend entry point %r shadows built-in %r; ignored", ep.name, cls.name)
            continue
        classes[cls.name] = cls
    return classes


def registered_backends() -> dict[str, type[Backend]]:
    """Every loadable backend class by name (built-ins, then entry points). Cached."""
    global _classes
    with _lock:
        if _classes is None:
            _classes = _discover()
        return dict(_classes)


def register_backend(cls: type[Backend]) -> None:
    """Register a backend class at run time (tests, notebooks). Replaces one of the same name."""
    registered_backends()
    with _lock:
        assert _classes is not None
        _classes[cls.name] = cls
        _instances.pop(cls.name, None)
        _routes.clear()


def unregister_backend(name: str) -> None:
    """Remove a backend registered at run time."""
    registered_backends()
    with _lock:
        assert _classes is not None
        _classes.pop(name, None)
        _instances.pop(name, None)
        _routes.clear()


def _canonical(name: str) -> str:
    classes = registered_backends()
    key = name.strip().lower()
    if key in classes:
        return key
    for cname, cls in classes.items():
        if key in cls.aliases:
            return cname
    known = ", ".join(sorted(classes)) or "none"
    raise BackendUnavailable(
        f"no backend named {name!r} is registered (registered: {known}); "
        f"check the spelling or install the plugin that provides it"
    )


def safe_probe(cls: type[Backend]) -> str | None:
    """Run a probe and turn any exception into a reason: probes must never raise."""
    try:
        return cls.probe()
    except Exception as exc:  # a buggy probe says why instead of breaking routing
        return f"probe raised {type(exc).__name__}: {exc}"


def probe_all() -> dict[str, str | None]:
    """Every registered backend with its probe verdict (None means usable)."""
    return {name: safe_probe(cls) for name, cls in registered_backends().items()}


def available_backends() -> list[str]:
    """Names of the backends whose probe passes here."""
    return [name for name, reason in probe_all().items() if reason is None]


def get_backend(name: str) -> Backend:
    """The (cached) instance of the backend called ``name`` or one of its aliases.

    Raises ``BackendUnavailable`` naming what is registered when the name is unknown, and the
    probe's reason when the backend cannot be used here.
    """
    cname = _canonical(name)
    inst = _instances.get(cname)
    if inst is not None:
        return inst
    cls = registered_backends()[cname]
    reason = safe_probe(cls)
    if reason is not None:
        raise BackendUnavailable(f"backend {cname!r} is unavailable: {reason}")
    with _lock:
        inst = _instances.setdefault(cname, cls())
    return inst


def _serves(cls: type[Backend], device_type: str) -> bool:
    return device_type in cls.device_types


def select_backend(device: torch.device | str | int | None = None) -> tuple[Backend, torch.device]:
    """Pick the backend and concrete device for a graph, following the routing rules.

    1. ``device`` given: the highest-priority usable backend serving its type (the recorder,
       which serves any device, when no native one is usable); ``ACCEL_GRAPH_BACKEND`` may still
       force a backend that serves that device type. A device type with no device on this host
       (a CUDA build on a GPU-less machine, a broken driver) is ``BackendUnavailable`` saying
       what to do; an int is an index on the current accelerator.
    2. ``ACCEL_GRAPH_BACKEND`` set: that backend on its default device.
    3. A device of the build's accelerator present (device count > 0): the current device
       (``torch.accelerator.current_device_index()``) on its native backend, else the recorder.
    4. No device present (CPU build, accelerator build with 0 devices, counting failed): the
       recorder on the CPU; :func:`routing_report` says which and why.
    """
    forced = config.backend_override()
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else _index_device(device)
        _require_present(dev)
        if forced is not None:
            backend = get_backend(forced)
            if _serves(type(backend), dev.type) or "*" in type(backend).device_types:
                return backend, dev
            raise BackendUnavailable(
                f"ACCEL_GRAPH_BACKEND={forced} does not serve device {dev}; "
                f"unset it or pass a device it serves ({', '.join(type(backend).device_types)})"
            )
        return _backend_for_device(dev), dev
    if forced is not None:
        backend = get_backend(forced)
        return backend, backend.default_device()
    return _default_route(check_device=True)[:2]


def _default_route(check_device: bool) -> tuple[Backend, torch.device, str | None, str | None]:
    """Rules 3 and 4 of :func:`select_backend`: the backend, the device, why the CPU was chosen
    (None: it was not) and the error of a current device that failed its check (else None).

    With ``check_device`` a native backend must also describe the current device
    (``device_spec``, which reads its arch and so starts the runtime): a driver that fails there
    sends graphs to the recorder on the CPU with the error text, instead of failing ``Graph()``.
    """
    found = accelerator_presence()
    acc = found.device
    if acc is None:  # a CPU build needs no explanation; an accelerator build with none does
        level = None if found.device_type is None else logging.INFO
        return (*_cpu_route(f"{found.state()}: graphs use the recorder on the CPU", level), None)
    backend = _backend_for_device(acc)
    if check_device and backend.name != "recorder":
        try:
            backend.device_spec(acc)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            reason = (f"{found.state()}, but the {backend.name} backend cannot use {acc} "
                      f"({error}): graphs use the recorder on the CPU")
            return (*_cpu_route(reason, logging.WARNING), error)
    return backend, acc, None, None


_logged_routes: set[str] = set()


def _cpu_route(reason: str, level: int | None) -> tuple[Backend, torch.device, str]:
    # Logged once per distinct reason (level None: not at all): a GPU-less CUDA build routing
    # to the CPU is worth one line, not one per Graph(). A failing device is a WARNING.
    if level is not None and reason not in _logged_routes:
        _logged_routes.add(reason)
        log.log(level, "%s", reason)
    return get_backend("recorder"), torch.device("cpu"), reason


def _require_present(dev: torch.device) -> None:
    """Raise ``BackendUnavailable`` when no device of ``dev``'s type exists here (so an explicit
    ``device="cuda"`` on a GPU-less CUDA build fails at once, with the next step)."""
    if dev.type in ALWAYS_PRESENT:
        return
    count, error, source = count_devices(dev.type)
    if error is not None:
        raise BackendUnavailable(
            f"device {dev} is not usable: counting {dev.type} devices failed ({error}). Fix the "
            f"driver (for NVIDIA, nvidia-smi must list the GPU), or pass device='cpu' to capture "
            f"with the recorder on the CPU"
        )
    if count == 0:
        raise BackendUnavailable(
            f"device {dev} does not exist: this host has 0 {dev.type} devices "
            f"(build has {build_label(dev.type)}; per {source}). Pass device='cpu', or no "
            f"device= (which routes to the recorder on the CPU here), or run where a "
            f"{dev.type} device is visible"
        )


def _index_device(index: int) -> torch.device:
    found = accelerator_presence()
    if found.device_type is None:
        raise BackendUnavailable(
            f"device index {index} given but this host has no accelerator; pass device='cpu'"
        )
    return torch.device(found.device_type, index)


def routing_report(check_device: bool = False) -> dict[str, Any]:
    """Where ``Graph()`` without ``device=`` goes here and why (``accel-graph doctor``'s
    ``routing`` block). Never raises: a routing error is reported under ``error``.
    ``check_device=False`` (the doctor without ``--probe-devices``) skips the current-device
    check of :func:`select_backend`, which would start the device runtime.

    Keys: ``ACCEL_GRAPH_BACKEND``, ``backend``, ``device``, ``error``, ``accelerator`` (the
    build's accelerator and its devices, :meth:`.presence.AcceleratorPresence.as_dict`),
    ``device_error`` (the current device failed the native backend's check: the text) and ``reason``
    (one sentence, e.g. "build has CUDA 13.0, 0 device(s): graphs use the recorder on the CPU").
    """
    forced = config.backend_override()
    found = accelerator_presence()
    cpu_reason = device_error = None
    try:
        if forced is not None:
            backend, dev = select_backend(None)
        else:
            backend, dev, cpu_reason, device_error = _default_route(check_device)
        name, where, error = backend.name, str(dev), None
    except Exception as exc:  # the report must not crash (an unknown forced name, say)
        name, where, error = None, None, f"{type(exc).__name__}: {exc}"
    if forced is not None:
        reason = f"ACCEL_GRAPH_BACKEND={forced} forces the backend"
    elif cpu_reason is not None:
        reason = cpu_reason
    elif found.device is not None and name == "recorder":
        why = "; ".join(f"{n}: {r}" for n, r in probe_all().items()
                        if r is not None and _serves(registered_backends()[n], found.device.type))
        reason = (f"{found.state()}: graphs use the recorder on {where} (no native backend "
                  f"is usable{': ' + why if why else ''})")
    else:
        reason = f"{found.state()}: graphs use the {name} backend on {where} (the current device)"
    return {
        "ACCEL_GRAPH_BACKEND": forced,
        "backend": name,
        "device": where,
        "error": error,
        "accelerator": found.as_dict(),
        "device_error": device_error,
        "reason": reason if error is None else f"{reason}; but routing failed: {error}",
    }


_routes: dict[str, str] = {}


def _backend_for_device(dev: torch.device) -> Backend:
    # Probes are cheap but not free, and the reason a native backend was passed over is worth
    # one log line, not one per Graph(): routing is decided once per device type.
    name = _routes.get(dev.type)
    if name is not None and name in registered_backends():
        return get_backend(name)
    backend = _route(dev)
    _routes[dev.type] = backend.name
    return backend


def _route(dev: torch.device) -> Backend:
    classes = registered_backends()
    native = sorted(
        (cls for cls in classes.values() if _serves(cls, dev.type)),
        key=lambda c: -c.priority,
    )
    reasons = []
    for cls in native:
        reason = safe_probe(cls)
        if reason is None:
            return get_backend(cls.name)
        reasons.append(f"{cls.name}: {reason}")
    if reasons:
        log.info("no native graph backend usable for %s (%s); using the recorder", dev, "; ".join(reasons))
    return get_backend("recorder")


def current_backend() -> Backend:
    """The backend a ``Graph()`` without ``device=`` would use here."""
    return select_backend(None)[0]


def memory_planner(device: torch.device, settings: Any, policy: str = "native", *,
                   recycle: bool = True, record_events: bool = False) -> Any:
    """A memory planner (``accel_graph.backends.recorder.memory_plan.MemoryPlanner``): captures
    recorded on metadata and booked on an allocator engine under ``settings``
    (``EngineSettings``) and ``policy``, for ``GraphRunner.plan_memory()`` and
    ``plan_graph_memory()`` on every device. The recorder's recording serves every backend's
    plan (the registry is the one way to the recorder); it is imported on first use."""
    # Named by string, as the recorder backend itself (BUILTIN_BACKENDS): the registry is the
    # one way to the recorder, and only on first use.
    planner_class = importlib.import_module(f"{__name__}.recorder.memory_plan").MemoryPlanner
    return planner_class(device, settings, policy, recycle=recycle, record_events=record_events)
