"""Which torch a trace was recorded with, as far as the trace tells, and which torch a config's
knobs need.

A snapshot does not name its torch version. What it can show is a lower bound:

- the config string torch recorded (``allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]``, or the
  newer name): torch rejects keys it does not know, so every key in it was known to that
  build; the oldest profile (:mod:`~accel_graph.allocator.sim.profiles`) of the trace's device
  that honours them all bounds the version from below;
- expandable segments in use (``segment_map``/``segment_unmap`` events, ``is_expandable``
  segments): torch 2.1 or later (the release that introduced them);
- the Python its frames ran under (``lib/python3.13/`` in a frame's path): the first torch
  release with wheels for it (3.12: torch 2.2; 3.13: torch 2.5);
- a trace written by accel-graph's generator replays the engine's model, torch 2.13.

:func:`infer_torch` returns that bound with the evidence behind it; :func:`knob_requirements`
says which keys of a config need a newer torch than the oldest profile of the device, and
:func:`version_warnings` warns when the trace does not show that its torch is new enough;
:func:`older_than_trace` says when a ``--torch`` given is older than the trace shows.
"""

from __future__ import annotations

import re
from typing import Any

from ..alloc_conf import parse_torch_version
from ..devices import CONFIG_VARIABLES, device_kind_or_default
from ..sim.profiles import PROFILES, Profile
from ..sim.scenario import top_level_entries
from ..traces.actions import A_MAP, A_UNMAP
from .advice import Advice

__all__ = ["infer_torch", "knob_requirements", "older_than_trace", "top_level_keys", "version_text",
           "version_warnings"]

Version = tuple[int, int]
_ES_MIN: Version = (2, 1)
#: The first torch release with wheels for a Python version (older Pythons: no bound).
_PYTHON_MIN: dict[tuple[int, int], Version] = {(3, 12): (2, 2), (3, 13): (2, 5)}
_PYTHON_DIR = re.compile(r"/lib/python(3)\.(\d+)/")
#: Where a snapshot may keep the config string: every device's variables, current name first.
_CONF_KEYS = CONFIG_VARIABLES


def top_level_keys(config: str) -> list[str]:
    """The keys of a config string's top-level ``key:value`` entries (stripped, non-empty)."""
    out = []
    for entry in top_level_entries(config):
        key = entry.split(":", 1)[0].strip()
        if key:
            out.append(key)
    return out


def version_text(v: Version | None) -> str:
    return "unknown" if v is None else f"{v[0]}.{v[1]}"


def _min_version_for(keys: set[str], device: str) -> tuple[Version | None, str | None]:
    """The oldest torch of ``device``'s profiles whose build honours every key, and that
    profile's name; (None, None) when no profile does."""
    best: tuple[Version, str] | None = None
    for p in PROFILES.values():
        if p.device != device or not keys <= set(p.settings_keys):
            continue
        lo = p.torch_versions[0]
        if best is None or lo < best[0]:
            best = (lo, p.name)
    return (None, None) if best is None else best


