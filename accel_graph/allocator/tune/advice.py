"""What to paste, and what to watch out for, when applying an allocator config.

Pure functions (no environment is read implicitly: pass ``environ``), used by ``accel-alloc
tune`` and testable on their own:

- :func:`env_assignment`: the environment variable(s) a profile's build reads, the line to
  paste, and a Python snippet for setting the string at run time;
- :func:`advise`: warnings about a recommended config, each with a ``code``, a ``severity``
  (``info``, ``warning``, ``high``) and the ``reference`` it comes from
  (shared/reference/allocator-semantics.md sections 4.2-4.4 and 6 item 8);
- :func:`parse_uses`: the ``--uses`` vocabulary (features that conflict with expandable
  segments).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..alloc_conf import CONFIG_VARIABLES, AllocatorSettings
from ..devices import canonical_kind, device_kind_or_default
from ..sim.profiles import Profile

__all__ = [
    "USES",
    "Advice",
    "EnvAssignment",
    "advise",
    "env_assignment",
    "env_override_warnings",
    "es_conflict_warnings",
    "parse_uses",
]

#: ``--uses`` values: features of the user's program that conflict with expandable segments,
#: with what each is and the references that report the conflict.
USES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ipc": ("CUDA IPC (sharing tensors across processes, e.g. torch.multiprocessing or "
            "cudaIpcGetMemHandle): expandable-segment memory cannot be exported that way",
            ("pytorch/pytorch#130330",)),
    "mempool": ("MemPool-based sleep mode / CuMemAllocator (vLLM sleep mode, torch.cuda.MemPool "
                "with a custom allocator): expandable segments inside such a pool misbehave; "
                "vLLM now turns them off inside its pool",
                ("pytorch/pytorch#147851", "vllm-project/vllm#40812")),
    "custom-allreduce": ("a cudaIpc-based custom all-reduce (vLLM's custom_all_reduce) registers "
                         "buffers with cudaIpcGetMemHandle, which expandable segments break",
                         ("vllm-project/vllm#43923",)),
    "nccl-register": ("NCCL buffer registration / KV-transfer registration paths (NCCL "
                      "user buffers, Mooncake transfer engine) that expect cudaMalloc'd memory",
                      ("vllm-project/vllm#54351", "kvcache-ai/Mooncake#2511")),
}

_ES_ALL_REFS = ("pytorch/pytorch#130330", "pytorch/pytorch#147851", "vllm-project/vllm#40812",
                "vllm-project/vllm#43923", "vllm-project/vllm#54351", "kvcache-ai/Mooncake#2511")


@dataclass(frozen=True)
class Advice:
    """One warning. ``reference``: where the behaviour is reported (issues, docs), comma-separated."""

    code: str
    severity: str  # info | warning | high
    message: str
    reference: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EnvAssignment:
    """How to apply a config string on one profile's build.

    ``env_var``: the variable to set; ``env_line``: a shell line setting it (quoted);
    ``also``: further lines worth setting to the same string (older names); ``snippet``: Python
    that sets the string at run time; ``note``: when the settings must be in place.
    """

    env_var: str
    env_line: str
    also: tuple[str, ...]
    snippet: str
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"env_var": self.env_var, "env_line": self.env_line, "also": list(self.also),
                "snippet": self.snippet, "note": self.note}


def parse_uses(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"ipc,mempool"`` -> ``("ipc", "mempool")``; ValueError naming the accepted values."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in items:
        u = item.strip().lower().replace("_", "-")
        if not u:
            continue
        if u not in USES:
            raise ValueError(f"unknown --uses value {item!r}; accepted: {', '.join(USES)}")
        if u not in out:
            out.append(u)
    return tuple(out)


_NOTE = ("set it before the process makes its first {dev} allocation (before importing the "
         "training code, or in the launcher's environment): settings read at start-up are not "
         "re-read (axolotl-ai-cloud/axolotl#2183)")


def env_assignment(config: str, profile: Profile) -> EnvAssignment:
    """The variable(s) ``profile``'s build reads and the line to paste for ``config``.

    CUDA/ROCm 2.12+: ``PYTORCH_ALLOC_CONF`` (current name), plus the same string in
    ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_HIP_ALLOC_CONF``: older releases read only those, and
    where both are set the older name wins (torch 2.13; the strings are not merged). CUDA before
    2.12 (profile ``cuda-2.9``): ``PYTORCH_CUDA_ALLOC_CONF``. Ascend: ``PYTORCH_NPU_ALLOC_CONF``.
    XPU: ``PYTORCH_ALLOC_CONF``.
    """
    q = shlex.quote(config)
    kind = device_kind_or_default(profile.device)
    legacy = kind.legacy_variable
    if legacy is None:  # one variable, set the device's own way (NPU, XPU)
        var = kind.config_variable
        return EnvAssignment(var, f"export {var}={q}", (),
                             kind.setter.replace("{config}", config), _NOTE.format(dev=kind.display))
    current = kind.config_variable
    newer = profile.torch_versions[1] >= (2, 12)
    if newer:
        snippet = (f'torch._C._accelerator_setAllocatorSettings("{config}")  # torch 2.13+; '
                   f'older: torch.cuda.memory._set_allocator_settings("{config}")')
        return EnvAssignment(current, f"export {current}={q}",
                             (f"export {legacy}={q}",), snippet, _NOTE.format(dev=kind.display))
    # Before 2.12 only the older name is read; the note has always said CUDA here (the only
    # such profiles are CUDA's).
    return EnvAssignment(
        legacy, f"export {legacy}={q}", (f"export {current}={q}",),
        f'torch.cuda.memory._set_allocator_settings("{config}")',
        _NOTE.format(dev="CUDA"))


def env_override_warnings(environ: Mapping[str, str], env_var: str,
                          config: str | None = None) -> list[Advice]:
    """Variables set in ``environ`` that the build reads before ``env_var`` (torch reads the
    first of :data:`~accel_graph.allocator.alloc_conf.CONFIG_VARIABLES` that is set, whole, and
    merges nothing): each would silently override the pasted line. Also flags ``env_var``
    itself already set to another string."""
    out: list[Advice] = []
    if env_var in CONFIG_VARIABLES:
        before = CONFIG_VARIABLES[:CONFIG_VARIABLES.index(env_var)]
        for name in before:
            if name in environ and (config is None or environ[name] != config):
                out.append(Advice(
                    "env-override", "high",
                    f"{name}={environ[name]!r} is set in this environment; torch reads "
                    f"{name} before {env_var} and uses the first one set, whole (the strings "
                    f"are not merged), so {env_var} would be ignored: unset {name} or set it "
                    "to the same string",
                    "torch-internals.md section 4 (checked on torch 2.13); "
                    "vllm-project/vllm#54351"))
    if config is not None and env_var in environ and environ[env_var] != config:
        out.append(Advice(
            "env-replaced", "info",
            f"{env_var} is currently {environ[env_var]!r}; the line replaces it",
            "torch-internals.md section 4"))
    return out


def es_conflict_warnings(uses: Iterable[str] = (), private_pools: bool = False,
                         device: str = "cuda") -> list[Advice]:
    """Expandable segments vs CUDA IPC, MemPool sleep mode, custom all-reduce and NCCL
    registration: one general warning, or one ``high`` warning per declared use, plus one when
    the trace allocates into private pools. ``device`` (a profile's device) words the general
    warning: the conflicts are documented for CUDA and ROCm builds only."""
    uses = tuple(uses)
    out: list[Advice] = []
    for u in uses:
        what, refs = USES[u]
        out.append(Advice(f"es-{u}", "high",
                          f"the recommended config turns expandable_segments on, and you use "
                          f"{what}. Keep expandable segments off for this program, or turn "
                          "them on only around the phases that do not use it "
                          "(torch._C._accelerator_setAllocatorSettings at run time)",
                          ", ".join(refs)))
    if private_pools:
        out.append(Advice(
            "es-private-pools", "high",
            "the trace allocates into private pools (CUDA graphs or torch.cuda.MemPool: nonzero "
            "pool ids / segment_pool_id). If those are MemPools with a custom allocator (sleep "
            "mode, CuMemAllocator), expandable segments conflict with them; check before "
            "turning expandable segments on",
            "pytorch/pytorch#147851, vllm-project/vllm#40812"))
    if not uses:
        out.append(Advice(
            "es-compat", "warning",
            "expandable_segments:True is incompatible or awkward with CUDA IPC, MemPool-based "
            "sleep mode / CuMemAllocator, cudaIpc-based custom all-reduce and NCCL/KV-transfer "
            "buffer registration; if the program uses any of these, pass --uses to check, or "
            "keep expandable segments off"
            + ("" if _documented_es_conflicts(device) else
               f". These conflicts are documented for CUDA/ROCm builds; on {device} check the "
               "vendor's equivalents (IPC sharing, collective-library buffer registration) "
               "before relying on the setting"),
            ", ".join(_ES_ALL_REFS)))
    return out


def _documented_es_conflicts(device: str) -> bool:
    """Whether the expandable-segment conflicts are documented for ``device`` as written: the
    CUDA-runtime families (CUDA, and ROCm through HIP)."""
    kind = canonical_kind(device)
    return kind is not None and kind.runtime_library is not None


def advise(settings: AllocatorSettings, profile: Profile, *,
           environ: Mapping[str, str] | None = None, uses: Iterable[str] = (),
           private_pools: bool = False, env_var: str | None = None) -> list[Advice]:
    """Every warning for applying ``settings`` on ``profile``'s build.

    ``environ``: the environment the line will be pasted into (None: not checked);
    ``uses``: :data:`USES` features the program uses; ``private_pools``: the trace allocates
    into private pools; ``env_var``: the variable the line sets (default: the profile's).
    """
    config = settings.to_string()
    out: list[Advice] = []
    if environ is not None:
        out += env_override_warnings(environ, env_var or env_assignment(config, profile).env_var,
                                     config)
    es = settings.expandable_segments and profile.expandable_segments
    if es:
        out += es_conflict_warnings(uses, private_pools, profile.device)
    if es and settings.max_split_size is not None:
        if profile.max_split_blocks_expandable_reuse:
            out.append(Advice(
                "max-split-with-es", "high",
                f"max_split_size_mb with expandable_segments on {profile.name} (torch >= 2.12): "
                "get_free_block keeps cached expandable blocks at or above max_split_size from "
                "smaller requests, so reserved memory can grow without bound (782 MiB on 2.9.1 "
                "vs 16,000 MiB on 2.12-2.14 on the same reproducer); drop max_split_size_mb "
                "when expandable segments are on",
                "pytorch/pytorch#193400"))
        else:
            out.append(Advice(
                "max-split-with-es-upgrade", "warning",
                f"max_split_size_mb with expandable_segments is harmless on {profile.name}, but "
                "torch 2.12 and later grow reserved memory without bound with this pair; "
                "drop max_split_size_mb before upgrading",
                "pytorch/pytorch#193400"))
    if settings.garbage_collection_threshold > 0 and settings.per_process_memory_fraction >= 1.0:
        out.append(Advice(
            "gc-inert", "warning",
            "garbage_collection_threshold acts only when a per-process memory fraction is set "
            "(per_process_memory_fraction or torch.cuda.set_per_process_memory_fraction); "
            "alone it does nothing",
            "pytorch/pytorch#106660"))
    if 1 in settings.roundup_power2_divisions:
        out.append(Advice(
            "roundup-one-ignored", "warning",
            "a roundup_power2_divisions value of 1 is ignored (sizes in that interval are not "
            "rounded to a power of two); use 0 to mean no rounding, or 2 or more",
            "pytorch/pytorch#161139"))
    if any(settings.roundup_power2_divisions) and not profile.roundup_applied:
        out.append(Advice(
            "roundup-not-applied", "warning",
            f"{profile.name}: roundup_power2_divisions is not applied by this build",
            "pytorch/pytorch#160666"))
    out.append(Advice(
        "set-before-init", "info",
        "the settings must be in place before the first allocation on the device: export "
        "the variable in the launcher, not after torch has initialised the device",
        "axolotl-ai-cloud/axolotl#2183"))
    return out
