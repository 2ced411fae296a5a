"""The tuning search space: which knobs a profile honours, the values tried, and the grid.

:func:`build_space` lists the knobs a profile's policy acts on and the values tried (and which
knobs are skipped, and why); :func:`search_space` is its full grid as canonical config strings
(:mod:`.search` explores a structured subset of it).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ..alloc_conf import parse_config
from ..core.settings import POLICY_KEYS
from ..devices import config_dialect_of, rounding_rule_or_default
from ..sim import profiles as _profiles
from ..sim.scenario import scenario_profile
from ..units import MIB

__all__ = ["KNOB_VALUES", "SearchSpace", "build_space", "search_space"]


#: Values tried per knob (``None``/unset is always tried too). ``max_split`` is the pair
#: (max_split_size_mb, max_non_split_rounding_mb): the rounding window only acts with a split
#: limit, so it is searched inside it. ``gc`` is (garbage_collection_threshold,
#: per_process_memory_fraction): the threshold is inert without a fraction (pytorch#106660).
KNOB_VALUES: dict[str, tuple[Any, ...]] = {
    "max_split": tuple((ms, mnsr) for ms in (32, 64, 128, 256, 512)
                       for mnsr in (None, 64, 256, 1024)),
    "roundup_power2_divisions": ("2", "4", "8", "16", "[256:2,512:4,1024:8,>:16]",
                                 "[512:8,>:4]", "[512:4,>:8]", "[2:0,>:4]"),
    "large_segment_size_mb": (32, 64),
    "gc": tuple((thr, frac) for thr in (0.6, 0.8) for frac in (0.9, 0.95)),
}


@functools.lru_cache(maxsize=16384)
def _canonical(text: str, device: str) -> str | None:
    """:meth:`SearchSpace.canonical`, memoised: a search parses the same few hundred strings
    several times (every stage, and the full grid for its size), and parsing is pure."""
    try:
        return parse_config(text, device).to_string()
    except ConfigError:
        return None


@dataclass(frozen=True)
class SearchSpace:
    """The knobs a profile honours, the values tried for each, and the knobs skipped (with the
    reason). ``expandable`` lists the expandable_segments values tried."""

    profile: _profiles.Profile
    policy: str
    device: str  # config.py's device vocabulary (cuda, hip, xpu)
    expandable: tuple[bool, ...]
    knobs: dict[str, tuple[Any, ...]]
    skipped: tuple[tuple[str, str], ...]
    cap: int | None = None

    def config_string(self, es: bool, choice: dict[str, Any]) -> str:
        """The (not yet canonical) config string of one grid point."""
        parts: list[str] = []
        lss = choice.get("large_segment_size_mb")
        if lss is not None:
            parts.append(f"large_segment_size_mb:{lss}")
        ms = choice.get("max_split")
        if ms is not None:
            parts.append(f"max_split_size_mb:{ms[0]}")
            if ms[1] is not None:
                parts.append(f"max_non_split_rounding_mb:{ms[1]}")
        rp2 = choice.get("roundup_power2_divisions")
        if rp2 is not None:
            parts.append(f"roundup_power2_divisions:{rp2}")
        if es:
            parts.append("expandable_segments:True")
        gc = choice.get("gc")
        if gc is not None:
            parts.append(f"garbage_collection_threshold:{gc[0]}")
            parts.append(f"per_process_memory_fraction:{gc[1]}")
        return ",".join(parts)

    def canonical(self, text: str) -> str | None:
        """The canonical form of ``text`` on this device, or None when torch would reject it."""
        return _canonical(text, self.device)

    def grid(self) -> list[tuple[bool, dict[str, Any]]]:
        """Every grid point (valid or not), in a fixed order."""
        names = list(self.knobs)
        axes = [(None, *self.knobs[n]) for n in names]
        return [(es, dict(zip(names, combo))) for es in self.expandable
                for combo in itertools.product(*axes)]


def build_space(trace: Any, profile: str | _profiles.Profile | None = None,
                cap: int | None = None, policy: str | None = None) -> SearchSpace:
    """The knobs and values :func:`tune` searches for ``trace`` under ``profile``.

    Knobs the profile does not honour (``Profile.settings_keys``), or that its engine policy
    ignores, are skipped with the reason; so is expandable_segments where the build has none,
    and the garbage-collection pair without a capacity.
    """
    prof = scenario_profile(trace, profile)
    pol = policy or prof.policy
    keys = prof.settings_keys
    acts = POLICY_KEYS[pol]
    skipped: list[tuple[str, str]] = []

    def ignored_by_policy(key: str) -> bool:
        if key in acts:
            return False
        skipped.append((key, f"the {pol} policy ignores it; it would change nothing"))
        return True

    if not (prof.expandable_segments and "expandable_segments" in keys):
        expandable: tuple[bool, ...] = (False,)
        skipped.append(("expandable_segments",
                        f"profile {prof.name} has no expandable segments"
                        if not prof.expandable_segments else
                        f"profile {prof.name} does not honour expandable_segments"))
    elif ignored_by_policy("expandable_segments"):
        expandable = (False,)
    else:
        expandable = (False, True)
    knobs: dict[str, tuple[Any, ...]] = {}
    # max_split_size_mb (+ max_non_split_rounding_mb)
    if "max_split_size_mb" not in keys:
        skipped.append(("max_split_size_mb", f"profile {prof.name} does not honour it"))
    elif ignored_by_policy("max_split_size_mb"):
        pass
    else:
        values = KNOB_VALUES["max_split"]
        if "max_non_split_rounding_mb" not in keys:
            values = tuple(v for v in values if v[1] is None)
            skipped.append(("max_non_split_rounding_mb",
                            f"profile {prof.name} does not honour it"))
        knobs["max_split"] = values
    # roundup_power2_divisions
    if "roundup_power2_divisions" not in keys:
        skipped.append(("roundup_power2_divisions", f"profile {prof.name} does not honour it"))
    elif ignored_by_policy("roundup_power2_divisions"):
        pass
    elif not rounding_rule_or_default(prof.rounding).power2_divisions:
        skipped.append(("roundup_power2_divisions",
                        "the xpu allocator rounds to 512 bytes only; the divisions are not applied"))
    elif not prof.roundup_applied:
        skipped.append(("roundup_power2_divisions",
                        f"profile {prof.name} does not apply it (PR #160666)"))
    else:
        knobs["roundup_power2_divisions"] = KNOB_VALUES["roundup_power2_divisions"]
    # large_segment_size_mb
    if "large_segment_size_mb" in keys:
        if not ignored_by_policy("large_segment_size_mb"):
            knobs["large_segment_size_mb"] = KNOB_VALUES["large_segment_size_mb"]
    else:
        skipped.append(("large_segment_size_mb", f"profile {prof.name} does not honour it "
                        f"(fixed at {prof.large_segment_size // MIB} MiB; configurable from "
                        "torch 2.13)"))
    # garbage_collection_threshold + per_process_memory_fraction
    if cap is None:
        skipped.append(("garbage_collection_threshold",
                        "needs --cap: the threshold acts only with per_process_memory_fraction "
                        "(pytorch#106660), and a fraction needs the device's size"))
    elif "per_process_memory_fraction" not in keys or "garbage_collection_threshold" not in keys:
        skipped.append(("garbage_collection_threshold",
                        f"profile {prof.name} has no per_process_memory_fraction config key "
                        "(torch 2.13+), and the threshold is inert without a fraction "
                        "(pytorch#106660)"))
    elif not ignored_by_policy("garbage_collection_threshold"):
        knobs["gc"] = KNOB_VALUES["gc"]
    return SearchSpace(prof, pol, config_dialect_of(prof.device), expandable, knobs,
                       tuple(skipped), cap)


def search_space(trace: Any, profile: str | _profiles.Profile | None = None,
                 cap: int | None = None) -> list[str]:
    """The full grid for ``trace`` under ``profile`` as distinct canonical config strings (each
    one parses on the profile's device), in a fixed order. :func:`tune` evaluates a structured
    subset of it."""
    space = build_space(trace, profile, cap)
    seen: dict[str, None] = {}
    for es, choice in space.grid():
        c = space.canonical(space.config_string(es, choice))
        if c is not None:
            seen.setdefault(c, None)
    return list(seen)

