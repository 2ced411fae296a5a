"""Capture: a dispatch mode that records aten ops instead of running them.

During capture nothing but metadata executes. Each functional op gets its outputs' shape,
stride and dtype from meta execution (cached per op and argument metadata) and its memory from
the graph's pool; views run for real (they touch no data) and alias pool or input memory;
in-place and ``out=`` ops are recorded as they are and run at replay. Tensors that existed
before capture are inputs by reference. Operations that real device-graph capture forbids raise
:class:`~accel_graph.errors.CaptureError` at the op.

The mode is thread-local (``TorchDispatchMode``), so a capture records only its own thread.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ...errors import CaptureError
from . import ops as opinfo
from .pool import PoolRef, RecorderPool

_tls = threading.local()
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


#: Output metadata by (op, argument metadata), shared by every capture in the process, so
#: repeated layers and repeated captures (buckets) do not pay meta execution again.
_META_CACHE: dict[Any, _MetaResult] = {}
_META_CACHE_MAX = 1 << 16


def tree_flatten(x: Any) -> tuple[list, None]:
    """Leaves of nested tuples/lists/dicts (a fast subset of torch's pytree for aten args)."""
    out: list = []
    _flatten_into(x, out)
    return out, None


def _flatten_into(x: Any, out: list) -> None:
    if isinstance(x, (tuple, list)):
        for y in x:
            _flatten_into(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flatten_into(y, out)
    else:
        out.append(x)


def tree_map(fn: Any, x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf of nested tuples/lists/dicts."""
    if isinstance(x, tuple):
        return tuple(tree_map(fn, y) for y in x)
    if isinstance(x, list):
        return [tree_map(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def active_capture() -> Capture | None:
    """The capture underway on this thread, if any."""
    return getattr(_tls, "capture", None)


def user_frame() -> str:
    """``file:line in function`` of the innermost caller outside torch and accel_graph."""
    frame = sys._getframe(1)
    while frame is not None:
        fname = os.path.abspath(frame.f_code.co_filename)
        if not (fname.startswith(_TORCH_DIR) or fname.startswith(_PKG_DIR)) or "/tests/" in fname:
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


@dataclass
class Step:
    """One recorded operation.

    Arguments keep inputs (tensors that existed before capture) by reference and pool tensors
    as :class:`~.pool.PoolRef` locations, so capture holds no pool memory alive. ``kind`` is
    ``"mutate"`` (in-place / out= as called) or a functional
    :class:`~accel_graph.backends.recorder.ops.Strategy` kind; ``outputs`` are the locations a
    functional op writes.
    """

    func: OpOverload
    kind: str
    args: tuple
    kwargs: dict
    outputs: tuple = ()
    strategy: opinfo.Strategy | None = None
    extra: Any = None
    #: Index of each output among the op's flattened results (for rebuilding it as FX).
    positions: tuple[int, ...] = ()


@dataclass
class InputRecord:
    """A tensor that existed before capture, with what replay checks to detect staleness."""

    tensor: torch.Tensor
    data_ptr: int
    shape: torch.Size
    stride: tuple[int, ...]
    name: str = ""


@dataclass
class _MetaResult:
    out: Any  # meta outputs (pytree), or a non-tensor value
    aliases: tuple[int | None, ...] = field(default_factory=tuple)  # per flat output


def _key_of(x: Any) -> Any:
    """Hashable metadata of an op argument (module level: a nested recursive function
    would be a reference cycle per op)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.device.type, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_key_of(y) for y in x)
    if isinstance(x, torch.Generator):
        return "G"
    # The type matters: x * 2 and x * 2.0 give different dtypes, yet 2 == 2.0.
    return (type(x), x)


class Capture:
    """The state of one capture: recorded steps, inputs and pool tensors."""

    def __init__(self, pool: RecorderPool, device: torch.device, *, poison: bool = False) -> None:
        self.pool = pool
        self.device = device
        self.poison = poison
        self.steps: list[Step] = []
        self.inputs: dict[int, InputRecord] = {}
        # Views of inputs created during capture map back to the input they view, so a stale
        # check watches the user's tensor and not our own view of it.
        self._roots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.meta_cache = _META_CACHE
        self.op_count = 0
        #: ("alloc", key, bytes) / ("free", key, 0) in capture order, for standalone_bytes.
        self.events: list[tuple[str, int, int]] = []
        self.refs: dict[int, PoolRef] = {}  # allocation key -> location, for the outputs
        self.reserved_before = pool.reserved_bytes()
        self._last_args: Any = None
        self._last_kwargs: Any = None
        self._last_tensors: list[torch.Tensor] = []
        self.mode = _RecordingMode(self)

    def freeze(self, x: Any) -> Any:
        """``x`` with every pool tensor replaced by its location (no strong reference kept)."""
        pool = self.pool

        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and pool.owns(t):
                return pool.ref(t)
            return t

        return tree_map(one, x)

    def live_outputs(self) -> list[PoolRef]:
        """Locations allocated by this capture whose tensors are still alive: the outputs."""
        freed = {key for action, key, _ in self.events if action == "free"}
        return [ref for key, ref in self.refs.items() if key not in freed]

    # -- classification of tensors ------------------------------------------------------
    def is_pool_tensor(self, t: torch.Tensor) -> bool:
        return self.pool.owns(t)

    def note_input(self, t: torch.Tensor) -> None:
        root = self._roots.get(t, t)
        key = id(root)
        if key not in self.inputs:
            self.inputs[key] = InputRecord(root, root.data_ptr(), root.shape, root.stride())

    # -- meta execution -----------------------------------------------------------------
    def _meta_key(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        try:
            k = (func, _key_of(args), tuple(sorted((n, _key_of(v)) for n, v in kwargs.items())))
            hash(k)
            return k
        except TypeError:
            return None

    def run_meta(self, func: OpOverload, args: tuple, kwargs: dict) -> _MetaResult:
        """Output metadata of ``func``: meta kernels first, zero stand-ins second, else refuse."""
        key = self._meta_key(func, args, kwargs)
        if key is not None:
            hit = self.meta_cache.get(key)
            if hit is not None:
                return hit
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        try:
            result = self._run_on(func, args, kwargs, "meta", flat_in)
        except Exception as meta_exc:  # no meta kernel: one run on zero-filled stand-ins
            try:
                result = self._run_on(func, args, kwargs, "zeros", flat_in)
            except Exception as exc:
                raise CaptureError(
                    f"cannot capture {func} (called at {user_frame()}): its output metadata could "
                    f"not be inferred (meta kernel: {meta_exc}; stand-in run: {exc}). Move this op "
                    f"out of the captured region or file an issue."
                ) from exc
        if key is not None:
            if len(self.meta_cache) >= _META_CACHE_MAX:
                self.meta_cache.clear()
            self.meta_cache[key] = result
        return result

    def _run_on(self, func: OpOverload, args: tuple, kwargs: dict, how: str, flat_in: list) -> _MetaResult:
        def convert(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if how == "meta":
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return torch.zeros_like(x, memory_format=torch.preserve_format) if x.is_contiguous() else (
                torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).zero_()
            )

        m_args = tree_map(convert, args)
        m_kwargs = tree_map(convert, kwargs)
        if how == "meta" and "device" in m_kwargs:
            m_kwargs["device"] = "meta"
        with torch.no_grad():
            out = func(*m_args, **m_kwargs)
        in_storages = [
            t.untyped_storage()._cdata for t in tree_flatten((m_args, m_kwargs))[0]
            if isinstance(t, torch.Tensor)
        ]
        aliases = []
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                s = o.untyped_storage()._cdata
                aliases.append(in_storages.index(s) if s in in_storages else None)
        return _MetaResult(out, tuple(aliases))

    # -- the handler --------------------------------------------------------------------
    def handle(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        try:
            return self._handle(func, args, kwargs)
        finally:
            # Drop the per-op memo: holding this op's arguments would keep tensors that die
            # right after it alive into the next op, and their memory from being reused.
            self._last_args = self._last_kwargs = None
            self._last_tensors = []

    def _handle(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        self.op_count += 1
        reason = opinfo.illegal_reason(func, args, kwargs)
        if reason is not None:
            raise CaptureError(
                f"{func} is not allowed during graph capture (called at {user_frame()}): {reason}."
            )
        schema = func._schema
        tags = func.tags
        if torch.Tag.inplace_view in tags:
            # Metadata-only in-place ops (t_, unsqueeze_, as_strided_) change the tensor object
            # now, exactly as in eager, and touch no data: run, record nothing.
            return func(*args, **kwargs)
        if schema.is_mutable:
            return self._record_mutation(func, args, kwargs)
        if opinfo._returns_host_value(func):
            return func(*args, **kwargs)  # pure metadata (METADATA_OPS); illegal ones refused above
        if func is _LIFT_FRESH:
            return self._record_constant(args[0])
        meta = self.run_meta(func, args, kwargs)
        flat_out, _ = tree_flatten(meta.out)
        if flat_out and all(a is not None for a in meta.aliases):
            return self._run_view(func, args, kwargs)
        if any(a is not None for a in meta.aliases):
            raise CaptureError(
                f"{func} returns some outputs that alias its inputs and some that do not; the "
                f"recorder cannot capture that mix (called at {user_frame()})"
            )
        return self._record_functional(func, args, kwargs, flat_out, meta.out)

    def _record_constant(self, const: torch.Tensor) -> torch.Tensor:
        """``torch.tensor(data)`` inside capture: pool memory refilled from a private copy.

        Like a host-to-device copy in a CUDA graph, every replay rewrites the constant, so
        in-place writes to it during the graph or by the user between replays do not persist.
        """
        src = const.detach().clone()  # private: the user's later writes cannot reach it
        out = self.pool.allocate(const.shape, const.stride(), const.dtype, const.device)
        self.refs[self.events[-1][1]] = self.pool.ref(out)
        self.note_input(src)
        self.steps.append(Step(_LIFT_FRESH, "copy", (src,), {}, (self.pool.ref(out),),
                               opinfo.Strategy("copy", why="constant made in capture, refilled by copy_()"),
                               src, (0,)))
        return out

    def _tensor_args(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        # One op asks several times (inputs, device, views): flatten its arguments once.
        if args is self._last_args and kwargs is self._last_kwargs:
            return self._last_tensors
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        self._last_args, self._last_kwargs, self._last_tensors = args, kwargs, tensors
        return tensors

    def _note_inputs(self, args: tuple, kwargs: dict) -> None:
        for t in self._tensor_args(args, kwargs):
            if not self.is_pool_tensor(t):
                self.note_input(t)

    def _run_view(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)  # views touch no data
        flat = tree_flatten(out)[0]
        # Interpreted replay skips views (their results alias memory replay refreshes); the
        # compiled program keeps them so Inductor sees how each view relates to its base.
        self.steps.append(Step(
            func, "view", self.freeze(args), self.freeze(dict(kwargs)),
            tuple(self.freeze(o) for o in flat if isinstance(o, torch.Tensor)),
            positions=tuple(i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)),
        ))
        ins = self._tensor_args(args, kwargs)
        if ins and not self.is_pool_tensor(ins[0]):
            root = self._roots.get(ins[0], ins[0])
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and o is not root:
                    self._roots[o] = root
        return out

    def _record_mutation(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        name = func.overloadpacket.__name__
        if name in ("set_", "resize_", "resize_as_", "_resize_output_", "_local_scalar_dense"):
            raise CaptureError(
                f"{func} re-points or resizes a tensor during capture (called at {user_frame()}); "
                f"allocate tensors at their final size before capture"
            )
        # Check that the op would not resize its outputs (out= with a wrong shape): replay
        # writes in place, so a resize at capture time cannot be replayed.
        meta = self.run_meta(func, args, kwargs)
        mutated = self._mutated_tensors(func, args, kwargs)
        for t in mutated:
            if isinstance(t, torch.Tensor) and t.numel() == 0 and any(
                isinstance(m, torch.Tensor) and m.numel() for m in tree_flatten(meta.out)[0]
            ):
                raise CaptureError(
                    f"{func} would resize its out= tensor during capture (called at "
                    f"{user_frame()}); allocate the out= tensor with its final shape"
                )
        self._note_inputs(args, kwargs)
        self.steps.append(Step(func, "mutate", self.freeze(args), self.freeze(dict(kwargs))))
        # In-place and out= ops return the tensors they mutate, per their schema.
        rets = []
        for ret in func._schema.returns:
            alias = ret.alias_info
            if alias is None:
                rets.append(None)
                continue
            rets.append(self._find_alias_arg(func, args, kwargs, alias))
        if len(rets) == 0:
            return None
        if any(r is None for r in rets):
            # Returns that alias nothing are fresh results of a mutating op (rare); take their
            # metadata from meta execution and give them pool memory like functional outputs.
            raise CaptureError(
                f"{func} mutates an input and also returns a fresh tensor; the recorder cannot "
                f"capture that (called at {user_frame()})"
            )
        return rets[0] if len(rets) == 1 else tuple(rets)

    def _mutated_tensors(self, func: OpOverload, args: tuple, kwargs: dict) -> list[Any]:
        out = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(args[i] if i < len(args) else kwargs.get(a.name))
        return out

    def _find_alias_arg(self, func: OpOverload, args: tuple, kwargs: dict, alias: Any) -> Any:
        sets = alias.before_set
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == sets:
                return args[i] if i < len(args) else kwargs.get(a.name)
        return None

    def _output_device(self, args: tuple, kwargs: dict) -> torch.device:
        dev = kwargs.get("device")
        if dev is not None:
            return torch.device(dev)
        fallback = None
        for t in self._tensor_args(args, kwargs):
            if t.device.type != "cpu" or t.dim() > 0:
                return t.device
            fallback = fallback or t.device
        return fallback or (self.device if self.device.type == "cpu" else torch.device("cpu"))

    def _record_functional(self, func: OpOverload, args: tuple, kwargs: dict, flat_meta: list,
                           structure: Any) -> Any:
        device = self._output_device(args, kwargs)
        outs = []
        layout = _input_layout(func, args)
        for m in flat_meta:
            if not isinstance(m, torch.Tensor):
                outs.append(m)
                continue
            stride = m.stride()
            if layout is not None and m.dim() == layout[1]:
                stride = torch.empty_strided(m.shape, m.stride(), device="meta").contiguous(
                    memory_format=layout[0]).stride()
            t = self.pool.allocate(m.shape, stride, m.dtype, device)
            self.refs[self.events[-1][1]] = self.pool.ref(t)
            if self.poison:
                _poison(t)
            outs.append(t)
        self._note_inputs(args, kwargs)
        strategy = opinfo.choose_strategy(func, args, kwargs)
        tensor_outs = tuple(o for o in outs if isinstance(o, torch.Tensor))
        extra = None
        if strategy.kind == "fill":
            extra = opinfo.fill_value(func, args, kwargs)
        elif strategy.kind == "random":
            extra = opinfo.random_call(func, args, kwargs)
        elif strategy.kind == "copy":
            srcs = self._tensor_args(args, kwargs)
            extra = srcs[0] if srcs else None
            if extra is None:
                strategy = opinfo.Strategy("compute", why="copy op without a tensor source")
        elif strategy.kind == "out" and len(strategy.out_names) != 1 and len(strategy.out_names) != len(tensor_outs):
            strategy = opinfo.Strategy("compute", why=f"{strategy.op} out arguments do not match outputs")
        elif strategy.kind == "out":
            # Interpreted replay's arguments (numbers pre-wrapped); the compiled program keeps
            # the Python numbers, which Inductor folds into its kernels.
            wrapped = _prewrap_numbers(strategy.op, args)
            extra = wrapped if wrapped is not args else None
        positions = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor))
        self.steps.append(Step(func, strategy.kind, self.freeze(args), self.freeze(dict(kwargs)),
                               self.freeze(tensor_outs), strategy, self.freeze(extra), positions))
        it = iter(outs)
        return tree_map(lambda _: next(it), structure)


def _prewrap_numbers(op: OpOverload, args: tuple) -> tuple:
    """Python numbers passed where ``op`` takes a Tensor, as 0-dim tensors made once.

    Eager wraps such a number in a fresh float64/int64 tensor on every call and the kernel
    casts it to the computation dtype (two allocations a call on the CPU). A 0-dim tensor
    already of that dtype (``torch.result_type`` of the tensor operand and the number) gives
    the same value and the same type promotion, and replay allocates nothing for it.
    """
    params = opinfo.tensor_params(op)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or not params or not any(
        i < len(args) and isinstance(args[i], (int, float)) and not isinstance(args[i], bool)
        for i, _ in params
    ):
        return args
    out = list(args)
    for i, _name in params:
        if i < len(out) and isinstance(out[i], (int, float)) and not isinstance(out[i], bool):
            dtype = torch.result_type(first, out[i])
            out[i] = torch.tensor(out[i], dtype=dtype)  # CPU 0-dim: a "cpu scalar" to kernels
    return tuple(out)


def _input_layout(func: OpOverload, args: tuple) -> tuple[torch.memory_format, int] | None:
    """The channels_last layout an op's output takes from its first input, if it does."""
    if func.overloadpacket.__name__ not in opinfo.LAYOUT_FOLLOWING_OPS or not args:
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_contiguous():
        return None
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last, 4
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d, 5
    return None


def _poison(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0x5A)


class _RecordingMode(TorchDispatchMode):
    """Routes every aten op of the capturing thread to its :class:`Capture`."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D401
        return self.capture.handle(func, args, kwargs or {})


# TorchDispatchMode.__init_subclass__ wraps __torch_dispatch__ in torch._disable_dynamo, whose
# first call imports torch._dynamo (seconds) and which adds a frame to every recorded op.
# Capture refuses to run inside a compiled frame, so the wrapper protects nothing here.
_RecordingMode.__torch_dispatch__ = getattr(  # type: ignore[method-assign]
    _RecordingMode.__torch_dispatch__, "__wrapped__", _RecordingMode.__torch_dispatch__
)
