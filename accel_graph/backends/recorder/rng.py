"""Generator state inside a capture: get/set state recorded, seeding refused.

Random ops draw at replay from the live generator, so a capture consumes no random numbers.
What changes a generator's state without an aten op (``Generator.get_state`` / ``set_state`` /
``manual_seed`` / ``seed`` / ``set_offset`` / ``graphsafe_set_state``, and everything built on
them: ``torch.get_rng_state``, ``torch.set_rng_state``, ``torch.manual_seed``,
``torch.random.fork_rng``, ``torch.utils.checkpoint``'s ``preserve_rng_state``, the device
modules' ``get_rng_state``) is invisible to the dispatch mode. Silently dropping it gives wrong
numbers (a checkpoint recompute that draws other dropout masks than its forward), so during a
capture these methods are intercepted on the capturing thread:

* ``get_state()`` returns a state tensor, like eager; a step of the program copies the
  generator's state into that same tensor at that point of every replay (a snapshot).
* ``set_state(t)`` is recorded, not applied: at that point of every replay the generator is set
  from ``t`` as it is then (a snapshot made earlier in the capture, a tensor captured by
  reference, or pool memory the program wrote). Random ops after it replay the draws that
  followed the snapshot, exactly as eager does.
* ``manual_seed``, ``seed`` and ``set_offset`` are refused with torch's reason (CUDA's generator
  refuses them during graph capture: a seed set in the graph is never replayed).
* ``graphsafe_set_state`` is refused where the generator supports it (the recorder does not bind
  random ops to a generator's state object); where it does not (the CPU), torch's own error.

``Generator`` is a C type whose attributes cannot be assigned, so the methods are replaced in
the type's dictionary (CPython's ``PyType_Modified`` invalidates the method caches), from the
first capture that begins until the last one ends, under a lock. Other threads, and the
capturing thread outside capture, reach the original methods through a thread-local check.
Where the type dictionary cannot be reached (not CPython) nothing is installed and
:func:`interception_available` says so.

Random ops with a generator other than a device's default one must use a generator registered
with the graph (``Graph.register_generator_state``), as on CUDA, where an unregistered
generator cannot advance during capture. This rules out generators made (and seeded) inside the
capture, whose draws replay could not reproduce.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload

from ...errors import CaptureError
from ..capture_common import islands
from ..capture_common.frames import user_frame
from ..capture_common.scoped_patch import ScopedPatch
from . import hostflags

_Generator = torch.Generator
_tls = threading.local()
_METHODS = ("get_state", "set_state", "manual_seed", "seed", "set_offset", "graphsafe_set_state",
            "graphsafe_get_state")
#: The methods as torch defines them (read once; the wrappers and the replay steps call these).
_originals: dict[str, Any] = {name: _Generator.__dict__[name] for name in _METHODS
                              if name in _Generator.__dict__}


@dataclass(frozen=True)
class HostCall:
    """A Python call the program makes at replay at this point: ``fn(*args)``. ``args`` may
    hold tensors (captured by reference or pool tensors; the capture freezes them)."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    why: str

    def __str__(self) -> str:
        return self.name


