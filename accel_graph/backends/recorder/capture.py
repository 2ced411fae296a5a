"""Recording: a dispatch mode that records aten ops instead of running them.

During capture nothing but metadata executes. What to do with each op is decided once per op
and argument metadata by :mod:`.plan`; this module carries it out per call: functional ops get
their outputs from the graph's pool, views run for real (they touch no data) and alias pool or
input memory, in-place and ``out=`` ops are recorded as they are and run at replay. Tensors
that existed before capture are inputs by reference. Operations that real device-graph capture
forbids raise :class:`~accel_graph.errors.CaptureError` at the op (when planning).

The mode is thread-local (``TorchDispatchMode``), so a capture records only its own thread;
:func:`~.threads.active_capture` is the capture underway on the calling thread.

A capture that is over never records again: an illegal op invalidates it at the op (as on
CUDA), and a capture ended from elsewhere (its ``Graph`` collected by another thread) is
marked over. torch pushes a mode back onto the stack after its handler returns or raises, so
the handler cannot pop itself: a mode whose capture is over passes every op through eagerly
(real values, exactly as with no mode) until the next recorder call on its thread
(:func:`~.threads.active_capture`, capture begin, end or reset) takes it off the stack.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch._ops import OpOverload

from ..capture_common import hostreads
from ..capture_common import islands as islands_common
from ..capture_common.dispatch_stack import remove_mode
from ..capture_common.frames import user_frame
from ..capture_common.poison import poison
from ..capture_common.pytree import first_tensor, tree_flatten, tree_map
from . import collectives as coll
from . import hostflags, islands, rng
from . import ops as opinfo
from .control_flow import register_rules
from .modes import RecordingMode
from .plan import COLLECTIVE, FUNCTIONAL, MUTATE, VIEW, Plan, plan_for
from .pool_protocol import GraphPool, PoolEvent, PoolRef
from .steps import InputRecord, Step
from .threads import clear_active_capture, drop_exit_guard, hold_exit_guard, set_active_capture
from .values import prewrapped

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
#: The operator a control-flow step stands for (for dumps and error messages).
_CONTROL_OPS: dict[str, Any] = {"cond": torch.ops.higher_order.cond,
                                "while": torch.ops.higher_order.while_loop}
_Tensor = torch.Tensor


class Capture:
    """The state of one capture: recorded steps, inputs and pool tensors.

    Lifecycle: :meth:`begin` (listen on the pool, record this thread), then :meth:`stop` on
    the capturing thread (normal end or abort) or :meth:`invalidate` at an illegal op.
    ``over`` is None while the capture records, else why it stopped; once over it records
    nothing more and no longer listens on the pool.
    """

    def __init__(self, pool: GraphPool, device: torch.device, *, poison: bool = False,
                 generators: tuple[torch.Generator, ...] = ()) -> None:
        self.pool = pool
        #: None while recording; else why the capture is over.
        self.over: str | None = None
        #: The op that invalidated the capture (its CaptureError's message), if one did.
        self.invalidated_by: str | None = None
        self.thread: threading.Thread | None = None
        #: Held while an op is recorded and while the capture stops, so an end from another
        #: thread (relaxed mode) never cuts a recording in half: the op before it is recorded
        #: whole, the ops after it run eagerly.
        self.lock = threading.RLock()
        self._listening = False
        self.device = device
        self.poison = poison
        self.steps: list[Step] = []
        #: The top-level step list (``steps`` is swapped for a cond branch's or loop body's own
        #: while it records) and how many of its steps ran at eager islands (:mod:`.islands`).
        self.top_steps = self.steps
        self.ran_to = 0
        self._island_runner: islands_common.Runner | None = None
        #: Eager islands' static output buffers, held until the capture stops: their memory is
        #: not reused within the capture, so a compiled stretch never writes where it reads an
        #: island's output (segmented.py would replay such a stretch interpreted).
        self.island_buffers: list[torch.Tensor] = []
        #: The pool tensors alive at the last eager island, held until the next island (or the
        #: capture stops), so the stretch after an island never reuses memory it reads from
        #: before the island (islands.py; segmented.py would replay it interpreted).
        self.island_pins: list[torch.Tensor] = []
        self.inputs: dict[int, InputRecord] = {}
        # Views of inputs created during capture map back to the input they view, so a stale
        # check watches the user's tensor and not our own view of it: id(view) -> (weak
        # reference to the view, input). An entry whose view died is ignored (its id may be
        # reused by another tensor) and goes with the capture.
        self._roots: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        #: ("alloc", key, bytes) / ("free", key, 0) in capture order, for standalone_bytes.
        self.events: list[PoolEvent] = []
        self.refs: dict[int, PoolRef] = {}  # allocation key -> location, for the outputs
        # Locations of pool tensors seen in this capture, so an argument seen again is not
        # asked of the pool: id(tensor) -> (weak reference, data_ptr, shape, stride, dtype,
        # location). An entry holds while that object lives with that address and metadata
        # (in-place view ops and ``t.data = other``, which need not dispatch anything, change
        # them; a location is only an address, a shape, strides and a dtype).
        self._locs: dict[int, tuple[Any, ...]] = {}
        self.reserved_before = pool.reserved_bytes()
        #: Process groups that existed at begin: a collective on a newer one is refused.
        self.groups_at_begin = coll.known_groups()
        self.mode = RecordingMode(self)
        #: Generator-state calls of this thread during the capture (``generators``: those
        #: registered with the graph, which random ops may draw from besides the defaults).
        self.rng = rng.RngRecorder(rng.weak_method(self, "_record_host"),
                                   rng.weak_method(self, "_refused"), generators)
        #: The process-wide compute settings the last recorded op ran under (hostflags).
        self.flags = hostflags.snapshot()
        #: The host-read check of the capturing thread (:mod:`~accel_graph.backends.capture_common.hostreads`), while it holds one.
        self._reads: object | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def begin(self) -> None:
        """Start recording the calling thread's ops into the pool. Raises what the pool's
        ``begin_capture`` raises (nothing changed then)."""
        register_rules(RecordingMode)  # torch.cond / torch.while_loop (once per process)
        self.pool.begin_capture(self.events)
        self._listening = True
        self.thread = threading.current_thread()
        set_active_capture(self)
        self.mode.__enter__()
        hold_exit_guard(self)
        self.rng.begin()
        hostreads.acquire()
        self._island_runner = islands_common.set_runner(self.make_island_runner())
        ref = weakref.ref(self)
        self._reads = hostreads.watch(
            self.device.type, lambda: (c := ref()) is not None and c.over is None,
            rng.weak_method(self, "_refused"))

    def make_island_runner(self) -> islands_common.Runner:
        """How this capture runs eager islands (a memory plan's capture runs them on metadata:
        :mod:`.plan_islands`)."""
        return islands.make_runner(self)

    def _release_reads(self) -> None:
        """Stop checking host reads and running islands here (idempotent; from any thread: a
        read or an island on the capturing thread after an end from elsewhere sees ``over``
        and passes, or runs plainly)."""
        runner, self._island_runner = self._island_runner, None
        if runner is not None:
            islands_common.clear_runner(runner)
        self.island_buffers = []  # while the pool still listens: their deaths are logged
        self.island_pins = []
        token, self._reads = self._reads, None
        if token is not None:
            hostreads.unwatch(token)
            hostreads.release()

    def release_pool(self) -> None:
        """Stop listening on the pool (idempotent): its capture count drops once."""
        if self._listening:
            self._listening = False
            self.pool.end_capture(self.events)

    def stop(self, why: str = "ended") -> None:
        """The capture is over (idempotent). On the capturing thread the mode leaves the
        dispatch stack now; on another thread (a ``Graph`` collected there) it passes ops
        through until that thread next calls the recorder. The pool is released separately
        (:meth:`release_pool`): a normal end registers its graph with the pool first."""
        with self.lock:
            if self.over is None:
                if why == "ended":
                    self.sync_flags()  # what the code left set, re-applied at the end of replay
                self.over = why
        self.rng.end()
        self._release_reads()
        if self.thread is threading.current_thread():
            clear_active_capture(self)
            drop_exit_guard(self)
            remove_mode(self.mode)

    def invalidate(self, func: OpOverload | str, exc: BaseException) -> None:
        """An illegal op raised ``exc`` at ``func``: the capture is over, as on CUDA. Called
        inside the mode's handler, on the capturing thread: the thread stops recording now
        and the pool is released; the mode leaves the stack at the next recorder call."""
        if self.over is not None:
            return
        msg = str(exc).strip()
        self.invalidated_by = msg if str(func) in msg else f"{func}: {msg}"
        self.over = f"invalidated by {self.invalidated_by}"
        self.rng.end()
        self._release_reads()
        clear_active_capture(self)
        self.release_pool()

    def sync_flags(self) -> None:
        """Record a step applying the compute settings that changed since the last op (they
        change no aten op, so the program must set them where eager had them set)."""
        now = hostflags.snapshot()
        if now != self.flags:
            diff = hostflags.changes(self.flags, now)
            self.flags = now
            self._record_host(rng.HostCall(
                f"set {hostflags.describe(diff)}", hostflags.apply, (diff,),
                "compute setting changed during capture, applied at this point of each replay"))

    def _refused(self, what: str, exc: BaseException) -> None:
        """A generator call refused outside the dispatcher: the capture is over, as at an op."""
        if self.over is None:
            self.invalidate(what, exc)

    def _record_host(self, call: rng.HostCall) -> None:
        """Record a Python call made at replay (generator state). Tensors in its arguments are
        frozen like an op's (pool tensors by location, others noted as inputs), except the
        snapshot tensors this capture handed out, which belong to the program."""
        own = self.rng.buffers
        args = tuple([a if isinstance(a, _Tensor) and own.get(id(a)) is a else self._frozen(a, True)
                      for a in call.args])
        self.steps.append(Step(call, "host", args, {}, (), opinfo.Strategy("host", why=call.why),
                               call.fn))

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

    def alive_tensors(self) -> list[torch.Tensor]:
        """The pool tensors this capture has seen that are alive now (strong references: the
        caller decides how long their memory stays unavailable to later allocations)."""
        alive = []
        for entry in self._locs.values():
            t = entry[0]()
            if t is not None:
                alive.append(t)
        return alive

    def live_outputs(self) -> list[PoolRef]:
        """Locations allocated by this capture whose tensors are still alive: the outputs."""
        freed = {key for action, key, _ in self.events if action == "free"}
        return [ref for key, ref in self.refs.items() if key not in freed]

    # -- classification of tensors ------------------------------------------------------
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

    # -- the handler --------------------------------------------------------------------
    def handle(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        """Record (or run) one aten op of the capturing thread; returns what eager would."""
        if hostflags.snapshot() != self.flags:
            self.sync_flags()
        if rng.generator_params(func):
            self.rng.check_generators(func, args, kwargs)
        plan = plan_for(func, args, kwargs)
        if plan is None:  # a constant made in the capture: never planned
            return self._record_constant(args[0])
        kind = plan.kind
        if kind is FUNCTIONAL:
            return self._record_functional(func, args, kwargs, plan)
        if kind is VIEW:
            return self._run_view(func, args, kwargs)
        if kind is MUTATE:
            return self._record_mutation(func, args, kwargs, plan)
        if kind is COLLECTIVE:
            return self._record_collective(func, args, kwargs, plan)
        # Metadata-only in-place ops (t_, unsqueeze_, as_strided_) change the tensor object
        # now, exactly as in eager, and touch no data; pure metadata queries (METADATA_OPS;
        # illegal ones are refused when planning): run, record nothing (RUN).
        return func(*args, **kwargs)

    # -- control flow (control_flow.py) ------------------------------------------------
    def allocate_output(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A pool tensor booked as an output of this capture (what a functional op's result
        gets), contents undefined until a recorded step writes it."""
        t = self.pool.allocate(shape, stride, dtype, device)
        key = self.events[-1][1]
        ref = self.pool.ref(t)
        self.refs[key] = ref
        self._locs[id(t)] = (weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.dtype, ref)
        if self.poison:
            poison(t)
        return t

    def frozen_arg(self, x: Any) -> Any:
        """``x`` as a step argument: pool tensors as locations, other tensors noted as inputs."""
        return self._frozen(x, True)

    def record_control(self, kind: str, extra: tuple) -> None:
        """Append a control-flow step (``"cond"`` or ``"while"``; ``extra`` holds the
        predicate and the sub-programs, see :mod:`.control_flow`)."""
        self.steps.append(Step(_CONTROL_OPS[kind], kind, (), {}, (), None, extra))

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
        base = first_tensor((args, kwargs))
        if base is not None and not self.pool.owns(base):
            root = self._root(base)
            for o in flat:
                if isinstance(o, _Tensor) and o is not root:
                    self._roots[id(o)] = (weakref.ref(o), root)
        return out

    def _record_collective(self, func: OpOverload, args: tuple, kwargs: dict, plan: Plan) -> Any:
        """A collective (:mod:`.collectives`): nothing is communicated now. Functional ones get
        pool outputs; in-place ones are recorded as called and return a completed ``Work``;
        ``wait_tensor`` returns its argument."""
        coll.check_call(func, args, kwargs, self.groups_at_begin, user_frame())
        role = coll.role(func)
        if role == coll.IDENTITY:
            return args[0] if args else next(iter(kwargs.values()))
        if role == coll.ISSUE:
            return self._record_functional(func, args, kwargs, plan)
        fargs, fkwargs = self._frozen_args(args, kwargs, True)
        self.steps.append(Step(func, "collective", fargs, fkwargs, strategy=plan.strategy))
        return coll.capture_result(func, args, kwargs)

    def _record_mutation(self, func: OpOverload, args: tuple, kwargs: dict, plan: Plan) -> Any:
        fargs, fkwargs = self._frozen_args(args, kwargs, True)
        self.steps.append(Step(func, "mutate", fargs, fkwargs))
        rets = [args[i] if i < len(args) else kwargs.get(name) for i, name in plan.rets]
        if len(rets) == 0:
            return None
        return rets[0] if len(rets) == 1 else tuple(rets)

    def _record_functional(self, func: OpOverload, args: tuple, kwargs: dict, plan: Plan) -> Any:
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
            refs[key] = ref
            locs[id(t)] = (weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.dtype, ref)
            if self.poison:
                poison(t)
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
                extra = prewrapped(args, fargs, plan.prewrap)
        elif kind == "fill":
            extra = self.freeze(opinfo.fill_value(func, args, kwargs))
        elif kind == "random":
            extra = self.freeze(opinfo.random_call(func, args, kwargs))
        elif kind == "copy":
            extra = self.freeze(first_tensor((args, kwargs)))
        self.steps.append(Step(func, kind, fargs, fkwargs, tuple(out_refs), strategy, extra,
                               plan.positions, plan.grad))
        if plan.single:
            return outs[0]
        it = iter(outs)
        return tree_map(lambda _: next(it), plan.structure)
