"""What-if simulation: one recorded trace replayed under another allocator configuration.

The library side of ``accel-alloc simulate``/``tune``/``diff``/``plot``. A :class:`Scenario` is
a config string (PyTorch's ``PYTORCH_ALLOC_CONF`` grammar, parsed exactly as the chosen torch
version does: :mod:`accel_graph.allocator.alloc_conf.rules`), a profile (torch version x device, :mod:`accel_graph.allocator.sim.profiles`), an engine policy and
an optional device capacity. :func:`simulate` replays the trace under it with
:func:`~accel_graph.allocator.sim.replayer.replay_trace` (one C call for the whole trace) and returns a
:class:`SimResult` whose :meth:`SimResult.to_json` is the stable JSON schema of
docs/accel-alloc.md.

Errors a user can fix are typed: :class:`~accel_graph.errors.ConfigError` (a config torch would
reject), :class:`CapacityError` (a cap below the largest allocation), and
:class:`UnsupportedTraceError` (an unknown profile or policy, a trace with nothing to replay).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...errors import CapacityError, ConfigError, UnsupportedTraceError
from ..alloc_conf import (
    RULES,
    AllocatorSettings,
    ParserRules,
    parse_config,
    parse_torch_version,
    rules_for,
    settings_from_snapshot,
)
from ..core.settings import POLICIES, EngineSettings
from ..devices import config_dialect_of
from ..traces.actions import A_ALLOC
from ..units import fmt_bytes
from . import profiles as _profiles
from .results import Figures

__all__ = [
    "Scenario",
    "SimResult",
    "largest_request",
    "make_scenario",
    "profile_rules",
    "recorded_refusal",
    "recorded_settings",
    "scenario_profile",
    "simulate",
    "top_level_entries",
]

#: Newest torch minor the profiles describe; the default profile for a trace is the newest one.
_NEWEST = (2, 14)


@dataclass(frozen=True)
class Scenario:
    """One configuration to replay a trace under.

    ``config``: the canonical config string (``""`` = torch's defaults), or None for "the
    settings the trace was recorded with". ``settings``: the parsed form (for ``config=None``
    the recorded settings, as :func:`make_scenario` read them; None: read them at replay).
    ``notes``: what the profile ignores or changes about this config. ``rules``: the torch
    config-parser rules the config (or the recorded one) was read with, and ``rules_chosen_by``
    why those (an explicit torch version, or the profile's newest torch).
    """

    config: str | None
    settings: AllocatorSettings | None
    profile: _profiles.Profile
    policy: str
    cap: int | None = None
    notes: tuple[str, ...] = ()
    rules: str = ""
    rules_chosen_by: str = ""

    @property
    def label(self) -> str:
        if self.config is None:
            return "(as recorded)"
        return self.config or "(defaults)"

    def describe(self) -> dict[str, Any]:
        return {"config": self.config, "label": self.label, "profile": self.profile.name,
                "policy": self.policy, "cap": self.cap, "notes": list(self.notes),
                "config_rules": {"torch": self.rules, "chosen_by": self.rules_chosen_by}}


def recorded_settings(trace: Any, device: int | None = None,
                      rules: str | ParserRules | None = None) -> AllocatorSettings:
    """The settings the trace says it was recorded with (defaults when it says nothing), with
    ``expandable_segments`` set when a final segment of ``device`` (any device when None) is
    expandable (NPU files record no settings; one file may hold devices recorded differently).
    ``rules``: the torch parser rules for the recorded string (default: the newest)."""
    kind = config_dialect_of(trace.device_type)
    s = settings_from_snapshot(trace.allocator_settings or {}, kind, rules)
    if not s.expandable_segments and any(
            seg.get("is_expandable") for seg in trace.segments
            if device is None or seg.get("device", 0) == device):
        s = dataclasses.replace(s, expandable_segments=True)
    return s


def largest_request(trace: Any, device: int = 0) -> int:
    """The largest single ``alloc`` request of ``device`` in the trace (0 when none)."""
    ev = trace.events(device)
    sizes = ev["size"][ev["action"] == A_ALLOC]
    return int(sizes.max()) if len(sizes) else 0


def scenario_profile(trace: Any, profile: str | _profiles.Profile | None) -> _profiles.Profile:
    """The profile a scenario uses: ``profile`` (a Profile, a profile name or a device name), or
    the newest for the trace's device type. Raises :class:`UnsupportedTraceError` if unknown."""
    if isinstance(profile, _profiles.Profile):
        return profile
    if profile is None:
        return _profiles.profile_for(_NEWEST, trace.device_type or "cuda")
    if profile in _profiles.PROFILES:
        return _profiles.PROFILES[profile]
    try:  # a bare device name: the newest profile for it
        return _profiles.profile_for(_NEWEST, profile)
    except ValueError:
        raise UnsupportedTraceError(
            f"unknown profile {profile!r}; known: {', '.join(sorted(_profiles.PROFILES))} "
            "(or a device: cuda, rocm, npu, xpu)"
        ) from None


def profile_rules(prof: _profiles.Profile) -> ParserRules:
    """The config-parser rules of the newest torch ``prof`` describes (cuda-2.13: 2.13)."""
    return rules_for(prof.torch_versions[1])


def make_scenario(trace: Any, config: str | None = None, *, policy: str | None = None,
                  profile: str | _profiles.Profile | None = None, cap: int | None = None,
                  device: int = 0, torch: str | tuple[int, int] | None = None) -> Scenario:
    """Check and resolve one configuration for ``trace``.

    ``torch``: the torch version the trace ran under (``"2.13"``, ``"2.14.1+cu130"``), when
    known: it picks the config-parser rules and, without ``profile``, the profile of that
    version. Without it the rules are those of the profile's newest torch.

    Raises :class:`ConfigError` for a config string torch would reject on the profile's device
    or an unreadable ``torch``, :class:`UnsupportedTraceError` for an unknown profile or
    policy, a torch no profile covers, or the ``cudaMallocAsync`` backend,
    :class:`CapacityError` for a ``cap`` below the largest request or a memory fraction
    without a cap.
    """
    notes: list[str] = []
    if torch is not None:
        version = parse_torch_version(torch)
        rules = rules_for(version)
        chosen_by = f"torch {version[0]}.{version[1]} given"
        if profile is None:
            try:
                profile = _profiles.profile_for(version, trace.device_type or "cuda")
            except ValueError as e:
                raise UnsupportedTraceError(f"{e}; pass --profile to choose one") from None
    prof = scenario_profile(trace, profile)
    if torch is None:
        rules = profile_rules(prof)
        chosen_by = f"profile {prof.name} (torch {_range_text(prof)})"
    elif not prof.covers(version):
        notes.append(f"profile {prof.name} describes torch {_range_text(prof)}, not the torch "
                     f"{version[0]}.{version[1]} given: configs are read with torch "
                     f"{rules.name}'s rules, the replay follows the profile")
    pol = policy or prof.policy
    if profile is None and trace.device_type is None:
        notes.append("the trace does not say which device recorded it; simulated with the CUDA "
                     f"profile {prof.name} (pass --device-type or --profile to choose)")
    if pol not in POLICIES:
        raise UnsupportedTraceError(f"unknown policy {pol!r}; known: {', '.join(POLICIES)}")
    settings: AllocatorSettings | None = None
    canonical: str | None = None
    if config is not None:
        try:
            settings = parse_config(config, config_dialect_of(prof.device), rules)
        except ConfigError as e:  # say which torch's rules refused it, and whether newer accept
            raise ConfigError(f"{e} [{_rules_said(config, prof, rules, chosen_by)}]") from None
        canonical = settings.to_string()
        if settings.backend != "native":
            raise UnsupportedTraceError(
                f"backend:{settings.backend} hands allocation to the driver's stream-ordered "
                "pool, which this simulator does not model; simulate backend:native settings"
            )
        given = {part.split(":", 1)[0].strip() for part in top_level_entries(config)}
        ignored = sorted(k for k in given if k and k not in prof.settings_keys)
        if ignored:
            notes.append(f"profile {prof.name} does not honour {', '.join(ignored)}; "
                         "simulated as if unset")
        if settings.per_process_memory_fraction < 1.0 and cap is None:
            raise CapacityError(
                "per_process_memory_fraction limits memory to a fraction of the device; pass "
                "--cap with the device's memory (e.g. --cap 80GiB) so the fraction has a size"
            )
        if settings.garbage_collection_threshold > 0 and settings.per_process_memory_fraction >= 1.0:
            notes.append("garbage_collection_threshold acts only with per_process_memory_fraction "
                         "set (pytorch#106660): no effect here")
    if config is None:  # the recorded settings, read once for every replay of this scenario
        settings = recorded_settings(trace, device, rules)
        refused = recorded_refusal(trace, prof, rules)
        if refused:
            notes.append(refused)
        if settings.backend != "native":
            notes.append(
                f"the trace was recorded with backend:{settings.backend} (the driver's "
                "stream-ordered pool), which this simulator does not model: the replay shows "
                "PyTorch's native caching allocator instead")
        fraction = settings.per_process_memory_fraction
        if fraction < 1.0 and cap is None:
            raise CapacityError(
                f"the trace was recorded with per_process_memory_fraction:{fraction}, a fraction "
                "of the device; pass --cap with the device's memory (e.g. --cap 80GiB)"
            )
    if cap is not None:
        need = largest_request(trace, device)
        if cap < need:
            raise CapacityError(
                f"--cap {fmt_bytes(cap)} ({cap} bytes) is smaller than the trace's largest "
                f"allocation ({fmt_bytes(need)}, {need} bytes); "
                "no configuration can run this trace there: raise the cap"
            )
    return Scenario(canonical, settings, prof, pol, cap, tuple(notes), rules.name, chosen_by)


def _rules_said(config: str, prof: _profiles.Profile, rules: ParserRules, chosen_by: str) -> str:
    """Which rules refused ``config`` (and, when they are not the newest, whether the newest
    accept it), for the error message: a refusal under ``--torch 2.11`` must say so."""
    said = f"read with torch {rules.name}'s PYTORCH_ALLOC_CONF rules, chosen by {chosen_by}"
    for newer in RULES.values():  # oldest first: the first newer rules that accept it
        if newer.torch_versions[0] <= rules.torch_versions[1]:
            continue
        try:
            parse_config(config, config_dialect_of(prof.device), newer)
        except ConfigError:
            continue
        lo = newer.torch_versions[0]
        return (f"{said}; torch {lo[0]}.{lo[1]} and later accept it: pass the --torch of the "
                "build that will read it, or drop the key for this torch")
    return said


def recorded_refusal(trace: Any, prof: _profiles.Profile, rules: ParserRules) -> str | None:
    """A note when the trace's recorded config string is one ``rules`` refuse: that torch
    would not have started with it, so it cannot be the recording's torch (the replay then
    uses the fields torch wrote beside the string). None when it parses or is absent."""
    raw = (trace.allocator_settings or {}).get("PYTORCH_CUDA_ALLOC_CONF")
    if not isinstance(raw, str) or not raw.strip():
        return None
    try:
        parse_config(raw, config_dialect_of(prof.device), rules)
    except ConfigError as e:
        why = str(e).split(f"{raw!r}: ", 1)[-1].split(". Keys accepted")[0]  # torch's words
        return (f"the trace's recorded config {raw!r} would be refused by torch {rules.name}'s "
                f"PYTORCH_ALLOC_CONF rules ({why}), "
                f"so torch {rules.name} did not record this trace; read from the individual "
                "settings torch recorded beside the string. Pass the --torch the trace ran under")
    return None


def _range_text(prof: _profiles.Profile) -> str:
    (a, b), (c, d) = prof.torch_versions
    return f"{a}.{b} or later" if d >= 99 else (f"{a}.{b}" if (a, b) == (c, d)
                                                 else f"{a}.{b}-{c}.{d}")


def top_level_entries(text: str) -> list[str]:
    """``a:1,b:[x:1,y:2]`` -> ``['a:1', 'b:[x:1,y:2]']`` (commas inside brackets kept)."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


@dataclass
class SimResult(Figures):
    """What one replay predicts. Byte figures are ints; see docs/accel-alloc.md for meaning."""

    scenario: Scenario
    device: int
    final_reserved: int
    replay_seconds: float
    n_ops: int
    notes: list[str] = field(default_factory=list)
    replay: Any = None  # the ReplayResult (events when keep_events=True)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.scenario.describe(),
            **self.figures_json(),
            "device": self.device,
            "final_reserved": self.final_reserved,
            "replay_seconds": round(self.replay_seconds, 6),
            "ops": self.n_ops,
            # capacity answers (only with a cap): did every allocation succeed, and how much
            # of the device was never reserved at the peak
            "fits": None if self.scenario.cap is None else self.ooms == 0,
            "headroom": (None if self.scenario.cap is None
                         else self.scenario.cap - self.peak_reserved),
            "notes": list(self.scenario.notes) + list(self.notes),
        }


def engine_settings(scenario: Scenario, trace: Any, device: int | None = None) -> EngineSettings:
    """The :class:`EngineSettings` a scenario replays with (cap and capacity included)."""
    parsed = (scenario.settings if scenario.settings is not None
              else recorded_settings(trace, device, scenario.rules or None))
    overrides: dict[str, Any] = {}
    if scenario.cap is not None:
        overrides["cap"] = scenario.cap
        overrides["capacity"] = scenario.cap
    return EngineSettings.from_allocator_settings(parsed, **overrides)


def simulate(trace: Any, scenario: Scenario, *, device: int = 0, keep_events: bool = False,
             ops_cache: dict[Any, Any] | None = None, keep_layout: bool = False) -> SimResult:
    """Replay one device's events of ``trace`` under ``scenario`` (one C call).

    ``ops_cache``: a dict the caller keeps while simulating one unchanging trace under many
    scenarios (as :func:`~accel_graph.allocator.tune.search.tune` does): the trace-to-ops
    conversion is then made once per distinct input
    (:func:`~accel_graph.allocator.sim.trace_ops.build_ops_reusing`); results are identical.
    ``keep_events``/``keep_layout``: keep the engine events and final layout in ``replay``
    (for timelines and :func:`~.predicted.predicted_trace`).
    """
    # Imported here for start-up time only (not a cycle): the engine and its C core load on
    # the first simulation, not for `accel-alloc <command> --help` or for building scenarios.
    from .replayer import replay_trace

    if not len(trace.events(device)):
        raise UnsupportedTraceError(f"the trace has no events for device {device}")
    es = engine_settings(scenario, trace, device)
    r = replay_trace(trace, es, policy=scenario.policy, device=device, profile=scenario.profile,
                     ops_cache=ops_cache, keep_events=keep_events, keep_layout=keep_layout)
    return SimResult(
        **r.figures(),
        scenario=scenario,
        device=device,
        final_reserved=int(r.final_stats.get("reserved_bytes.all.current", 0)),
        replay_seconds=float(r.replay_seconds),
        n_ops=int(r.n_ops),
        notes=list(r.notes),
        replay=r,
    )