class RngRecorder:
    """The generator-state side of one capture.

    ``record(call)`` appends a :class:`HostCall` to the capture's program; ``invalidate(what,
    exc)`` ends the capture at a refused call; ``allowed`` are the generators registered with
    the graph (defaults are always allowed).
    """

    def __init__(self, record: Callable[[HostCall], None],
                 invalidate: Callable[[str, BaseException], None],
                 allowed: tuple[torch.Generator, ...] = ()) -> None:
        self.record = record
        self.invalidate = invalidate
        self.allowed = allowed
        #: Snapshot tensors handed out by get_state (held by the program as its own memory).
        self.buffers: dict[int, torch.Tensor] = {}
        #: Set when the capture is over: the interception then passes calls through, even on
        #: a thread whose capture was ended from elsewhere.
        self.over = False
        self._acquired = False

    def begin(self) -> None:
        """The capture begins on this thread: intercept generator methods here."""
        acquire()
        self._acquired = True
        set_thread_recorder(self)

    def end(self) -> None:
        """The capture is over (idempotent; from any thread)."""
        self.over = True
        if getattr(_tls, "rec", None) is self:
            _tls.rec = None
        if self._acquired:
            self._acquired = False
            release()

    # -- the intercepted methods, during capture on the capturing thread ---------------------
    def get_state(self, gen: torch.Generator) -> torch.Tensor:
        state = _originals["get_state"](gen)  # the state now: a valid state to start from
        self.buffers[id(state)] = state
        self.record(HostCall(f"{_gen_name(gen)}.get_state", _snapshot, (gen, state),
                             "snapshot of the generator's state at this point of each replay"))
        return state

    def set_state(self, gen: torch.Generator, state: Any) -> torch.Generator:
        expected = _originals["get_state"](gen).numel()
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.device.type != "cpu":
            self._refuse(f"{_gen_name(gen)}.set_state", CaptureError(
                f"{_gen_name(gen)}.set_state(state) needs a CPU torch.uint8 tensor (what get_state() "
                f"returns), got {_describe(state)} (at {user_frame()})"))
        if state.numel() != expected:
            self._refuse(f"{_gen_name(gen)}.set_state", CaptureError(
                f"{_gen_name(gen)}.set_state(state): RNG state is wrong size ({state.numel()} bytes; "
                f"this generator's state has {expected}) (at {user_frame()})"))
        self.record(HostCall(f"{_gen_name(gen)}.set_state", _restore, (gen, state),
                             "generator state restored at this point of each replay"))
        return gen

    def refuse_seeding(self, gen: torch.Generator, method: str) -> None:
        torch_says = {
            "manual_seed": "Cannot call CUDAGeneratorImpl::set_current_seed during CUDA graph capture",
            "seed": "Cannot call CUDAGeneratorImpl::seed during CUDA graph capture",
            "set_offset": "Cannot call CUDAGeneratorImpl::set_offset during CUDA graph capture",
        }[method]
        what = f"{_gen_name(gen)}.{method}"
        self._refuse(what, CaptureError(
            f"{what}() (torch.manual_seed / torch.seed call it) inside a capture, at {user_frame()}: "
            f"refused, as torch refuses it under CUDA graph capture (\"{torch_says}\"). A seed set "
            f"inside the graph would apply once, at capture, and never at replay. Seed before the "
            f"capture (and before a replay, for a fixed sequence), or save a state with "
            f"torch.get_rng_state() and restore it inside the capture with torch.set_rng_state(), "
            f"which the recorder replays"))

    def refuse_graphsafe_set(self, gen: torch.Generator) -> None:
        what = f"{_gen_name(gen)}.graphsafe_set_state"
        self._refuse(what, CaptureError(
            f"{what}() inside a capture, at {user_frame()}: the recorder does not bind random ops "
            f"to a generator's state object, so swapping states during capture is not supported. "
            f"Swap before the capture, or use get_state()/set_state(), which the recorder replays"))

    def _refuse(self, what: str, exc: CaptureError) -> None:
        self.invalidate(what, exc)
        try:
            raise exc
        finally:
            del exc  # this frame is in the traceback: holding exc would make a cycle

    # -- generators of random ops ----------------------------------------------------------
    def check_generators(self, func: OpOverload, args: tuple, kwargs: dict) -> None:
        """Refuse an op drawing from a generator that is neither a default one nor registered
        with the graph (the caller invalidates the capture).

        The dispatcher hands a mode a new Python object for the same generator, so identity
        cannot tell which generator an op uses; its state can: the op's generator is taken to
        be the default or registered generator of the same device whose state is byte-equal
        (capture consumes no random numbers, so no capture-time draw separates them)."""
        for i, name in generator_params(func):
            gen = args[i] if i < len(args) else kwargs.get(name)
            if gen is None:
                continue
            state = _originals["get_state"](gen)
            candidates = [*_defaults_of(gen.device), *self.allowed]
            if any(c.device == gen.device and torch.equal(_originals["get_state"](c), state)
                   for c in candidates):
                continue
            raise CaptureError(
                f"{func} at {user_frame()} draws from a generator ({_gen_name(gen)}) that is not "
                f"registered with this graph: register it before the capture with "
                f"graph.register_generator_state(generator), so each replay advances it (CUDA refuses "
                f"it too: \"Attempt to increase offset for a CUDA generator not in capture mode\"). "
                f"A generator made or seeded inside the capture cannot be replayed: make and seed "
                f"it before the capture"
            )

    def in_graph(self, gen: torch.Generator) -> bool:
        """Whether the graph may draw from ``gen`` (a user's object, compared by identity):
        calls on other generators are plain eager calls at capture."""
        return is_default_generator(gen) or any(gen is g for g in self.allowed)


def weak_method(obj: Any, name: str) -> Callable[..., None]:
    """``obj.name`` called through a weak reference (nothing once ``obj`` is gone): a capture's
    parts must not refer back to it (a cycle would keep the capture, and its pool memory, until
    the cyclic collector runs)."""
    ref = weakref.ref(obj)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            getattr(target, name)(*args)

    return call


def _snapshot(gen: torch.Generator, buf: torch.Tensor) -> None:
    buf.copy_(_originals["get_state"](gen))


def _restore(gen: torch.Generator, state: torch.Tensor) -> None:
    _originals["set_state"](gen, state)


def _gen_name(gen: Any) -> str:
    if gen is torch.default_generator:
        return "torch.default_generator"
    if isinstance(gen, _Generator):
        return f"Generator(device={gen.device})"
    return type(gen).__name__


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor on {x.device} of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _defaults_of(device: torch.device) -> list[torch.Generator]:
    """The default generator(s) of ``device``'s type that exist (never initializes a device)."""
    if device.type == "cpu":
        return [torch.default_generator]
    mod = getattr(torch, device.type, None)
    gens = list(getattr(mod, "default_generators", ()) or ()) if mod is not None else []
    getter = getattr(mod, "_get_default_mps_generator", None) if device.type == "mps" else None
    if getter is not None:
        gens.append(getter())
    return gens


