"""``accel_graph.check_capturable``: every capture-illegal operation of a function, at once.

Capture stops at the first illegal operation; porting a model means fixing them one by one. This
runs the function *eagerly on real data* under two flagging modes and reports every operation
capture would refuse, each with the Python source line that issued it:

- at the dispatcher (:class:`~torch.utils._python_dispatch.TorchDispatchMode`): the recorder's
  own rules (:func:`accel_graph.backends.capture_common.illegal_ops.illegal_reason`: host syncs,
  data-dependent shapes, boolean-mask indexing, ...), and, with a GPU ``target`` whose tensors
  are present, ops that mix host (CPU, non-0-dim) tensors with device tensors;
- at the Python API (:class:`~torch.overrides.TorchFunctionMode`), for what the dispatcher
  never sees: host reads (``.tolist()``, ``.numpy()``, ``numpy.asarray``, ``repr``/``print``,
  f-strings, pickling: the reads :mod:`accel_graph.backends.capture_common.hostreads` refuses in a
  capture), and, with a GPU ``target``,
  ``.cpu()`` / ``.to("cpu")`` (device-to-host copies, a sync) and factory calls without
  ``device=`` (they make host tensors on a GPU box);
- with a GPU ``target``, ``torch.cond`` / ``torch.while_loop`` where this torch version cannot
  capture them into that target's native graphs in any build (``while_loop`` on CUDA before
  torch's while-node capture, both on XPU); the recorder captures them everywhere.

Each finding also names the smallest enclosing ``nn.Module`` to mark as an eager island
(``Finding.island``; :mod:`accel_graph.graphs.island_hints`), by class and attribute path.

Nothing is captured and no pool is touched; the function runs as it would eagerly. The rules
are the recorder's, stated in ``backends/capture_common/`` (importing this module loads them, not
the recorder backend); ``import accel_graph`` loads neither, because the package face imports
this module only when ``check_capturable`` is first used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..backends.capture_common import hostreads
from ..backends.capture_common import islands as island_marks
from ..backends.capture_common.control_flow import SUPPORTED, undo_dynamo_skip
from ..backends.capture_common.frames import user_frame
from ..backends.capture_common.illegal_ops import illegal_reason
from ..backends.capture_common.pytree import tree_flatten
from ..backends.native.control_flow_support import python_level_refusal
from ..errors import ConfigError
from .baked_values import BakedValue, OpLog, find_baked_values
from .island_hints import (
    ModuleCall,
    ModuleStack,
    island_advice,
    islands_run_eagerly,
    module_roots,
)

__all__ = ["CapturabilityReport", "Finding", "check_capturable"]

_GPU_TYPES = frozenset({"cuda", "xpu", "hip", "mps", "npu", "privateuseone"})
_FACTORIES = frozenset({
    "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "empty_strided", "scalar_tensor",
})
_HOST_READS = {
    "tolist": ".tolist() copies the tensor to a Python list on the host (a sync the dispatcher "
    "never sees; under capture it reads memory that is not computed yet)",
    "numpy": ".numpy() hands the tensor's memory to numpy on the host (a sync; under capture "
    "the values are not computed yet)",
    "__array__": "numpy.asarray(tensor) hands the tensor's memory to numpy on the host (a sync; "
    "under capture the values are not computed yet)",
    "__repr__": "repr()/str()/print() of a tensor reads its values on the host (a sync; under "
    "capture the values are not computed yet); print after replay()",
    "__format__": "an f-string / format() of a tensor reads its values on the host (a sync; "
    "under capture the values are not computed yet); format after replay()",
    "__reduce_ex__": "pickling a tensor (torch.save, pickle.dumps) copies its bytes on the host "
    "(a sync; under capture the values are not computed yet)",
}


@dataclass(frozen=True)
class Finding:
    """One operation capture would refuse: the op, why, and the user source line."""

    op: str
    reason: str
    location: str
    #: ``"dispatch"`` (an aten op), ``"python"`` (a torch API call the dispatcher misses) or
    #: ``"baked"`` (a host value a graph would freeze; ``check_capturable(steps=2)``).
    level: str = "dispatch"
    #: The smallest enclosing ``nn.Module`` to mark as an eager island, or None (issued outside
    #: every module): ``{"path", "class", "root", "submodule", "within"}``
    #: (:meth:`accel_graph.graphs.island_hints.ModuleStack.resolve`).
    island: dict[str, Any] | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.location}: {self.op}: {self.reason}"


@dataclass
class CapturabilityReport:
    """What :func:`check_capturable` found. Truthy when nothing was found (``ok``)."""

    findings: list[Finding] = field(default_factory=list)
    target: str | None = None
    ops_seen: int = 0
    result: Any = field(default=None, repr=False)
    #: While the function runs: the module calls underway at each finding, by finding.
    _stack: ModuleStack | None = field(default=None, repr=False, compare=False)
    _calls: list[tuple[ModuleCall, ...]] = field(default_factory=list, repr=False, compare=False)
    #: How many torch.cond / while_loop / switch bodies are running (islands are refused there).
    _bodies: int = field(default=0, repr=False, compare=False)

    def _found(self, finding: Finding, calls: tuple[ModuleCall, ...] | None = None) -> None:
        """Add a finding made while the function runs, with the module calls underway (or
        ``calls``, those logged with a baked value's op)."""
        self.findings.append(finding)
        if calls is None:
            calls = self._stack.snapshot() if self._stack is not None else ()
        self._calls.append(calls)

    def _name_islands(self) -> None:
        """Once the function has returned: each finding's island (its calls' outputs known)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            self.findings = [replace(f, island=stack.resolve(calls))
                             for f, calls in zip(self.findings, self._calls)]
        self._calls = []

    @property
    def ok(self) -> bool:
        return not self.findings

    def __bool__(self) -> bool:
        return self.ok

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def unique(self) -> list[Finding]:
        """Findings with repeats (same op, reason and line, e.g. in a loop) folded."""
        seen: dict[tuple[str, str, str], Finding] = {}
        for f in self.findings:
            seen.setdefault((f.op, f.reason, f.location), f)
        return list(seen.values())

    def format(self) -> str:
        """A readable, one-line-per-finding summary."""
        if self.ok:
            return f"capturable: no capture-illegal operation in {self.ops_seen} ops"
        uniq = self.unique()
        lines = [_summary(self.findings) + f" ({len(uniq)} distinct)"
                 + (f" for target {self.target}" if self.target else "") + ":"]
        lines += [f"  {f}" for f in uniq]
        lines += island_advice([f.island for f in self.findings])
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "target": self.target, "ops_seen": self.ops_seen,
                "findings": [asdict(f) for f in self.findings]}

    def __str__(self) -> str:
        return self.format()


def _summary(findings: list[Finding]) -> str:
    """The count line's words: baked values are named as such, not as illegal operations.

    A baked value is a legal op whose Python argument a graph would freeze; calling it a
    "capture-illegal operation" sent readers looking for an op to remove (issue 29).
    """
    baked = sum(f.level == "baked" for f in findings)
    parts = []
    if len(findings) - baked:
        parts.append(f"{len(findings) - baked} capture-illegal operation(s)")
    if baked:
        parts.append(f"{baked} baked value(s)")
    return " and ".join(parts)


class _DispatchFlagger(TorchDispatchMode):
    #: torch.cond / torch.while_loop / switch arrive whole: their bodies run with the flagger on.
    supports_higher_order_operators = True

    def __init__(self, report: CapturabilityReport, target: str | None) -> None:
        super().__init__()
        self.report, self.target = report, target

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        if island_marks.running():  # an eager island's own work runs eagerly at replay: legal
            return func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        self.report.ops_seen += 1
        reason = illegal_reason(func, args, kwargs)
        if reason is None and self.target is not None:
            reason = _host_mix(func, args, kwargs, self.target)
        if reason is not None:
            self.report._found(Finding(str(func), reason, user_frame()))
        return func(*args, **kwargs)  # keep going: the point is to find every one


    def _higher_order(self, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
        """Run a higher-order operator as eager would, with its bodies flagged. Predicates are
        read here, with the flagger off: capture reads them at replay, not on the host."""
        self.report._bodies += 1
        try:
            return self._run_higher_order(func, args, kwargs)
        finally:
            self.report._bodies -= 1
            undo_dynamo_skip()

    def _run_higher_order(self, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
        name = func.name()
        native = None if self.target is None else python_level_refusal(name, self.target)
        if native is not None and name in SUPPORTED:  # the recorder takes it; the target's graphs not
            self.report._found(Finding(name, native, user_frame()))
        if name == "cond":
            pred, true_fn, false_fn, operands = args
            taken = true_fn if _host_bool(pred) else false_fn
            with self:  # only the branch taken runs (as everything here runs on real data)
                return taken(*operands)
        if name == "while_loop":
            cond_fn, body_fn, carried, *rest = args
            extra = tuple(rest[0]) if rest else ()
            carried = tuple(carried)
            while True:
                with self:
                    pred = cond_fn(*carried, *extra)
                if not _host_bool(pred):
                    return carried
                with self:
                    carried = tuple(body_fn(*carried, *extra))
        if name == "switch" and len(args) == 3 and isinstance(args[1], (tuple, list)):
            index, branches, operands = args
            k = _host_int(index)
            if 0 <= k < len(branches):
                with self:  # the branch the index selects, as eager
                    return branches[k](*operands)
            # Out of range: eager's operator raises (torch's switch() clamps first), as does
            # this call below, and a replay would raise ReplayError.
            self.report._found(Finding(name, (
                f"switch index {k} is out of range for {len(branches)} branches: the operator "
                f"raises in eager and replay raises ReplayError; call torch's switch(), which "
                f"clamps the index"), user_frame()))
            with _disable_current_modes():
                return func(*args, **kwargs)
        self.report._found(Finding(
            name, f"higher-order operator {name} is not supported during graph capture (the "
            f"recorder captures {', '.join(SUPPORTED)})", user_frame()))
        with _disable_current_modes():
            return func(*args, **kwargs)


def _host_int(index: Any) -> int:
    """A switch index's value, read with every dispatch mode off (capture reads it at replay)."""
    with _disable_current_modes():
        return int(index.item()) if isinstance(index, torch.Tensor) else int(index)


def _host_bool(pred: Any) -> bool:
    """A predicate's value, read with every dispatch mode off (capture reads it at replay)."""
    with _disable_current_modes():
        return bool(pred)


def _host_mix(func: Any, args: tuple, kwargs: dict, target: str) -> str | None:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    on_target = [t for t in tensors if t.device.type == target]
    if not on_target:
        return None
    host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
    if host:
        return (f"mixes host (CPU) tensors of shape {tuple(host[0].shape)} with {target} tensors: "
                f"a host-to-device copy, which capture cannot replay; create the tensor on the "
                f"device (device=x.device) outside or inside the captured region")
    out_dev = kwargs.get("device")
    if func.overloadpacket.__name__ in ("_to_copy", "copy_", "_copy_from") and (
        (out_dev is not None and torch.device(out_dev).type == "cpu")
        or (func.overloadpacket.__name__ != "_to_copy" and args and isinstance(args[0], torch.Tensor)
            and args[0].device.type == "cpu")):
        return f"copies a {target} tensor to the host (a device sync); keep it on the device"
    return None


class _FunctionFlagger(TorchFunctionMode):
    def __init__(self, report: CapturabilityReport, target: str | None) -> None:
        super().__init__()
        self.report, self.target = report, target

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D401
        kwargs = kwargs or {}
        if island_marks.running():
            return func(*args, **kwargs)
        reason = self._reason(func, args, kwargs)
        if reason is not None:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            self.report._found(Finding(name, reason, user_frame(), level="python"))
        return func(*args, **kwargs)

    def _reason(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        name = getattr(func, "__name__", "")
        if self.target is None:
            return None
        if name == "cpu" and args and isinstance(args[0], torch.Tensor):
            return f".cpu() copies to the host, a sync on {self.target}; keep the tensor on the device"
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            dev = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device)):
                    dev = a
            if dev is not None and torch.device(dev).type == "cpu":
                return f'.to("cpu") copies to the host, a sync on {self.target}; keep the tensor on the device'
        if name in _FACTORIES and getattr(func, "__module__", "") in ("torch", "torch._C._VariableFunctions", None) \
                and kwargs.get("device") is None and not _has_default_device(self.target):
            return (f"torch.{name}() without device= makes a host (CPU) tensor; on {self.target} "
                    f"using it with device tensors is a host-to-device copy capture cannot "
                    f"replay: pass device=")
        return None


