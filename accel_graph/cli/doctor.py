"""``accel-graph doctor [--json] [--probe-devices]``: what accel-graph sees on this machine.

Reports every registered backend with its probe verdict and reason and its capabilities; torch,
CUDA runtime and driver, HIP and XPU versions where present; the NVIDIA arch verdict per device;
the ROCm version, gfx arch and the HIP-graph quirks that apply; the XPU route (native graph class
or recorder fallback); the allocator settings in effect (which variable, parsed, canonical); the
device allocator plug-in's state; and the recorder's status.

It never initialises a device unless ``--probe-devices`` is given (or the device runtime is
already initialised in this process): facts that need one say ``not checked: would initialise
CUDA``. Human table by default; ``--json`` prints the versioned report documented in
``docs/doctor.md`` (:data:`SCHEMA`, :data:`SCHEMA_VERSION`). The exit status is 0 whenever a
report was produced, problems or not (they are listed under ``problems``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime as _dt
import importlib
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..backends.device_facts import safe as _safe
from .output import json_text, write_json

if TYPE_CHECKING:
    from ..backends.base import Backend

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "add_arguments",
    "collect",
    "format_report",
    "run",
]

SCHEMA = "accel-graph.doctor"
#: Bump on any change that removes or retypes a key (adding keys keeps the version).
SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``accel-graph doctor``."""
    parser.add_argument("--json", action="store_true", help="print the JSON report (docs/doctor.md)")
    parser.add_argument(
        "--probe-devices",
        action="store_true",
        help="initialise CUDA/HIP/XPU to read per-device facts (capability, arch verdict, gfx arch)",
    )
    parser.add_argument("--out", metavar="PATH", help="also write the JSON report to PATH")


def run(args: argparse.Namespace) -> int:
    """Collect, print (table or JSON) and optionally write the report. Returns 0."""
    report = collect(probe_devices=bool(args.probe_devices))
    if args.out:
        write_json(Path(args.out), report, allow_nan=True)
    print(json_text(report, sort_keys=False) if args.json else format_report(report))
    return 0


# ----------------------------------------------------------------------------------------------
# helpers


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _sectioned_backends() -> list[type[Backend]]:
    """The registered backends that contribute a section of their own (``doctor_key``)."""
    from ..backends import registered_backends

    return [cls for cls in registered_backends().values() if getattr(cls, "doctor_key", None)]


# ----------------------------------------------------------------------------------------------
# sections


def _torch_section() -> dict[str, Any]:
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


def _versions(problems: list[str]) -> dict[str, Any]:
    """Every registered backend's ``doctor_versions()``, in registry order."""
    from ..backends import registered_backends

    out: dict[str, Any] = {}
    for cls in registered_backends().values():
        got, err = _safe(cls.doctor_versions, {})
        out.update(got)
        if err:
            problems.append(f"doctor could not collect 'versions' of {cls.name}: {err}")
    return out


def _backend_entries() -> tuple[list[dict[str, Any]], list[str]]:
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
            "capabilities": _jsonable(caps) if caps is not None else None,
            "facts": facts,
        })  # fmt: skip
        if caps_err:
            entries[-1]["capabilities_error"] = caps_err
    return entries, problems


def _routing(environ: Mapping[str, str], probe_devices: bool, problems: list[str]) -> dict[str, Any]:
    """Where ``Graph()`` goes and why (:func:`accel_graph.backends.routing_report`); the
    current-device check runs only with ``--probe-devices`` (it starts the device runtime)."""
    from ..backends import routing_report

    out = routing_report(check_device=probe_devices)
    out["ACCEL_GRAPH_BACKEND"] = environ.get("ACCEL_GRAPH_BACKEND") or None
    acc = out.get("accelerator") or {}
    if acc.get("error") or out.get("device_error"):  # a failing driver is a problem; 0 devices is not
        problems.append(f"routing: {out['reason']}")
    return out


def _graph_apis() -> dict[str, Any]:
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


