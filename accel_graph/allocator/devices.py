"""The allocator's one device table: every fact the allocator keeps about a device family.

A :class:`DeviceKind` is one device family whose caching allocator is modelled here (CUDA,
ROCm, XPU, Ascend NPU): its canonical name (the ``device_type`` of traces and JSON, the
``device`` of profiles), the other names it answers to, how its torch builds read allocator
settings (the config dialect, the environment variables), how they round requests, the engine
policy and the profiles that simulate it, and what the device plug-in loads for it. Every map
from a device name to something else reads :data:`DEVICE_KINDS`; adding a device is one row here
plus its profiles (docs/architecture.md, "Add a device to the allocator").

Two small tables sit beside it, because the vocabularies are not device families:

- :data:`CONFIG_DIALECTS`: the ``device`` values of
  :func:`~accel_graph.allocator.alloc_conf.parse_config`, one per way a torch build reads a
  ``PYTORCH_ALLOC_CONF`` string (``"cpu"`` is a build, not a device family; ROCm's is
  ``"hip"``, the name torch uses for it there).
- :data:`ROUNDING_RULES`: how a build rounds a request to a block size (a profile names one).

Lookups: :func:`device_kind` accepts any name or alias, in any case, and raises
:class:`~accel_graph.errors.ConfigError` (a ``ValueError``) naming the accepted ones;
:func:`find_device_kind` returns None instead. :func:`canonical_kind` and
:func:`device_kind_or_default` take a canonical name only (a trace's or a profile's
``device_type``, exactly as spelled there) and return None, or CUDA, the family a trace that does
not say is simulated as, for anything else. :func:`runtime_device_kind` maps the device
plug-in's runtime names (``"cuda"``, ``"hip"``). Nothing here imports anything heavy: the rows
are ``NamedTuple`` (immutable), not dataclasses, because ``accel-alloc`` reads this table at
start-up and ``dataclasses`` alone would add about 10 ms to it (it imports ``inspect``).
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigError

__all__ = [
    "CONFIG_DIALECTS",
    "CONFIG_VARIABLES",
    "CURRENT_CONFIG_VARIABLE",
    "DEFAULT_DEVICE_KIND",
    "DEVICE_KINDS",
    "DEVICE_TYPES",
    "ROUNDING_RULES",
    "RUNTIME_KINDS",
    "ConfigDialect",
    "DeviceKind",
    "RoundingRule",
    "canonical_kind",
    "config_dialect",
    "config_dialect_of",
    "device_kind",
    "device_kind_for_policy",
    "device_kind_or_default",
    "device_names",
    "find_device_kind",
    "rounding_rule",
    "rounding_rule_or_default",
    "runtime_device_kind",
    "torch_read_variables",
]


class ConfigDialect(NamedTuple):
    """How one kind of torch build reads a ``PYTORCH_ALLOC_CONF`` string (``parse_config``'s
    ``device``): which keys it knows and which values of ``backend`` it takes."""

    name: str
    #: The build runs the CUDA parser hook (CUDAAllocatorConfig::parseArgs) after the common
    #: pass: its keys are known, and its values checked.
    cuda_hook: bool
    #: The values ``backend`` takes, torch's order (only where the hook runs; () elsewhere).
    backends: tuple[str, ...]
    #: An unknown key is refused (True), or skipped unchecked (the CPU build: False).
    refuses_unknown_keys: bool


class RoundingRule(NamedTuple):
    """How a build rounds a request to a block size: ``extra`` bytes are added first (torch_npu
    adds 32: ``EngineSettings.round_extra``), then the size is rounded to 512-byte multiples
    (at least 512), and, where ``power2_divisions`` holds, by ``roundup_power2_divisions``."""

    name: str
    extra: int
    power2_divisions: bool


class DeviceKind(NamedTuple):
    """One device family whose caching allocator is modelled (see the module docstring)."""

    #: Canonical name: a trace's ``device_type``, a profile's ``device``, JSON fields.
    name: str
    #: Other names :func:`device_kind` accepts for it (ROCm's "hip": torch's name in config).
    aliases: tuple[str, ...]
    #: How messages name it (torch's OOM text: "CUDA out of memory").
    display: str
    #: The :class:`ConfigDialect` its builds read config strings with.
    config: str
    #: The variable to set today (what ``accel-alloc inspect`` advises).
    config_variable: str
    #: The older variable its builds still read (and read first), or None.
    legacy_variable: str | None
    #: For a device that reads one variable (no ``legacy_variable``): the Python line that sets
    #: the settings (``{config}`` is the string); CUDA-family lines depend on the torch version.
    setter: str
    #: The engine policy that simulates its allocator (``EngineSettings`` policies).
    engine_policy: str
    #: The :class:`RoundingRule` its profiles use.
    rounding: str
    #: Its profiles (``accel_graph.allocator.sim.profiles``) that ``profile_for`` picks from,
    #: newest first: the first is the device's newest, used when only the device is given.
    profiles: tuple[str, ...]
    #: Blocks of 2 MiB or more in expandable segments start on multiples of this (bytes; 512:
    #: no extra alignment); the default of its profiles.
    expandable_large_align: int = 512
    #: The CUDA-compatible runtime library its torch builds link (CUDA, or HIP through hipify),
    #: which the device plug-in loads; None: not a CUDA-family device (no plug-in, and the
    #: expandable-segment conflicts documented for CUDA and ROCm do not apply as written).
    runtime_library: str | None = None
    #: ``ag_settings.device_kind`` of the C core for that runtime (_core.h); None without one.
    runtime_code: int | None = None

    @property
    def newest_profile(self) -> str:
        """The profile used when only the device is named."""
        return self.profiles[0]

    @property
    def oom_variable(self) -> str:
        """The variable torch's out-of-memory message names (the older one where it exists)."""
        return self.legacy_variable or self.config_variable

    @property
    def names(self) -> tuple[str, ...]:
        """Every name :func:`device_kind` accepts for it, canonical first."""
        return (self.name, *self.aliases)


