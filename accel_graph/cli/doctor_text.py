"""The human table of ``accel-graph doctor``: a collected report as aligned text.

Contract: :func:`format_report` turns the report dict (as :func:`accel_graph.cli.doctor.collect`
returns it, or as read back from its JSON) into one block of text per section; each registered
backend with a section of its own formats it (``doctor_lines``). It collects nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .doctor_sections import sectioned_backends

__all__ = ["format_report"]


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
    for cls in sectioned_backends():  # each backend formats its own section
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