def _allocator(environ: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
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
        out["settings"] = _jsonable(fields)
        out["ignored_variables"] = [n for n in present if n != var]
    out["plugin"] = _plugin_status()
    return out


def _plugin_status() -> dict[str, Any]:
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


def _recorder(environ: Mapping[str, str]) -> dict[str, Any]:
    from ..backends import registered_backends, safe_probe
    from ..foundation import config

    cls = registered_backends().get("recorder")
    reason = safe_probe(cls) if cls is not None else "not registered"
    caps, _ = _safe(lambda: dataclasses.asdict(cls().capabilities())) if cls else (None, None)
    limit, limit_err = _safe(config.pool_limit)
    return {
        "usable": reason is None,
        "reason": reason,
        "capabilities": _jsonable(caps),
        "poison_outputs": config.poison_outputs(),
        "pool_limit_bytes": limit,
        "pool_limit_error": limit_err,
        "compile_default": config.default_compile(),
        "compile_replay_default": config.default_compile_replay(),
        "inductor_importable": importlib.util.find_spec("torch._inductor") is not None,
    }


def collect(probe_devices: bool = False, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (schema in docs/doctor.md). Never raises.

    ``environ`` defaults to ``os.environ`` (the allocator variables and ``ACCEL_GRAPH_*``).
    """
    env = os.environ if environ is None else environ
    import accel_graph

    problems: list[str] = []
    cuda_init_before, _ = _safe(lambda: bool(torch.cuda.is_initialized()), False)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "accel_graph_version": accel_graph.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "probe_devices": bool(probe_devices),
        "cuda_initialized_before": cuda_init_before,
        "torch": _torch_section(),
    }
    report["versions"] = _versions(problems)
    got, err = _safe(_backend_entries, ([], []))
    report["backends"] = got[0]
    problems.extend(got[1])
    if err:
        problems.append(f"doctor could not collect 'backends': {err}")
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("routing", lambda: _routing(env, probe_devices, problems)),
        ("graph_apis", _graph_apis),
    ]
    for cls in _sectioned_backends():  # nvidia, rocm, xpu: each native backend's own section
        key = cls.doctor_key or cls.name
        sections.append((key, lambda c=cls: c.doctor_section(probe_devices, problems)))
    sections += [("allocator", lambda: _allocator(env, problems)), ("recorder", lambda: _recorder(env))]
    for key, fn in sections:
        report[key], err = _safe(fn)
        if err:
            problems.append(f"doctor could not collect {key!r}: {err}")
    if not any(b["usable"] for b in report["backends"]):
        problems.append("no backend is usable: accel_graph.Graph cannot be created here")
    report["problems"] = problems
    return report


# ----------------------------------------------------------------------------------------------
# the human table


def _kv(rows: list[tuple[str, Any]], indent: str = "  ") -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{indent}{k.ljust(width)}  {'-' if v is None or v == '' else v}" for k, v in rows]


def _settings_line(st: Mapping[str, Any]) -> str:
    """The settings that matter most for graphs and fragmentation, in one line."""
    mib = 1 << 20
    split = st.get("max_split_size")
    divs = st.get("roundup_power2_divisions") or []
    return (
        f"max_split_size={'unlimited' if split is None else f'{split // mib} MiB'}, "
        f"expandable_segments={st.get('expandable_segments')}, "
        f"garbage_collection_threshold={st.get('garbage_collection_threshold')}, "
        f"roundup_power2_divisions={divs[0] if len(set(divs)) == 1 else divs}, "
        f"backend={st.get('backend')}"
    )


def _fmt_fact(f: Mapping[str, Any] | None) -> str:
    if not f:
        return "-"
    if f.get("value") is None:
        return f"- ({f.get('note')})"
    return f"{f['value']}" + (f"  ({f['note']})" if f.get("note") else "")


def format_report(r: Mapping[str, Any]) -> str:
    """The report as aligned text: one block per section."""
    t = r.get("torch", {})
    out = [
        f"accel-graph doctor: accel-graph {r.get('accel_graph_version')}, torch {t.get('version')}, "
        f"Python {r.get('python')} ({r.get('schema')} v{r.get('schema_version')}, {r.get('generated_at')})",
        f"devices probed: {'yes' if r.get('probe_devices') else 'no (facts that would initialise a device are not checked; --probe-devices)'}",
        "",
        "versions",
    ]
    versions = r.get("versions") or {}
    out += _kv([(k, _fmt_fact(v)) for k, v in versions.items()])
    out += ["", "backends"]
    rows = [("NAME", "STATUS", "DEVICES", "NATIVE", "REASON")]
    for b in r.get("backends", []):
        caps = b.get("capabilities") or {}
        native = "-" if not caps else ("yes" if caps.get("native_graphs") else "no")
        rows.append((
            b["name"], "usable" if b["usable"] else "unusable",
            ",".join(b.get("device_types") or []) or "-", native, b.get("reason") or "",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    for row in rows:
        out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths)) + "  " + str(row[4]))
    for b in r.get("backends", []):
        caps = b.get("capabilities")
        if caps:
            modes = ",".join(caps.get("capture_error_modes", []))
            flags = [k for k in ("standalone_bytes", "compile", "foreign_pool_handles") if caps.get(k)]
            out.append(f"  {b['name']}: capture modes {modes}; {', '.join(flags) or 'no extras'}")
        for k, v in (b.get("facts") or {}).items():
            if not k.startswith("quirk "):  # the ROCm block lists them, matched per device
                out.append(f"    {k}: {v}")
    routing = r.get("routing") or {}
    out.append(
        f"  routing: Graph() without device= uses {routing.get('backend') or '-'} on "
        f"{routing.get('device') or '-'} (ACCEL_GRAPH_BACKEND={routing.get('ACCEL_GRAPH_BACKEND') or 'unset'})"
        + (f"; error: {routing['error']}" if routing.get("error") else "")
    )
    if routing.get("reason"):
        out.append(f"  why: {routing['reason']}")
    if not t.get("verified", True):
        out.append(f"  torch {t.get('version')} is outside the verified releases "
                   f"({', '.join(t.get('verified_releases') or [])})")
    out += ["", "graph APIs (read from the installed torch)"]
    ga = r.get("graph_apis") or {}
    apis = ga.get("apis") or {}
    out += _kv([(k, ("present" if v.get("present") else "absent") + (f" ({v['error']})" if v.get("error") else ""))
                for k, v in apis.items()])  # fmt: skip
    # native_control_flow describes the build (the modules torch ships); whether a graph can
    # use it depends on a device here, which a GPU-less CUDA build lacks: say which it is
    usable = {b.get("name"): b.get("usable") for b in r.get("backends") or []}
    for name, ops in (ga.get("native_control_flow") or {}).items():
        supported = ("captured natively" if usable.get(name) else
                     f"build supports native capture; no usable {name} device here")
        out += _kv([(f"{name} {op}", supported if why is None else f"refused at capture: {why}")
                    for op, why in ops.items()])  # fmt: skip
    for cls in _sectioned_backends():  # each backend formats its own section
        out += ["", cls.doctor_title or cls.name]
        out += cls.doctor_lines(r.get(cls.doctor_key or cls.name))
    out += ["", "allocator"]
    a = r.get("allocator") or {}
    var = a.get("variable")
    p = a.get("plugin") or {}
    status = "usable" if p.get("usable") else f"unavailable: {p.get('reason')}"
    out += _kv([
        ("rules", f"{a.get('device')} (precedence {' > '.join(a.get('precedence') or [])})"),
        ("variable", f"{var}={a.get('raw')!r}" if var else "none set: torch's defaults"),
        ("ignored", ", ".join(a.get("ignored_variables") or []) or None),
        ("error", a.get("error")),
        ("canonical", repr(a.get("canonical")) if a.get("canonical") is not None else None),
        ("in effect", None if a.get("settings") is None else _settings_line(a["settings"])),
        ("plug-in", status),
        ("library", p.get("library")),
        ("process swap", "active (captures on cuda/hip refused)" if p.get("process_allocator") else "not installed"),
    ])  # fmt: skip
    out += ["", "recorder"]
    rec = r.get("recorder") or {}
    out += _kv([
        ("status", "usable" if rec.get("usable") else f"unusable: {rec.get('reason')}"),
        ("compile default", rec.get("compile_default") or "none (interpreted replay)"),
        ("compiled replay", rec.get("compile_replay_default") or "auto (the faster program)"),
        ("inductor", "importable" if rec.get("inductor_importable") else "not importable"),
        ("poison outputs", "on" if rec.get("poison_outputs") else "off"),
        ("pool limit", rec.get("pool_limit_error") or rec.get("pool_limit_bytes") or "unbounded"),
    ])  # fmt: skip
    problems = r.get("problems") or []
    out += ["", "problems: " + ("none" if not problems else "")]
    out += [f"  - {p}" for p in problems]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    from .main import main

    sys.exit(main(["doctor", *sys.argv[1:]]))