#: The variable every torch build since 2.12 reads (CUDA, ROCm, XPU).
CURRENT_CONFIG_VARIABLE = "PYTORCH_ALLOC_CONF"
_CURRENT = CURRENT_CONFIG_VARIABLE

#: The config dialects, in the order messages list them.
CONFIG_DIALECTS: dict[str, ConfigDialect] = {
    d.name: d
    for d in (
        ConfigDialect("cuda", True, ("native", "cudaMallocAsync"), True),
        ConfigDialect("hip", True, ("native", "cudaMallocAsync", "hipMallocAsync"), True),
        ConfigDialect("xpu", False, (), True),
        ConfigDialect("cpu", False, (), False),
    )
}

#: The rounding rules: ``cuda`` (512-byte multiples, minimum 512, plus
#: roundup_power2_divisions), ``npu`` (request + 32 bytes, then as cuda), ``xpu`` (512-byte
#: multiples only).
ROUNDING_RULES: dict[str, RoundingRule] = {
    r.name: r
    for r in (
        RoundingRule("cuda", 0, True),
        RoundingRule("npu", 32, True),
        RoundingRule("xpu", 0, False),
    )
}

#: The device table, in the order of :data:`DEVICE_TYPES`.
DEVICE_KINDS: tuple[DeviceKind, ...] = (
    DeviceKind(
        name="cuda", aliases=(), display="CUDA", config="cuda",
        config_variable=_CURRENT, legacy_variable="PYTORCH_CUDA_ALLOC_CONF", setter="",
        engine_policy="native", rounding="cuda",
        profiles=("cuda-2.14", "cuda-2.13", "cuda-2.12", "cuda-2.11", "cuda-2.9"),
        runtime_library="libcudart.so", runtime_code=0,
    ),
    DeviceKind(
        name="rocm", aliases=("hip",), display="HIP", config="hip",
        config_variable=_CURRENT, legacy_variable="PYTORCH_HIP_ALLOC_CONF", setter="",
        engine_policy="native", rounding="cuda", profiles=("rocm-2.13",),
        runtime_library="libamdhip64.so", runtime_code=1,
    ),
    DeviceKind(
        name="xpu", aliases=(), display="XPU", config="xpu",
        config_variable=_CURRENT, legacy_variable=None,
        setter='torch._C._accelerator_setAllocatorSettings("{config}")',
        engine_policy="xpu", rounding="xpu", profiles=("xpu",),
    ),
    DeviceKind(
        # Ascend's torch_npu parses like a CUDA build and reads its own variable.
        name="npu", aliases=(), display="NPU", config="cuda",
        config_variable="PYTORCH_NPU_ALLOC_CONF", legacy_variable=None,
        setter='import os; os.environ["PYTORCH_NPU_ALLOC_CONF"] = "{config}"  '
               "# before `import torch_npu`",
        engine_policy="native", rounding="npu", profiles=("npu",),
        expandable_large_align=16 * 1024,
    ),
)

#: Canonical device names, as traces and JSON spell them.
DEVICE_TYPES: tuple[str, ...] = tuple(k.name for k in DEVICE_KINDS)
#: The kind assumed where a trace does not say which device recorded it.
DEFAULT_DEVICE_KIND = DEVICE_KINDS[0]
#: The config-dialect names of the device plug-in's kinds (``EngineSettings.device_kind``).
RUNTIME_KINDS: tuple[str, ...] = tuple(k.config for k in DEVICE_KINDS if k.runtime_library)

