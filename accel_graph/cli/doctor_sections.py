"""The sections of ``accel-graph doctor``'s report: one function per top-level key.

Contract: each function returns one JSON-ready section (schema in docs/doctor.md) and appends
what it finds wrong to the ``problems`` list it is given, where it takes one; a section that
raises is caught by :func:`accel_graph.cli.doctor.collect`, which reports it as a problem. The
backend and allocator modules are imported inside the functions on purpose: a backend that
fails to import must become a problem in the report, not stop the command.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..backends.device_facts import safe as _safe

if TYPE_CHECKING:
    from ..backends.base import Backend

__all__ = [
    "allocator_section",
    "backend_entries",
    "graph_apis_section",
    "jsonable",
    "plugin_status",
    "recorder_section",
    "routing_section",
    "sectioned_backends",
    "torch_section",
    "versions_section",
]


def jsonable(obj: Any) -> Any:
    """``obj`` with mappings and sequences rebuilt and anything else JSON cannot hold as str."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def sectioned_backends() -> list[type[Backend]]:
    """The registered backends that contribute a section of their own (``doctor_key``)."""
    from ..backends import registered_backends

    return [cls for cls in registered_backends().values() if getattr(cls, "doctor_key", None)]


def torch_section() -> dict[str, Any]:
    """The installed torch: version, build flavours, whether it is a verified release."""
    from ..foundation.torch_support import VERIFIED, is_verified

    v = torch.version
    return {
        "verified": is_verified(torch.__version__),
        "verified_releases": list(VERIFIED),
        "version": torch.__version__,
        "git_version": getattr(v, "git_version", None),
        "cuda": getattr(v, "cuda", None),
        "hip": getattr(v, "hip", None),
        "xpu": getattr(v, "xpu", None),
        "debug": bool(getattr(v, "debug", False)),
    }


def versions_section(problems: list[str]) -> dict[str, Any]:
    """Every registered backend's ``doctor_versions()``, in registry order."""
    from ..backends import registered_backends

    out: dict[str, Any] = {}
    for cls in registered_backends().values():
        got, err = _safe(cls.doctor_versions, {})
        out.update(got)
        if err:
            problems.append(f"doctor could not collect 'versions' of {cls.name}: {err}")
    return out


def backend_entries() -> tuple[list[dict[str, Any]], list[str]]:
    from ..backends import BUILTIN_BACKENDS, get_backend, registered_backends, safe_probe

    problems: list[str] = []
    entries: list[dict[str, Any]] = []
    classes = registered_backends()
    for name, target in BUILTIN_BACKENDS.items():
        if name in classes:
            continue
        module_name, _, _ = target.partition(":")
        _, err = _safe(lambda m=module_name: importlib.import_module(m))
        entries.append({
            "name": name, "aliases": [], "device_types": [], "priority": None, "origin": "builtin",
            "class": target, "usable": False,
            "reason": f"failed to load: {err or 'class not found'}",
            "capabilities": None, "facts": {},
        })  # fmt: skip
        problems.append(f"built-in backend {name!r} failed to load: {err}")
    for name, cls in classes.items():
        target = f"{cls.__module__}:{cls.__qualname__}"
        builtin = BUILTIN_BACKENDS.get(name)
        origin = "builtin" if builtin and builtin.partition(":")[0] == cls.__module__ else "plugin"
        reason = safe_probe(cls)
        caps, caps_err = _safe(lambda c=cls: dataclasses.asdict(c().capabilities()))
        facts: dict[str, str] = {}
        if reason is None:
            inst, err = _safe(lambda n=name: get_backend(n))
            if inst is not None:
                described, err = _safe(lambda i=inst: list(i.describe()), [])
                facts = {str(k): str(v) for k, v in described}
            if err:
                facts["error"] = err
        entries.append({
            "name": name,
            "aliases": list(getattr(cls, "aliases", ())),
            "device_types": list(getattr(cls, "device_types", ())),
            "priority": getattr(cls, "priority", 0),
            "origin": origin,
            "class": target,
            "usable": reason is None,
            "reason": reason,
            "capabilities": jsonable(caps) if caps is not None else None,
            "facts": facts,
        })  # fmt: skip
        if caps_err:
            entries[-1]["capabilities_error"] = caps_err
    return entries, problems


def routing_section(environ: Mapping[str, str], probe_devices: bool, problems: list[str]) -> dict[str, Any]:
    """Where ``Graph()`` goes and why (:func:`accel_graph.backends.routing_report`); the
    current-device check runs only with ``--probe-devices`` (it starts the device runtime)."""
    from ..backends import routing_report

    out = routing_report(check_device=probe_devices)
    out["ACCEL_GRAPH_BACKEND"] = environ.get("ACCEL_GRAPH_BACKEND") or None
    acc = out.get("accelerator") or {}
    if acc.get("error") or out.get("device_error"):  # a failing driver is a problem; 0 devices is not
        problems.append(f"routing: {out['reason']}")
    return out


