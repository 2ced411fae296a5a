"""The native graph backends' shared base: :class:`NativeGraphBackend` (its graphs are
:class:`~.graph_impl.NativeGraphImpl`), over torch's own graph classes (``torch.cuda.CUDAGraph``, ``torch.xpu.XPUGraph``,
``torch.accelerator.Graph``). The cuda, hip and xpu backends subclass the backend and state only
their differences.

The split follows tinygrad's ``alloc``/``_alloc`` and RMM's ``allocate``/``do_allocate``: the
base owns the policy (probe order, nested-capture refusal, the current-device check, capture
modes, pool bookkeeping, the impl's lifecycle and its error messages); a subclass fills the
*mechanism hooks* listed under "mechanism hooks" in :class:`NativeGraphBackend`, each with its
contract. Everything vendor-specific is reached through ``self.module`` (``torch.cuda`` or
``torch.xpu``, looked up when called, never at import). Every torch API is feature-detected: GPU
hosts may run torch 2.11.

Beside it: pool handles and pool memory (:mod:`.pools`, ``backend.pools``); who captures where,
the side streams and the cleanup before a capture (:mod:`.capture_context`, a mix-in of the
backend); torch's errors as ``CaptureError`` (:mod:`.capture_errors`); what torch's graph classes
accept (:mod:`.torch_graphs`); one graph's capture lifecycle (:mod:`.graph_impl`) and its pieces
around eager islands (:mod:`.pieces`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from ...errors import BackendUnavailable
from ...foundation.compile_options import CompileOptions
from .. import presence
from ..base import (
    Backend,
    Capabilities,
    DeviceSpec,
    GraphImpl,
    PoolHandle,
    PoolStats,
)
from . import control_flow as control_flow
from . import control_flow_support as cf_support
from .capture_context import NativeCaptureContext
from .graph_impl import NativeGraphImpl
from .pools import NativePoolTable
from .torch_graphs import CUDA_GRAPH_CAPABILITIES, begin_params


class NativeGraphBackend(NativeCaptureContext, Backend):
    """Base of the backends built on a torch graph class (cuda, hip, xpu).

    A subclass sets the class attributes below and overrides the mechanism hooks where its
    vendor differs; the base's defaults are ``torch.cuda.CUDAGraph``'s behaviour. Everything
    else here is policy, which subclasses do not override: it is what makes the three backends
    behave the same (refusals, messages, bookkeeping).

    ``pools`` (a :class:`~.pools.NativePoolTable`) holds the pool bookkeeping; the
    :class:`Backend` pool methods delegate to it. Who captures where (the capture table, the
    nested-capture refusal, the current-device check, the side streams, the cleanup before a
    capture) comes from :class:`~.capture_context.NativeCaptureContext`.
    """

    #: ``torch.<module_name>`` is the vendor module: ``"cuda"`` (also on ROCm) or ``"xpu"``.
    module_name: ClassVar[str] = "cuda"
    #: The vendor's own default capture mode, used for ``capture_error_mode="default"``.
    vendor_default_mode: ClassVar[str] = "global"
    #: Why ``torch.<module_name>.is_available()`` may be False here, for the probe's reason.
    no_device_reason: ClassVar[str] = "no visible device"

    def __init__(self) -> None:
        super().__init__()  # NativeCaptureContext: the capture table, the side streams
        self.pools = NativePoolTable(self.name, lambda: self.module, self.module_name)
        self._specs: dict[int, DeviceSpec] = {}

    @property
    def module(self) -> Any:
        """``torch.cuda`` or ``torch.xpu`` (looked up per call so tests can substitute fakes)."""
        return getattr(torch, self.module_name)

    # -- policy: probe ---------------------------------------------------------------------
    @classmethod
    def probe(cls) -> str | None:
        """The build check (:meth:`probe_build`), then the vendor module, ``is_available()``
        and ``device_count()`` (:func:`..presence.module_reason`: a raising driver is a reason),
        then the graph class (:meth:`probe_graph_class`). Never initialises a device."""
        reason = cls.probe_build()
        if reason is not None:
            return reason
        mod = getattr(torch, cls.module_name, None)
        reason = presence.module_reason(cls.module_name, mod, cls.no_device_reason)
        if reason is not None:
            return reason
        return cls.probe_graph_class(mod)

    # -- mechanism hooks: a subclass overrides these where its vendor differs ---------------
    @classmethod
    def probe_build(cls) -> str | None:
        """Why this torch build is not one this backend serves (None: it is). Called first by
        :meth:`probe`; must be cheap and must not raise (cuda refuses ROCm builds here)."""
        return None

    @classmethod
    def probe_graph_class(cls, module: Any) -> str | None:
        """Why ``module`` (the vendor module, available) offers no graph class (None: it does).
        Must not construct a graph or touch a device."""
        if hasattr(module, "CUDAGraph"):
            return None
        return f"torch.{cls.module_name}.CUDAGraph is missing from this torch build"

    def capabilities(self) -> Capabilities:
        """Static capabilities; torch.cuda.CUDAGraph's by default."""
        return CUDA_GRAPH_CAPABILITIES

    def device_arch(self, index: int) -> str | None:
        """The arch string for ``DeviceSpec.arch`` of device ``index`` (``"sm_90"``,
        ``"gfx942"``), None when unknown. Called once per device; may start the runtime."""
        return None

    def check_device_usable(self, spec: DeviceSpec) -> None:
        """Called by ``new_graph`` before a graph is made on ``spec``: raise
        ``BackendUnavailable`` if graphs cannot run there (cuda: arch verdict), or warn."""

    def new_torch_graph(self, keep_graph: bool, torch_id: tuple[int, int] | None, mode: str) -> Any:
        """A fresh torch graph object for one capture. ``torch_id`` is the torch pool id the
        capture goes into (None: torch picks), ``mode`` the vendor capture mode. A
        ``RuntimeError`` becomes ``CaptureError``."""
        return self.module.CUDAGraph(keep_graph)

    def begin_capture(self, graph: Any, torch_id: tuple[int, int] | None, mode: str) -> None:
        """Start capture on ``graph`` (from :meth:`new_torch_graph`) into ``torch_id`` with
        ``mode``, passing whichever keywords this torch accepts. A ``RuntimeError`` becomes
        ``CaptureError`` with a hint; the pool entry is forgotten either way."""
        params = begin_params(graph)
        kwargs: dict[str, Any] = {}
        if "pool" in params:
            kwargs["pool"] = torch_id
        if "capture_error_mode" in params:
            kwargs["capture_error_mode"] = mode
        graph.capture_begin(**kwargs)

    def control_flow_support(self) -> cf_support.ControlFlowSupport:
        """What this backend captures of torch.cond / torch.while_loop / torch.switch
        (feature-detected by API on each call; :mod:`.control_flow_support`). Must not raise."""
        return cf_support.detect_support(self.name, self.module_name, self.module)

    def control_flow_warmup(self, device: DeviceSpec) -> AbstractContextManager[Any]:
        """A context for the eager warm-up before a capture with torch.cond: both branches
        are captured once into a throwaway graph, so the branch not taken by the warm-up has
        its first-use setup outside the real capture. A no-op where nothing is captured natively."""
        return control_flow.warmup(self.control_flow_support(), self.module, device)

    def before_reset(self, device: DeviceSpec) -> None:  # noqa: B027 - hip overrides
        """Called just before ``reset()`` drops a graph executable on ``device`` (hip
        synchronizes here). May run inside another capture: must not synchronize then."""

    def island_device(self, device: DeviceSpec) -> torch.device:
        """The torch device of ``device``: eager islands' arguments and outputs must be on it."""
        return torch.device(device.device_type, device.index)

    def dump_graph(self, graph: Any, path: str) -> None:
        """Write torch's DOT dump of ``graph`` to ``path``."""
        graph.debug_dump(path)

    def describe(self) -> Iterator[tuple[str, str]]:
        """Doctor facts: torch, the vendor module, the device count. Subclasses add theirs
        after ``yield from super().describe()``. Must not raise."""
        facts = [("torch", torch.__version__), ("torch module", f"torch.{self.module_name}")]
        try:
            facts.append(("device_count", str(self.module.device_count())))
        except Exception as exc:
            facts.append(("device_count", f"unknown ({exc})"))
        facts.append(("control flow", cf_support.summary(self.control_flow_support())))
        return iter(facts)

    # -- policy: capture modes -----------------------------------------------------------------
    def vendor_mode(self, mode: str) -> str:
        """Map our ``capture_error_mode`` onto the vendor's, warning where it is ignored."""
        honoured = self.capabilities().capture_error_modes
        if mode not in honoured:
            warnings.warn(
                f"the {self.name} backend honours only capture_error_mode "
                f"{', '.join(map(repr, honoured))}; {mode!r} is ignored",
                stacklevel=4,
            )
            mode = "default"
        return self.vendor_default_mode if mode == "default" else mode

    # -- the Backend contract ----------------------------------------------------------------
    def device_spec(self, device: torch.device) -> DeviceSpec:
        mod = self.module
        if device.type not in self.device_types:
            raise BackendUnavailable(
                f"the {self.name} backend serves {', '.join(self.device_types)} devices, not {device}"
            )
        # Reading the arch starts the device runtime (torch's get_device_capability does);
        # a Graph on this device would start it anyway.
        index = device.index if device.index is not None else int(mod.current_device())
        spec = self._specs.get(index)
        if spec is not None:
            return spec
        count = int(mod.device_count())
        if not 0 <= index < count:
            have = ", ".join(f"{device.type}:{i}" for i in range(count)) or "none"
            raise BackendUnavailable(
                f"device {device.type}:{index} does not exist: this host has {count} "
                f"{device.type} device(s) ({have}); pass one of those"
            )
        spec = self._specs[index] = DeviceSpec(self.name, device.type, index, self.device_arch(index))
        return spec

    def new_graph(self, device: DeviceSpec, *, keep_graph: bool,
                  compile: CompileOptions | None) -> GraphImpl:
        if compile is not None:
            # Native graphs are already launch-free: a compile request (and its compile_options)
            # is ignored, never silently: warned at the line that built the Graph (base.py).
            warnings.warn(
                f"compile='inductor' is ignored on the {self.name} backend: its graphs are "
                f"already launch-free",
                stacklevel=4,
            )
        self.check_device_usable(device)
        return NativeGraphImpl(self, device, keep_graph=keep_graph)

    def graph_pool_handle(self, device: DeviceSpec) -> PoolHandle:
        return self.pools.new_handle(device)

    def resolve_pool(self, pool: object, device: DeviceSpec) -> PoolHandle:
        return self.pools.resolve(pool, device)

    def pool_stats(self, pool: PoolHandle) -> PoolStats | None:
        return self.pools.stats(pool)
