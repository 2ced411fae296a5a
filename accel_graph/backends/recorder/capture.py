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
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import CaptureError
from . import ops as opinfo
from .pool import PoolRef, RecorderPool

_tls = threading.local()
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_Tensor = torch.Tensor


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


_T = "T"
_LIST_TYPES = (list, tuple)


def _key_of(x: Any) -> Any:
    """Hashable metadata of an op argument (module level: a nested recursive function
    would be a reference cycle per op)."""
    if isinstance(x, _Tensor):
        return (_T, x.shape, x.stride(), x.dtype, x.device, x.storage_offset())
    if isinstance(x, _LIST_TYPES):
        return tuple([_key_of(y) for y in x])
    if isinstance(x, torch.Generator):
        return "G"
    # The type matters: x * 2 and x * 2.0 give different dtypes, yet 2 == 2.0.
    return (x.__class__, x)


def _op_key(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The key of an op's metadata caches: the op, its arguments' metadata, and the default
    dtype (factories and Python numbers take it). May be unhashable (callers catch TypeError)."""
    if kwargs:
        kw: Any = tuple(sorted([(n, _key_of(v)) for n, v in kwargs.items()]))
    else:
        kw = ()
    return (func, tuple([_key_of(a) for a in args]), kw, torch.get_default_dtype())


# Plan kinds: what a cached op does on every later call with the same argument metadata.
_RUN, _MUTATE, _VIEW, _FUNCTIONAL = "run", "mutate", "view", "functional"


class _Plan:
    """Everything about one (op, argument metadata) that capture decides once.

    Legality, the view/functional/in-place classification, output shapes, strides (with the
    channels_last rule applied), dtypes and device, the replay strategy and the argument
    positions of Python numbers to pre-wrap depend only on the op and its arguments' metadata
    (the plan key), so they are worked out on the first call and reused; per call, capture only
    allocates outputs, notes inputs and records the step. Values of Python numbers (fill
    values, numbers to pre-wrap) and generators are read per call, never from the plan.
    """

    __slots__ = ("kind", "rets", "specs", "device", "single", "structure", "strategy",
                 "positions", "prewrap")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.rets: tuple[tuple[int, str], ...] = ()  # mutate: where each return comes from
        self.specs: tuple[Any, ...] = ()  # functional: (shape, stride, dtype) or (None, value)
        self.device: torch.device | None = None
        self.single = False  # functional: the op returns one tensor
        self.structure: Any = None  # functional: the output pytree (meta), when not single
        self.strategy: opinfo.Strategy | None = None
        self.positions: tuple[int, ...] = ()
        self.prewrap: tuple[int, ...] = ()  # out: argument indices holding Python numbers


#: Plans by op key, shared by every capture in the process (see :class:`_Plan`).
_PLANS: dict[Any, _Plan] = {}


class Capture:
    """The state of one capture: recorded steps, inputs and pool tensors."""

    def __init__(self, pool: RecorderPool, device: torch.device, *, poison: bool = False) -> None:
        self.pool = pool
        self.device = device
        self.poison = poison
        self.steps: list[Step] = []
        self.inputs: dict[int, InputRecord] = {}
        # Views of inputs created during capture map back to the input they view, so a stale
        # check watches the user's tensor and not our own view of it: id(view) -> (weak
        # reference to the view, input). An entry whose view died is ignored (its id may be
        # reused by another tensor) and goes with the capture.
        self._roots: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.meta_cache = _META_CACHE
        self.op_count = 0
        #: ("alloc", key, bytes) / ("free", key, 0) in capture order, for standalone_bytes.
        self.events: list[tuple[str, int, int]] = []
        self.refs: dict[int, PoolRef] = {}  # allocation key -> location, for the outputs
        #: Pool segments of every location recorded (the program's segments).
        self.segments: set[int] = set()
        # Locations of pool tensors seen in this capture, so an argument seen again is not
        # asked of the pool: id(tensor) -> (weak reference, data_ptr, shape, stride, dtype,
        # location). An entry holds while that object lives with that address and metadata
        # (in-place view ops and ``t.data = other``, which need not dispatch anything, change
        # them; a location is only an address, a shape, strides and a dtype).
        self._locs: dict[int, tuple[Any, ...]] = {}
        self.reserved_before = pool.reserved_bytes()
        self.mode = _RecordingMode(self)

    # -- pool locations -----------------------------------------------------------------
    def _loc(self, t: torch.Tensor) -> PoolRef | None:
        """The location of a pool tensor, or None for any other tensor."""
        entry = self._locs.get(id(t))
        if (entry is not None and entry[0]() is t and entry[1] == t.data_ptr()
                and entry[2] == t.shape and entry[3] == t.stride() and entry[4] is t.dtype):
            return entry[5]
        pool = self.pool
        if pool.owns(t):
            ref = pool.ref(t)
            self.segments.add(ref.segment)
            self._locs[id(t)] = (weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.dtype, ref)
            return ref
        return None

    def _frozen(self, x: Any, note: bool) -> Any:
        """``x`` with pool tensors replaced by their locations; other tensors (inputs) are
        kept by reference and, with ``note``, recorded as inputs. Containers are rebuilt."""
        if isinstance(x, _Tensor):
            ref = self._loc(x)
            if ref is not None:
                return ref
            if note:
                self.note_input(x)
            return x
        if isinstance(x, tuple):
            return tuple([self._frozen(y, note) for y in x])
        if isinstance(x, list):
            return [self._frozen(y, note) for y in x]
        if isinstance(x, dict):
            return {k: self._frozen(v, note) for k, v in x.items()}
        return x

    def _frozen_args(self, args: tuple, kwargs: dict, note: bool) -> tuple[tuple, dict]:
        """Frozen ``args`` and a frozen copy of ``kwargs``; inputs noted in flattening order."""
        frozen = self._frozen
        fargs = tuple([frozen(a, note) for a in args])
        fkwargs = {k: frozen(v, note) for k, v in kwargs.items()} if kwargs else {}
        return fargs, fkwargs

    def freeze(self, x: Any) -> Any:
        """``x`` with every pool tensor replaced by its location (no strong reference kept)."""
        return self._frozen(x, False)

    def live_outputs(self) -> list[PoolRef]:
        """Locations allocated by this capture whose tensors are still alive: the outputs."""
        freed = {key for action, key, _ in self.events if action == "free"}
        return [ref for key, ref in self.refs.items() if key not in freed]

    # -- classification of tensors ------------------------------------------------------
    def is_pool_tensor(self, t: torch.Tensor) -> bool:
        return self.pool.owns(t)

    def _root(self, t: torch.Tensor) -> torch.Tensor:
        entry = self._roots.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return t

    def note_input(self, t: torch.Tensor) -> None:
        root = self._root(t) if self._roots else t
        key = id(root)
        if key not in self.inputs:
            self.inputs[key] = InputRecord(root, root.data_ptr(), root.shape, root.stride())

    # -- meta execution -----------------------------------------------------------------
    def _meta_key(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        try:
            k = _op_key(func, args, kwargs)
            hash(k)
            return k
        except TypeError:
            return None

    def run_meta(self, func: OpOverload, args: tuple, kwargs: dict, key: Any = False) -> _MetaResult:
        """Output metadata of ``func``: meta kernels first, zero stand-ins second, else refuse.

        ``key`` is the op key when the caller has it (None: unhashable arguments)."""
        if key is False:
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
        self.op_count += 1
        try:
            key: Any = _op_key(func, args, kwargs)
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: decide afresh, cache nothing
            key, plan = None, None
        if plan is None:
            plan = self._plan(func, args, kwargs, key)
            if plan is None:  # made here, never cached (constants)
                return self._record_constant(args[0])
        kind = plan.kind
        if kind is _FUNCTIONAL:
            return self._record_functional(func, args, kwargs, plan)
        if kind is _VIEW:
            return self._run_view(func, args, kwargs)
        if kind is _MUTATE:
            return self._record_mutation(func, args, kwargs, plan)
        # Metadata-only in-place ops (t_, unsqueeze_, as_strided_) change the tensor object
        # now, exactly as in eager, and touch no data; pure metadata queries (METADATA_OPS;
        # illegal ones are refused when planning): run, record nothing.
        return func(*args, **kwargs)

    def _plan(self, func: OpOverload, args: tuple, kwargs: dict, key: Any) -> _Plan | None:
        """Decide what ``func`` does with arguments of this metadata; raise CaptureError for
        what capture refuses. The plan is cached under ``key`` (None: not cached)."""
        reason = opinfo.illegal_reason(func, args, kwargs)
        if reason is not None:
            raise CaptureError(
                f"{func} is not allowed during graph capture (called at {user_frame()}): {reason}."
            )
        if func is _LIFT_FRESH:
            return None
        tags = func.tags
        if torch.Tag.inplace_view in tags:
            plan = _Plan(_RUN)
        elif func._schema.is_mutable:
            plan = self._plan_mutation(func, args, kwargs, key)
        elif opinfo._returns_host_value(func):
            plan = _Plan(_RUN)
        else:
            plan = self._plan_functional(func, args, kwargs, key)
        if key is not None:
            if len(_PLANS) >= _META_CACHE_MAX:
                _PLANS.clear()
            _PLANS[key] = plan
        return plan

    def _plan_functional(self, func: OpOverload, args: tuple, kwargs: dict, key: Any) -> _Plan:
        meta = self.run_meta(func, args, kwargs, key)
        flat_meta, _ = tree_flatten(meta.out)
        if flat_meta and all(a is not None for a in meta.aliases):
            return _Plan(_VIEW)
        if any(a is not None for a in meta.aliases):
            raise CaptureError(
                f"{func} returns some outputs that alias its inputs and some that do not; the "
                f"recorder cannot capture that mix (called at {user_frame()})"
            )
        plan = _Plan(_FUNCTIONAL)
        layout = _input_layout(func, args)
        specs: list[Any] = []
        for m in flat_meta:
            if not isinstance(m, torch.Tensor):
                specs.append((None, m))
                continue
            stride = m.stride()
            if layout is not None and m.dim() == layout[1]:
                stride = torch.empty_strided(m.shape, m.stride(), device="meta").contiguous(
                    memory_format=layout[0]).stride()
            specs.append((m.shape, stride, m.dtype))
        plan.specs = tuple(specs)
        plan.device = self._output_device(args, kwargs)
        plan.single = isinstance(meta.out, torch.Tensor)
        plan.structure = meta.out
        plan.positions = tuple(i for i, s in enumerate(specs) if s[0] is not None)
        n_tensors = len(plan.positions)
        strategy = opinfo.choose_strategy(func, args, kwargs)
        if strategy.kind == "copy":
            if _first_tensor((args, kwargs)) is None:
                strategy = opinfo.Strategy("compute", why="copy op without a tensor source")
        elif strategy.kind == "out" and len(strategy.out_names) != 1 and len(strategy.out_names) != n_tensors:
            strategy = opinfo.Strategy("compute", why=f"{strategy.op} out arguments do not match outputs")
        elif strategy.kind == "out":
            plan.prewrap = _number_positions(strategy.op, args)
        plan.strategy = strategy
        return plan

    def _plan_mutation(self, func: OpOverload, args: tuple, kwargs: dict, key: Any) -> _Plan:
        name = func.overloadpacket.__name__
        if name in ("set_", "resize_", "resize_as_", "_resize_output_", "_local_scalar_dense"):
            raise CaptureError(
                f"{func} re-points or resizes a tensor during capture (called at {user_frame()}); "
                f"allocate tensors at their final size before capture"
            )
        # Check that the op would not resize its outputs (out= with a wrong shape): replay
        # writes in place, so a resize at capture time cannot be replayed.
        meta = self.run_meta(func, args, kwargs, key)
        mutated = self._mutated_tensors(func, args, kwargs)
        for t in mutated:
            if isinstance(t, torch.Tensor) and t.numel() == 0 and any(
                isinstance(m, torch.Tensor) and m.numel() for m in tree_flatten(meta.out)[0]
            ):
                raise CaptureError(
                    f"{func} would resize its out= tensor during capture (called at "
                    f"{user_frame()}); allocate the out= tensor with its final shape"
                )
        # In-place and out= ops return the tensors they mutate, per their schema.
        rets = []
        for ret in func._schema.returns:
            alias = ret.alias_info
            where = None if alias is None else self._alias_arg_position(func, alias)
            if where is None:
                # Returns that alias nothing are fresh results of a mutating op (rare).
                raise CaptureError(
                    f"{func} mutates an input and also returns a fresh tensor; the recorder cannot "
                    f"capture that (called at {user_frame()})"
                )
            rets.append(where)
        plan = _Plan(_MUTATE)
        plan.rets = tuple(rets)
        return plan

    def _record_constant(self, const: torch.Tensor) -> torch.Tensor:
        """``torch.tensor(data)`` inside capture: pool memory refilled from a private copy.

        Like a host-to-device copy in a CUDA graph, every replay rewrites the constant, so
        in-place writes to it during the graph or by the user between replays do not persist.
        """
        src = const.detach().clone()  # private: the user's later writes cannot reach it
        out = self.pool.allocate(const.shape, const.stride(), const.dtype, const.device)
        key = self.events[-1][1]
        ref = self._loc(out)
        self.refs[key] = ref
        self.note_input(src)
        self.steps.append(Step(_LIFT_FRESH, "copy", (src,), {}, (ref,),
                               opinfo.Strategy("copy", why="constant made in capture, refilled by copy_()"),
                               src, (0,)))
        return out

    def _run_view(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)  # views touch no data
        flat = [out] if isinstance(out, _Tensor) else tree_flatten(out)[0]
        # Interpreted replay skips views (their results alias memory replay refreshes); the
        # compiled program keeps them so Inductor sees how each view relates to its base.
        fargs, fkwargs = self._frozen_args(args, kwargs, False)
        frozen = self._frozen
        self.steps.append(Step(
            func, "view", fargs, fkwargs,
            tuple([frozen(o, False) for o in flat if isinstance(o, _Tensor)]),
            positions=tuple([i for i, o in enumerate(flat) if isinstance(o, _Tensor)]),
        ))
        base = _first_tensor((args, kwargs))
        if base is not None and not self.pool.owns(base):
            root = self._root(base)
            for o in flat:
                if isinstance(o, _Tensor) and o is not root:
                    self._roots[id(o)] = (weakref.ref(o), root)
        return out

    def _record_mutation(self, func: OpOverload, args: tuple, kwargs: dict, plan: _Plan) -> Any:
        fargs, fkwargs = self._frozen_args(args, kwargs, True)
        self.steps.append(Step(func, "mutate", fargs, fkwargs))
        rets = [args[i] if i < len(args) else kwargs.get(name) for i, name in plan.rets]
        if len(rets) == 0:
            return None
        return rets[0] if len(rets) == 1 else tuple(rets)

    def _mutated_tensors(self, func: OpOverload, args: tuple, kwargs: dict) -> list[Any]:
        out = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(args[i] if i < len(args) else kwargs.get(a.name))
        return out

    def _alias_arg_position(self, func: OpOverload, alias: Any) -> tuple[int, str] | None:
        """(index, name) of the argument a return aliases, per the schema."""
        sets = alias.before_set
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set == sets:
                return i, a.name
        return None

    def _find_alias_arg(self, func: OpOverload, args: tuple, kwargs: dict, alias: Any) -> Any:
        where = self._alias_arg_position(func, alias)
        if where is None:
            return None
        i, name = where
        return args[i] if i < len(args) else kwargs.get(name)

    def _output_device(self, args: tuple, kwargs: dict) -> torch.device:
        dev = kwargs.get("device")
        if dev is not None:
            return torch.device(dev)
        fallback = None
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type != "cpu" or t.dim() > 0:
                return t.device
            fallback = fallback or t.device
        return fallback or (self.device if self.device.type == "cpu" else torch.device("cpu"))

    def _record_functional(self, func: OpOverload, args: tuple, kwargs: dict, plan: _Plan) -> Any:
        pool = self.pool
        refs = self.refs
        events = self.events
        locs = self._locs
        device = plan.device
        outs = []
        out_refs = []
        for spec in plan.specs:
            shape = spec[0]
            if shape is None:
                outs.append(spec[1])
                continue
            t = pool.allocate(shape, spec[1], spec[2], device)
            key = events[-1][1]  # this allocation, logged last by the pool
            ref = pool.ref(t)
            self.segments.add(ref.segment)
            refs[key] = ref
            locs[id(t)] = (weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.dtype, ref)
            if self.poison:
                _poison(t)
            outs.append(t)
            out_refs.append(ref)
        fargs, fkwargs = self._frozen_args(args, kwargs, True)
        strategy = plan.strategy
        assert strategy is not None
        kind = strategy.kind
        extra = None
        if kind == "out":
            if plan.prewrap:
                # Interpreted replay's arguments (numbers pre-wrapped); the compiled program
                # keeps the Python numbers, which Inductor folds into its kernels.
                extra = _prewrap_frozen(args, fargs, plan.prewrap)
        elif kind == "fill":
            extra = self.freeze(opinfo.fill_value(func, args, kwargs))
        elif kind == "random":
            extra = self.freeze(opinfo.random_call(func, args, kwargs))
        elif kind == "copy":
            extra = self.freeze(_first_tensor((args, kwargs)))
        self.steps.append(Step(func, kind, fargs, fkwargs, tuple(out_refs), strategy, extra,
                               plan.positions))
        if plan.single:
            return outs[0]
        it = iter(outs)
        return tree_map(lambda _: next(it), plan.structure)


def _first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor among the leaves of nested tuples/lists/dicts, in flattening order."""
    if isinstance(x, _Tensor):
        return x
    if isinstance(x, _LIST_TYPES):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    elif isinstance(x, dict):
        for y in x.values():
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number_positions(op: OpOverload, args: tuple) -> tuple[int, ...]:
    """Indices of ``args`` where ``op`` takes a Tensor and a Python number was given (the
    numbers :func:`_prewrap_numbers` wraps); empty when there is no tensor to promote with."""
    params = opinfo.tensor_params(op)
    if not params or next((a for a in args if isinstance(a, _Tensor)), None) is None:
        return ()
    return tuple(i for i, _ in params if i < len(args) and _is_number(args[i]))


def _prewrap_frozen(args: tuple, fargs: tuple, positions: tuple[int, ...]) -> tuple:
    """``fargs`` (frozen ``args``) with the numbers at ``positions`` pre-wrapped, as
    :func:`_prewrap_numbers` wraps them."""
    first = next(a for a in args if isinstance(a, _Tensor))
    out = list(fargs)
    for i in positions:
        value = args[i]
        out[i] = torch.tensor(value, dtype=torch.result_type(first, value))
    return tuple(out)


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