#: Every variable a device's build reads its settings from, current name first, then in table
#: order (where a recorded snapshot may keep the string).
CONFIG_VARIABLES: tuple[str, ...] = tuple(dict.fromkeys(
    v for k in DEVICE_KINDS for v in (k.config_variable, k.legacy_variable) if v is not None))

_BY_NAME: dict[str, DeviceKind] = {n: k for k in DEVICE_KINDS for n in k.names}
_BY_CANONICAL: dict[str, DeviceKind] = {k.name: k for k in DEVICE_KINDS}
_BY_RUNTIME: dict[str, DeviceKind] = {k.config: k for k in DEVICE_KINDS if k.runtime_library}


def torch_read_variables() -> tuple[str, ...]:
    """The variables a CUDA-family torch build (CUDA or ROCm) reads, in the order it reads them:
    the older per-runtime names first, then :data:`CURRENT_CONFIG_VARIABLE`; the first one set
    is used whole (torch 2.13)."""
    legacy = tuple(k.legacy_variable for k in DEVICE_KINDS if k.legacy_variable)
    return (*legacy, CURRENT_CONFIG_VARIABLE)


def device_names() -> str:
    """The accepted names, for messages: ``cuda, rocm (hip), xpu, npu``."""
    return ", ".join(k.name + (f" ({', '.join(k.aliases)})" if k.aliases else "")
                     for k in DEVICE_KINDS)


def find_device_kind(name: str | None) -> DeviceKind | None:
    """The kind ``name`` (a canonical name or an alias, any case) names; None if none does."""
    if not isinstance(name, str):
        return None
    return _BY_NAME.get(name.lower())


def device_kind(name: str) -> DeviceKind:
    """The kind ``name`` (a canonical name or an alias, any case) names. Raises
    :class:`ConfigError` (a ``ValueError``) naming the accepted names otherwise."""
    kind = find_device_kind(name)
    if kind is None:
        raise ConfigError(f"unknown device {name!r}; accepted: {device_names()}")
    return kind


def canonical_kind(name: str | None) -> DeviceKind | None:
    """The kind whose canonical name is exactly ``name`` (no aliases, case-sensitive: a trace's
    or a profile's ``device_type``); None otherwise."""
    return _BY_CANONICAL.get(name) if isinstance(name, str) else None


def device_kind_or_default(name: str | None) -> DeviceKind:
    """:func:`canonical_kind`, or :data:`DEFAULT_DEVICE_KIND` (CUDA) when ``name`` is None or
    not a canonical name: how a trace that does not say its device is read and simulated."""
    return canonical_kind(name) or DEFAULT_DEVICE_KIND


def config_dialect_of(device_type: str | None) -> str:
    """``parse_config``'s ``device`` for a trace's or a profile's ``device_type`` (ROCm reads
    with ``"hip"``, NPU as CUDA); CUDA's when ``device_type`` is None or not canonical."""
    return device_kind_or_default(device_type).config


def runtime_device_kind(runtime: str) -> DeviceKind:
    """The kind whose CUDA-compatible runtime the device plug-in calls ``runtime`` (one of
    :data:`RUNTIME_KINDS`: ``"cuda"``, ``"hip"``); CUDA for anything else."""
    return _BY_RUNTIME.get(runtime, DEFAULT_DEVICE_KIND)


def device_kind_for_policy(policy: str) -> DeviceKind | None:
    """The first kind (table order) simulated by engine policy ``policy``; None for a policy no
    device uses (``bfc``)."""
    return next((k for k in DEVICE_KINDS if k.engine_policy == policy), None)


def config_dialect(device: str) -> ConfigDialect:
    """The config dialect called ``device`` (exact: ``parse_config``'s vocabulary). Raises
    :class:`ConfigError` naming the dialects otherwise."""
    try:
        return CONFIG_DIALECTS[device]
    except (KeyError, TypeError):
        raise ConfigError(f"device must be one of {', '.join(CONFIG_DIALECTS)}; "
                          f"got {device!r}") from None


def rounding_rule(name: str) -> RoundingRule:
    """The rounding rule called ``name``. Raises :class:`ConfigError` naming the rules."""
    try:
        return ROUNDING_RULES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown rounding rule {name!r}; "
                          f"known: {', '.join(ROUNDING_RULES)}") from None


def rounding_rule_or_default(name: str) -> RoundingRule:
    """The rounding rule called ``name``, or the ``cuda`` rule for a name the table lacks (a
    hand-made :class:`~accel_graph.allocator.sim.profiles.Profile` that bypassed the catalogue's
    check is rounded as CUDA, as it always was)."""
    rule = ROUNDING_RULES.get(name) if isinstance(name, str) else None
    return rule or ROUNDING_RULES["cuda"]