def graph_apis_section() -> dict[str, Any]:
    """Graph-API presence read from the real torch modules, and what each native backend
    captures of torch.cond / torch.while_loop with them (``graph_apis`` in docs/doctor.md)."""
    from ..backends import registered_backends
    from ..backends.native.backend import NativeGraphBackend
    from ..backends.native.control_flow_support import detect_support
    from ..backends.torch_apis import graph_api_presence

    control_flow: dict[str, Any] = {}
    for name, cls in registered_backends().items():
        # only the backends this build is for: hip's answer on a CUDA build would mislead
        if issubclass(cls, NativeGraphBackend) and cls.probe_build() is None:
            support = detect_support(name, cls.module_name, getattr(torch, cls.module_name, None))
            control_flow[name] = {"cond": support.cond, "while_loop": support.while_loop, "switch": support.switch}
    return {"apis": graph_api_presence(), "native_control_flow": control_flow}


def allocator_section(environ: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    from ..allocator.alloc_conf import CONFIG_VARIABLES, settings_from_environment

    if getattr(torch.version, "hip", None):
        device = "hip"
    elif getattr(torch.version, "cuda", None):
        device = "cuda"
    elif getattr(torch.version, "xpu", None):
        device = "xpu"
    else:
        device = "cpu"
    present = {n: environ[n] for n in CONFIG_VARIABLES if n in environ}
    out: dict[str, Any] = {
        "device": device,
        "precedence": list(CONFIG_VARIABLES),
        "variables_set": present,
        "variable": None,
        "raw": None,
        "canonical": None,
        "settings": None,
        "ignored_variables": [],
        "error": None,
    }
    try:
        settings, var = settings_from_environment(environ, device=device)
    except Exception as exc:
        out["variable"] = next(iter(present), None)
        out["raw"] = present.get(out["variable"]) if out["variable"] else None
        out["error"] = str(exc)
        out["ignored_variables"] = [n for n in present if n != out["variable"]]
        problems.append(f"allocator config: {exc}")
    else:
        out["variable"] = var
        out["raw"] = present.get(var) if var else None
        out["canonical"] = settings.to_string()
        fields = dataclasses.asdict(settings)
        fields.pop("text", None)
        out["settings"] = jsonable(fields)
        out["ignored_variables"] = [n for n in present if n != var]
    out["plugin"] = plugin_status()
    return out


def plugin_status() -> dict[str, Any]:
    out: dict[str, Any] = {
        "core_built": False, "library": None, "abi_symbols": False, "control_symbols": False,
        "missing_symbols": [], "usable": False, "reason": None, "process_allocator": False,
    }  # fmt: skip
    from ..allocator.core.loader import CORE_MODULE, load_core

    if importlib.util.find_spec(CORE_MODULE) is None:
        out["reason"] = "the allocator core is not built (pip install --no-build-isolation -e .)"
        return out
    from ..allocator.core import device_plugin as plugin

    path, err = _safe(plugin.library_path)
    out["core_built"] = path is not None
    out["library"] = path
    if err:
        out["reason"] = err
        return out
    core = load_core()
    lib = ctypes.CDLL(path)
    missing = [n for n in (plugin.ALLOC_SYMBOL, plugin.FREE_SYMBOL) if not hasattr(lib, n)]
    out["abi_symbols"] = not missing
    missing_ctl = [n for n in plugin.CONTROL_SYMBOLS if not hasattr(core.lib, n)]
    out["control_symbols"] = not missing_ctl
    out["missing_symbols"] = missing + missing_ctl
    out["process_allocator"] = plugin.process_allocator() is not None
    reasons = []
    if not (getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None)):
        reasons.append("needs a CUDA or ROCm build of torch")
    if missing or missing_ctl:
        reasons.append(
            f"the allocator core does not export {', '.join(missing + missing_ctl)} (an engine "
            f"without the plug-in entry points; rebuild once it has them)"
        )
    out["usable"] = not reasons
    out["reason"] = "; ".join(reasons) or None
    return out


def recorder_section(environ: Mapping[str, str]) -> dict[str, Any]:
    from ..backends import registered_backends, safe_probe
    from ..foundation import config

    cls = registered_backends().get("recorder")
    reason = safe_probe(cls) if cls is not None else "not registered"
    caps, _ = _safe(lambda: dataclasses.asdict(cls().capabilities())) if cls else (None, None)
    limit, limit_err = _safe(config.pool_limit)
    return {
        "usable": reason is None,
        "reason": reason,
        "capabilities": jsonable(caps),
        "poison_outputs": config.poison_outputs(),
        "pool_limit_bytes": limit,
        "pool_limit_error": limit_err,
        "compile_default": config.default_compile(),
        "compile_replay_default": config.default_compile_replay(),
        "inductor_importable": importlib.util.find_spec("torch._inductor") is not None,
    }