def is_default_generator(gen: torch.Generator) -> bool:
    """Whether ``gen`` (a user's object) is the default generator of its device."""
    return any(gen is d for d in _defaults_of(gen.device))


@functools.lru_cache(maxsize=4096)
def generator_params(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """Positions and names of the ``Generator?`` arguments of ``func`` (usually none)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if "Generator" in str(a.type))


# -- interception --------------------------------------------------------------------------
def set_thread_recorder(rec: RngRecorder | None) -> None:
    """Make ``rec`` the recorder of the capture underway on this thread (None: none)."""
    _tls.rec = rec


def _active() -> RngRecorder | None:
    rec = getattr(_tls, "rec", None)
    # An eager island (capture_common.islands) runs for real: its generator calls act now.
    return None if rec is None or rec.over or islands.running() else rec


def _wrap_get_state(self: torch.Generator) -> torch.Tensor:
    rec = _active()
    if rec is None or not rec.in_graph(self):
        return _originals["get_state"](self)
    return rec.get_state(self)


def _wrap_set_state(self: torch.Generator, new_state: Any) -> torch.Generator:
    rec = _active()
    if rec is None or not rec.in_graph(self):
        return _originals["set_state"](self, new_state)
    return rec.set_state(self, new_state)


def _seeding(method: str) -> Callable[..., Any]:
    def wrapper(self: torch.Generator, *args: Any, **kwargs: Any) -> Any:
        rec = _active()
        if rec is not None and rec.in_graph(self):
            rec.refuse_seeding(self, method)
        return _originals[method](self, *args, **kwargs)

    wrapper.__name__ = method
    return wrapper


def _wrap_graphsafe_set_state(self: torch.Generator, state: Any) -> Any:
    rec = _active()
    if rec is not None and rec.in_graph(self) and "graphsafe_get_state" in _originals:
        try:
            _originals["graphsafe_get_state"](self)
        except (NotImplementedError, RuntimeError):
            pass  # unsupported by this generator: torch's own error below, as in eager
        else:
            rec.refuse_graphsafe_set(self)
    return _originals["graphsafe_set_state"](self, state)


_WRAPPERS: dict[str, Callable[..., Any]] = {
    "get_state": _wrap_get_state,
    "set_state": _wrap_set_state,
    "manual_seed": _seeding("manual_seed"),
    "seed": _seeding("seed"),
    "set_offset": _seeding("set_offset"),
    "graphsafe_set_state": _wrap_graphsafe_set_state,
}


def _wrap_flush_denormal(mode: bool) -> bool:
    """``torch.set_flush_denormal`` during captures: applied now, as eager does, and, on a
    capturing thread, recorded so every replay applies it at this point (it has no getter the
    capture could watch)."""
    result = hostflags.apply_flush_denormal(mode)
    rec = _active()
    if rec is not None:
        rec.record(HostCall(f"torch.set_flush_denormal({mode!r})", hostflags.apply_flush_denormal,
                            (mode,), "flush-denormal mode set at this point of each replay"))
    return result


def _type_dict() -> dict[str, Any] | None:
    """The real dictionary behind ``torch.Generator.__dict__`` (CPython), or None."""
    refs = gc.get_referents(_Generator.__dict__)
    if len(refs) == 1 and isinstance(refs[0], dict) and "get_state" in refs[0]:
        return refs[0]
    return None


def interception_available() -> bool:
    """Whether generator methods can be intercepted during capture on this interpreter."""
    return _type_dict() is not None and hasattr(ctypes, "pythonapi")


def _type_modified() -> None:
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(_Generator))


def _install() -> None:
    if interception_available():
        d = _type_dict()
        assert d is not None
        for name, wrapper in _WRAPPERS.items():
            if name in _originals and d.get(name) is _originals[name]:  # ours to wrap
                d[name] = wrapper
        _type_modified()
    if torch.set_flush_denormal is hostflags.original_flush_denormal():
        torch.set_flush_denormal = _wrap_flush_denormal


def _uninstall() -> None:
    d = _type_dict()
    if d is not None:
        for name, wrapper in _WRAPPERS.items():
            if d.get(name) is wrapper:  # leave alone what someone else put there since
                d[name] = _originals[name]
        _type_modified()
    if torch.set_flush_denormal is _wrap_flush_denormal:
        torch.set_flush_denormal = hostflags.original_flush_denormal()


#: The interception, in place while some capture is underway: ``acquire()`` when a capture
#: begins, ``release()`` when it ends, ``installed()`` whether it is in place now.
_PATCH = ScopedPatch(_install, _uninstall)
acquire, release, installed = _PATCH.acquire, _PATCH.release, _PATCH.installed