@contextlib.contextmanager
def _host_reads(report: CapturabilityReport, target: str | None) -> Iterator[None]:
    """Report the host reads a capture refuses (:mod:`~accel_graph.backends.capture_common.hostreads`:
    ``tolist``, ``numpy``, ``numpy.asarray``, ``repr``/``print``, f-strings, pickling), with
    the same interception the capture uses, so both see the same reads. With a GPU ``target``
    only reads of its tensors count (CPU tensors are host memory there); else any tensor's."""
    reasons = {what: _HOST_READS[name] for name, what in hostreads.HOST_READS.items()}

    def found(what: str, exc: BaseException) -> None:
        report._found(Finding(what, reasons[what], user_frame(), level="python"))

    hostreads.acquire()
    token = hostreads.watch(target, lambda: True, found, raise_=False)
    try:
        yield
    finally:
        hostreads.unwatch(token)
        hostreads.release()


def _has_default_device(target: str) -> bool:
    get = getattr(torch, "get_default_device", None)
    return get is not None and get().type == target


def check_capturable(fn: Callable[..., Any], *args: Any, target: str | torch.device | None = None,
                     steps: int | None = 2, advance: Callable[[], Any] | None = None,
                     **kwargs: Any) -> CapturabilityReport:
    """Run ``fn(*args, **kwargs)`` eagerly and report every operation capture would refuse.

    Args:
        fn, args, kwargs: the function and real inputs; ``fn`` runs ``steps`` times, for
            real, under ``torch.no_grad()`` (its side effects happen each time).
        target: the device the code will be captured on (``"cuda"``, ``"xpu"``, a
            ``torch.device``). With a GPU target, CPU tensors count as host memory: ``.cpu()``,
            ``.to("cpu")``, factories without ``device=`` and ops mixing CPU tensors with
            target tensors are flagged too. None (default): the recorder's rules only.
        steps: how many times ``fn`` runs (default 2). From 2 on, baked host values are
            looked for too: each run is a real eager step (``advance()`` between runs, if
            given), and every op whose Python arguments changed between runs is reported
            (level ``"baked"``): a value read from mutable host state at capture, which a
            graph would replay frozen (a cache length read as an int; see
            :mod:`accel_graph.graphs.baked_values`). A plain ``Graph`` cannot see these at all, so the
            default looks for them. ``steps=1`` (or None): one run, no such check, for a
            function whose side effects must not happen twice.
        advance: a callable run between the steps (advance a position input, append a token);
            only with ``steps``.

    Returns a :class:`CapturabilityReport`: ``report.ok`` (also its truth value),
    ``report.findings`` (each with ``op``, ``reason``, ``location``), ``report.format()``, and
    ``report.result`` (what ``fn`` returned). Exceptions raised by ``fn`` propagate.
    """
    tgt = None if target is None else torch.device(target).type
    if tgt == "cpu":
        tgt = None  # host memory is the device: nothing more to flag
    if steps is None:
        steps = 1
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r}: pass a whole number of runs, 2 (the default: looks "
                          f"for baked host values) or 1 (one run, no such check)")
    if steps == 1 and advance is not None:
        raise ConfigError("advance= is run between steps: pass steps=2 (or more) with it")
    report = CapturabilityReport(target=None if target is None else str(target))
    stack = report._stack = ModuleStack(module_roots(fn, args, kwargs))
    log = OpLog(stack.snapshot) if steps >= 2 else contextlib.nullcontext()
    # The module calls underway, for every run: each finding names its island.
    def island_finding(op: str, reason: str, where: str) -> None:
        report._found(Finding(op, reason, where, level="python"))

    with stack, islands_run_eagerly(island_finding, lambda: report._bodies > 0) as quiet:
        with torch.no_grad(), _host_reads(report, tgt), _FunctionFlagger(report, tgt), \
                _DispatchFlagger(report, tgt), log:
            report.result = fn(*args, **kwargs)
        quiet()
        if isinstance(log, OpLog):
            found, report.result = find_baked_values(
                fn, args, kwargs, steps=steps, advance=advance, first=(log.ops, report.result),
                context=stack.snapshot)
            for f in found:
                report._found(Finding(f.op if isinstance(f, BakedValue) else f.later, f.reason,
                                      f.location, level="baked"), f.context)
    report._name_islands()
    return report