def infer_torch(trace: Any, device: int = 0) -> dict[str, Any]:
    """The torch version ``trace`` shows, as ``{"at_least": "2.13" | None, "evidence":
    [str, ...], "exact": False}``: a lower bound from what the recording left behind (see the
    module docstring); ``at_least`` None when the trace tells nothing."""
    evidence: list[str] = []
    bound: Version | None = None

    def raise_to(v: Version, why: str) -> None:
        nonlocal bound
        evidence.append(why)
        if bound is None or v > bound:
            bound = v

    settings = trace.allocator_settings if isinstance(trace.allocator_settings, dict) else {}
    dev = device_kind_or_default(trace.device_type).name
    for name in _CONF_KEYS:
        raw = settings.get(name)
        if isinstance(raw, str) and raw.strip():
            try:
                keys = set(top_level_keys(raw))
            except ValueError:
                continue
            v, prof = _min_version_for(keys, dev)
            if v is not None and keys:
                raise_to(v, f"the recorded config {raw!r} uses {', '.join(sorted(keys))}, "
                         f"honoured from torch {version_text(v)} (profile {prof})")
            break
    if "accel_graph_generator" in settings:
        raise_to((2, 13), "written by accel-graph's generator (the engine models torch 2.13)")
    pythons = set()
    for stack in trace.stacks[:500]:
        for f in stack:
            m = _PYTHON_DIR.search(str(f.get("filename", ""))) if isinstance(f, dict) else None
            if m:
                pythons.add((int(m.group(1)), int(m.group(2))))
    for py in sorted(pythons):
        v = _PYTHON_MIN.get(py)
        if v is not None:
            raise_to(v, f"frames ran under Python {py[0]}.{py[1]}, which torch supports from "
                     f"{version_text(v)}")
    ev = trace.events(device)
    if (len(ev) and bool(((ev["action"] == A_MAP) | (ev["action"] == A_UNMAP)).any())) or any(
            s.get("is_expandable") for s in trace.segments):
        raise_to(_ES_MIN, "expandable segments in use (segment_map/unmap events or "
                 "is_expandable segments): torch 2.1 or later")
    return {"at_least": None if bound is None else version_text(bound), "evidence": evidence,
            "exact": False}


def knob_requirements(config: str, profile: Profile) -> dict[str, str]:
    """Keys of ``config`` that need a newer torch than the oldest profile of ``profile``'s
    device: ``{key: "2.13"}``."""
    try:
        keys = set(top_level_keys(config))
    except ValueError:
        return {}
    oldest = min((p.torch_versions[0] for p in PROFILES.values() if p.device == profile.device),
                 default=None)
    out = {}
    for k in sorted(keys):
        v, _ = _min_version_for({k}, profile.device)
        if v is not None and oldest is not None and v > oldest:
            out[k] = version_text(v)
    return out


def version_warnings(config: str, profile: Profile, trace_torch: dict[str, Any]) -> list[Advice]:
    """A ``knob-needs-newer-torch`` warning per key of ``config`` that needs a torch newer than
    the trace shows (its lower bound, or nothing)."""
    seen = trace_torch.get("at_least")
    have = tuple(int(x) for x in seen.split(".")) if seen else None
    out = []
    for key, need in knob_requirements(config, profile).items():
        need_v = tuple(int(x) for x in need.split("."))
        if have is not None and have >= need_v:
            continue
        shown = (f"the trace shows torch {seen} or later only" if seen else
                 "the trace does not show its torch version")
        out.append(Advice(
            "knob-needs-newer-torch", "warning",
            f"{key} needs torch {need} or later (older builds reject the key); {shown}: check "
            "torch.__version__ where the line will be used, or drop the key",
            "accel-alloc simulate --list-profiles (settings each profile honours)"))
    return out


def older_than_trace(given: str | tuple[int, int] | None, trace_torch: dict[str, Any]) -> str | None:
    """The contradiction between a torch version the user gave (``--torch``) and the lower
    bound :func:`infer_torch` read off the trace, in words; None when there is none (nothing
    given, nothing shown, or the given torch is at least the bound).

    The bound comes from what that torch left in the trace, so a torch older than it cannot
    have recorded the trace: the figures then follow rules that did not apply to it.
    """
    seen = trace_torch.get("at_least")
    if given is None or not seen:
        return None
    have = parse_torch_version(given)
    need = parse_torch_version(seen)
    if have >= need:
        return None
    evidence = "; ".join(trace_torch.get("evidence") or ())
    return (f"--torch {version_text(have)} is older than the trace shows (torch {seen} or later"
            + (f": {evidence}" if evidence else "") + f"): torch {version_text(have)} cannot have "
            "recorded it, so the profile and the config rules used are not the recording's; pass "
            "the torch the trace ran under, or drop --torch")
