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
import json
import os
import platform
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["SCHEMA", "SCHEMA_VERSION", "add_arguments", "collect", "format_report", "run"]

SCHEMA = "accel-graph.doctor"
#: Bump on any change that removes or retypes a key (adding keys keeps the version).
SCHEMA_VERSION = 1

NOT_CHECKED_CUDA = "not checked: would initialise CUDA (rerun with --probe-devices)"
NOT_CHECKED_XPU = "not checked: would initialise XPU (rerun with --probe-devices)"


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
    text = json.dumps(report, indent=2, sort_keys=False)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text if args.json else format_report(report))
    return 0


# ----------------------------------------------------------------------------------------------
# helpers


def _safe(fn: Callable[[], Any], default: Any = None) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(default, "Type: message")`` if it raised."""
    try:
        return fn(), None
    except Exception as exc:  # the doctor must report, never crash
        return default, f"{type(exc).__name__}: {exc}"


def _fact(value: Any, note: str | None = None) -> dict[str, Any]:
    return {"value": value, "note": note}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _mapped_library(stem: str) -> str | None:
    """Path of a shared library already mapped into this process whose name starts with stem."""
    maps = _read("/proc/self/maps") or ""
    for line in maps.splitlines():
        path = line.rsplit(None, 1)[-1] if "/" in line else ""
        if os.path.basename(path).startswith(stem):
            return path
    return None


def _runtime_version(stem: str, symbol: str) -> tuple[str | None, str]:
    """``cudaRuntimeGetVersion``/``hipRuntimeGetVersion`` of the runtime torch already loaded
    (neither creates a context), as "M.m"; None and why when unavailable."""
    path = _mapped_library(stem)
    if path is None:
        return None, f"{stem} is not loaded in this process"
    try:
        fn = getattr(ctypes.CDLL(path), symbol)
        out = ctypes.c_int(0)
        if fn(ctypes.byref(out)) != 0:
            return None, f"{symbol} failed ({path})"
    except (OSError, AttributeError) as exc:
        return None, f"{symbol} unavailable in {path}: {exc}"
    v = out.value
    if stem.startswith("libamdhip"):  # HIP encodes major*10000000 + minor*100000 + patch
        return f"{v // 10000000}.{(v // 100000) % 100}.{v % 100000}", f"{symbol} ({path})"
    return f"{v // 1000}.{(v % 1000) // 10}", f"{symbol} ({path})"


def _nvidia_driver() -> tuple[str | None, str]:
    text = _read("/proc/driver/nvidia/version")
    if text is None:
        return None, "no NVIDIA kernel driver loaded (/proc/driver/nvidia/version is absent)"
    m = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9][0-9.]*)", text)
    return (m.group(1) if m else text.strip().splitlines()[0]), "/proc/driver/nvidia/version"


# ----------------------------------------------------------------------------------------------
# sections


def _torch_section() -> dict[str, Any]:
    v = torch.version
    return {
        "version": torch.__version__,
        "git_version": getattr(v, "git_version", None),
        "cuda": getattr(v, "cuda", None),
        "hip": getattr(v, "hip", None),
        "xpu": getattr(v, "xpu", None),
        "debug": bool(getattr(v, "debug", False)),
    }


def _versions(cuda_build: bool, hip_build: bool, xpu_build: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cuda_build:
        out["cuda_build"] = _fact(torch.version.cuda, "torch.version.cuda (the toolkit torch was built with)")
        out["cuda_runtime"] = _fact(*_runtime_version("libcudart.so", "cudaRuntimeGetVersion"))
        out["cuda_driver"] = _fact(*_nvidia_driver())
    else:
        why = "not a CUDA build of torch (torch.version.cuda is None)"
        out["cuda_build"] = out["cuda_runtime"] = _fact(None, why)
        value, note = _nvidia_driver()
        out["cuda_driver"] = _fact(value, note)
    if hip_build:
        out["hip_build"] = _fact(torch.version.hip, "torch.version.hip")
        out["hip_runtime"] = _fact(*_runtime_version("libamdhip64.so", "hipRuntimeGetVersion"))
        amd = _read("/sys/module/amdgpu/version")
        out["amdgpu_driver"] = _fact(
            amd.strip() if amd else None,
            "/sys/module/amdgpu/version" if amd else "not reported (/sys/module/amdgpu/version is absent)",
        )
    else:
        why = "not a ROCm build of torch (torch.version.hip is None)"
        out["hip_build"] = out["hip_runtime"] = out["amdgpu_driver"] = _fact(None, why)
    if xpu_build:
        out["xpu_build"] = _fact(torch.version.xpu, "torch.version.xpu")
    else:
        out["xpu_build"] = _fact(None, "not an XPU build of torch (torch.version.xpu is None)")
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


def _routing(environ: Mapping[str, str]) -> dict[str, Any]:
    from ..backends import select_backend

    chosen, err = _safe(lambda: select_backend(None))
    return {
        "ACCEL_GRAPH_BACKEND": environ.get("ACCEL_GRAPH_BACKEND") or None,
        "backend": chosen[0].name if chosen else None,
        "device": str(chosen[1]) if chosen else None,
        "error": err,
    }


def _cuda_devices(probe: bool, per_device: Callable[[int], dict[str, Any]]) -> tuple[list | None, str | None]:
    """Per-device facts when allowed (probing, or CUDA already initialised), else why not."""
    cuda = torch.cuda
    if not cuda.is_available():
        return None, "no visible device (torch.cuda.is_available() is False)"
    if not (probe or cuda.is_initialized()):
        return None, NOT_CHECKED_CUDA
    count, err = _safe(lambda: int(cuda.device_count()), 0)
    devices = []
    for i in range(count):
        entry, err = _safe(lambda i=i: per_device(i))
        devices.append(entry if entry is not None else {"index": i, "error": err})
    return devices, None if count else f"device_count() is 0 ({err or 'no devices'})"


def _device_name(i: int) -> str | None:
    fn = getattr(torch.cuda, "get_device_name", None)
    if fn is not None:
        return str(fn(i))
    return getattr(torch.cuda.get_device_properties(i), "name", None)


def _nvidia(probe: bool, problems: list[str]) -> dict[str, Any] | None:
    if not getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None):
        return None
    from ..backends.nvidia_arch import UNSUPPORTED, arch_verdict

    arch_list, err = _safe(lambda: list(torch.cuda.get_arch_list()), [])

    def one(i: int) -> dict[str, Any]:
        cap = tuple(int(x) for x in torch.cuda.get_device_capability(i))
        v = arch_verdict(cap, arch_list)  # type: ignore[arg-type]
        if v.kind == UNSUPPORTED:
            problems.append(f"cuda:{i}: {v.explanation}")
        return {
            "index": i,
            "name": _device_name(i),
            "capability": f"{cap[0]}.{cap[1]}",
            "verdict": {"kind": v.kind, "target": v.target, "explanation": v.explanation, "assumed": v.assumed},
        }

    devices, note = _cuda_devices(probe, one)
    return {"arch_list": arch_list, "arch_list_error": err, "devices": devices, "note": note}


def _quirk(q: Any) -> dict[str, Any]:
    return {
        "id": q.id, "what": q.what, "mitigation": q.mitigation,
        "references": list(q.references), "applies_when": q.applies_when(),
    }  # fmt: skip


def _rocm(probe: bool) -> dict[str, Any] | None:
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return None
    from ..backends.rocm import parse_gfx_arch, parse_hip_version, quirks_for

    parsed, parse_err = _safe(lambda: parse_hip_version(hip))
    arch_list, _ = _safe(lambda: list(torch.cuda.get_arch_list()), [])

    def one(i: int) -> dict[str, Any]:
        name = getattr(torch.cuda.get_device_properties(i), "gcnArchName", None)
        gfx, err = _safe(lambda: parse_gfx_arch(name)) if name else (None, "no gcnArchName")
        quirks = quirks_for(parsed, gfx) if gfx is not None else quirks_for(parsed)
        return {
            "index": i,
            "name": _device_name(i),
            "gcn_arch": name,
            "gfx": gfx.name if gfx else None,
            "features": {k: v for k, v in gfx.features} if gfx else {},
            "in_build": (gfx.name in {a.split(":")[0] for a in arch_list}) if gfx and arch_list else None,
            "quirks": [q.id for q in quirks],
            "error": err,
        }

    devices, note = _cuda_devices(probe, one)
    applicable = quirks_for(parsed)  # by version alone: arch-specific ones cannot be ruled out
    if devices:
        ids = {q for d in devices for q in d.get("quirks", [])}
        applicable = [q for q in applicable if q.id in ids]
    return {
        "hip_version": hip,
        "parsed": list(parsed) if parsed else None,
        "parse_error": parse_err,
        "arch_list": arch_list,
        "devices": devices,
        "note": note,
        "quirks_scope": "these devices" if devices else "this ROCm version, any arch (devices not checked)",
        "quirks": [_quirk(q) for q in applicable],
    }


def _xpu(probe: bool) -> dict[str, Any]:
    from ..backends.xpu import XpuBackend, _accelerator_graph_class

    xpu = getattr(torch, "xpu", None)
    acc_graph = getattr(getattr(torch, "accelerator", None), "Graph", None) is not None
    xpu_graph = xpu is not None and hasattr(xpu, "XPUGraph")
    out: dict[str, Any] = {
        "available": False,
        "device_count": 0,
        "graph_classes": {"torch.accelerator.Graph": acc_graph, "torch.xpu.XPUGraph": xpu_graph},
        "route": None,
        "explanation": "",
        "devices": None,
        "devices_note": None,
        "devices_error": None,
    }
    available, _ = _safe(lambda: bool(xpu.is_available()) if xpu is not None else False, False)
    if not available:
        out["explanation"] = (
            "no XPU device (torch.xpu.is_available() is False); on an XPU host graphs would use "
            + ("torch.accelerator.Graph where XPU is registered behind it, else torch.xpu.XPUGraph"
               if acc_graph or xpu_graph else "the recorder: this torch has no XPU graph class")
        )  # fmt: skip
        return out
    out["available"] = True
    out["device_count"], _ = _safe(lambda: int(xpu.device_count()), 0)
    reason = XpuBackend.probe()
    if reason is not None:
        out["route"] = "recorder"
        out["explanation"] = (
            f"recorder fallback: {reason}. XPU tensors are captured and replayed by the recorder "
            f"(interpreted replay, not a device graph)"
        )
    elif _accelerator_graph_class() is not None:
        out["route"] = "torch.accelerator.Graph"
        out["explanation"] = (
            "native XPU graphs through torch.accelerator.Graph (confirmed at the first capture; "
            "if XPU turns out not to be registered behind it, torch.xpu.XPUGraph is used)"
        )
    else:
        out["route"] = "torch.xpu.XPUGraph"
        out["explanation"] = "native XPU graphs through torch.xpu.XPUGraph"
    out["devices_note"] = None if probe else NOT_CHECKED_XPU
    if probe:
        names, err = _safe(lambda: [str(xpu.get_device_name(i)) for i in range(out["device_count"])], [])
        out["devices"] = names
        out["devices_error"] = err
    return out


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
    from .. import config
    from ..backends import registered_backends, safe_probe

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
    tv = torch.version
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
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("versions", lambda: _versions(
            bool(getattr(tv, "cuda", None)) and not getattr(tv, "hip", None),
            bool(getattr(tv, "hip", None)), bool(getattr(tv, "xpu", None)))),
        ("backends", None),  # type: ignore[list-item]
        ("routing", lambda: _routing(env)),
        ("nvidia", lambda: _nvidia(probe_devices, problems)),
        ("rocm", lambda: _rocm(probe_devices)),
        ("xpu", lambda: _xpu(probe_devices)),
        ("allocator", lambda: _allocator(env, problems)),
        ("recorder", lambda: _recorder(env)),
    ]  # fmt: skip
    for key, fn in sections:
        if key == "backends":
            got, err = _safe(_backend_entries, ([], []))
            report["backends"] = got[0]
            problems.extend(got[1])
        else:
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
    out += ["", "NVIDIA"]
    nv = r.get("nvidia")
    if nv is None:
        out.append("  not a CUDA build of torch: no arch verdicts")
    else:
        out.append(f"  arch list: {' '.join(nv.get('arch_list') or []) or '(none)'}")
        if nv.get("devices") is None:
            out.append(f"  per-device verdict: {nv.get('note')}")
        for d in nv.get("devices") or []:
            v = d.get("verdict") or {}
            out.append(f"  cuda:{d['index']} {d.get('name')} sm {d.get('capability')}: {v.get('kind')}"
                       f"{' (assumed)' if v.get('assumed') else ''} - {v.get('explanation') or d.get('error')}")
    out += ["", "ROCm"]
    rocm = r.get("rocm")
    if rocm is None:
        out.append("  not a ROCm build of torch: no HIP version, gfx arch or quirks")
    else:
        out.append(f"  HIP {rocm.get('hip_version')} (parsed {rocm.get('parsed') or rocm.get('parse_error')})")
        if rocm.get("devices") is None:
            out.append(f"  gfx arch: {rocm.get('note')}")
        for d in rocm.get("devices") or []:
            out.append(f"  cuda:{d['index']} {d.get('gfx') or d.get('error')} ({d.get('gcn_arch')}); "
                       f"in build: {d.get('in_build')}")
        out.append(f"  quirks that apply ({rocm.get('quirks_scope')}):")
        for q in rocm.get("quirks") or []:
            out.append(f"    {q['id']} [{q['applies_when']}]: {q['mitigation']} ({', '.join(q['references'])})")
    out += ["", "XPU"]
    x = r.get("xpu") or {}
    out.append(f"  route: {x.get('route') or '-'}; {x.get('explanation')}")
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
