"""``GraphRunner(..., islands=[...])``: code that runs eagerly between the captured pieces of
every graph the runner captures, named once for the whole runner.

What an island is and how a capture handles one is :func:`accel_graph.eager_island`'s business
(docs/recorder.md "Eager islands"); this module decides *which* calls are islands during the
runner's captures, without touching the user's model for good. Each entry of ``islands=`` is:

- an ``nn.Module`` subclass: every instance of it (and of its subclasses) is an island. Its
  ``forward`` (and the ``forward`` of every subclass that defines its own) is replaced on the
  class by a wrapper **for the length of each of the runner's captures**, and put back after;
- an ``nn.Module`` instance: that module is an island; its ``forward`` is wrapped on the
  instance, for the same span;
- a function: every module global bound to it under its own name (``fn.__name__`` in each
  loaded module's namespace, found anew at each capture), or, for a method, the attribute of
  its class, is wrapped for the same span. A function is called by name: only the calls that
  look it up where it is wrapped become islands. Code that imported it under another name, or
  keeps its own reference, calls the original; for such code decorate the function with
  :func:`accel_graph.eager_island` where it is defined, or name the place it is looked up as
  a string;
- a string ``"package.module.attr"`` (``attr`` may be dotted, ``Class.method``): the object
  found there is an island by the rules above, and a function named this way is wrapped at
  exactly that place.

Why for the length of a capture only, and not for the runner's lifetime: the capture is the one
place the marking is read. An island's host step keeps the function it called (the original,
unwrapped ``forward`` bound to its module, or the original function), and every replay calls
that directly, so replay needs no marking; eager runs (warm-up, verification, fallback) run the
plain code either way. Marking only while capturing leaves the model untouched between
captures, and other graphs of the same model (captured outside the runner) never see the
runner's islands. The wrappers are also inactive on every other thread: another thread calling
the model during the capture runs the plain code, and only the capturing thread's runner
turns calls into islands.

A module or function already marked with ``accel_graph.eager_island`` is an island anyway;
naming it here again is harmless. An island nested in an island is a plain call, so naming both
a sparse MoE block and its experts makes the block the island.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.capture_common import islands as marks
from ..errors import ConfigError
from ..graphs.islands import is_eager_island

__all__ = ["IslandProbe", "RunnerIslands", "resolve_islands"]

_USAGE = ("islands= takes a list of nn.Module subclasses (every instance becomes an island), "
          "nn.Module instances, functions, or 'package.module.attr' strings naming one of these")


@dataclass(frozen=True)
class _Target:
    """One entry of ``islands=``, resolved: what it is, and for a string, where it was found."""

    kind: str  # "type" | "module" | "function"
    obj: Any
    #: For a function named by a string: ``(owner, attr)``, the one place to wrap it.
    place: tuple[Any, str] | None = None

    def describe(self) -> str:
        if self.kind == "type":
            return self.obj.__qualname__
        if self.kind == "module":
            return f"{type(self.obj).__qualname__} instance"
        return getattr(self.obj, "__qualname__", repr(self.obj))


class _Patch:
    """One wrapped attribute (``owner.attr``), shared by every runner naming it and put back
    when the last capture using it ends. ``active`` counts, per thread, the captures that turn
    calls through it into islands."""

    def __init__(self, owner: Any, attr: str, original: Any, info: marks.IslandInfo) -> None:
        self.owner = owner
        self.attr = attr
        self.original = original
        self.had_own = attr in vars(owner)
        self.users = 0
        self.wrapper = _wrapper(self, original, info)


_lock = threading.Lock()
#: ``(id(owner), attr)`` -> the patch installed there now.
_patches: dict[tuple[int, str], _Patch] = {}
_tls = threading.local()


def _active(patch: _Patch) -> bool:
    return getattr(_tls, "active", {}).get(patch, 0) > 0


def _wrapper(patch: _Patch, original: Callable[..., Any], info: marks.IslandInfo) -> Callable[..., Any]:
    """A plain function (so that, set on a class, it binds ``self`` as the original does) that
    is a plain call unless a capture on this thread turned ``patch`` on."""

    @functools.wraps(original)
    def island(*args: Any, **kwargs: Any) -> Any:
        runner = marks.capture_runner()
        if runner is None or not _active(patch):
            return original(*args, **kwargs)
        return runner(info, original, args, kwargs)

    return island


class RunnerIslands:
    """The resolved ``islands=`` of one runner (``runtime.options.islands``); :meth:`marking`
    turns them on for one capture on the calling thread."""

    def __init__(self, targets: tuple[_Target, ...]) -> None:
        self.targets = targets

    def __bool__(self) -> bool:
        return bool(self.targets)

    def __repr__(self) -> str:
        return f"RunnerIslands([{', '.join(t.describe() for t in self.targets)}])"

    def names(self) -> list[str]:
        """What each entry marks, for reports (``"MixtralExperts"``, ``"Net instance"``, ...)."""
        return [t.describe() for t in self.targets]

    @contextmanager
    def marking(self) -> Iterator[None]:
        """Within the block, on this thread, calls of the named modules and functions are eager
        islands of the capture underway (and plain calls outside a capture)."""
        if not self.targets:
            yield
            return
        with _lock:  # found and wrapped under the lock: another runner may be (un)wrapping them
            places = [p for t in self.targets for p in _places(t)]
            patches = [_install(owner, attr, original, info) for owner, attr, original, info in places]
        active = getattr(_tls, "active", None)
        if active is None:
            active = _tls.active = {}
        for p in patches:
            active[p] = active.get(p, 0) + 1
        try:
            yield
        finally:
            for p in patches:
                active[p] -= 1
                if not active[p]:
                    del active[p]
            with _lock:
                for p in patches:
                    _uninstall(p)


def _install(owner: Any, attr: str, original: Any, info: marks.IslandInfo) -> _Patch:
    key = (id(owner), attr)
    patch = _patches.get(key)
    if patch is None or vars(owner).get(attr) is not patch.wrapper:
        patch = _Patch(owner, attr, original, info)
        setattr(owner, attr, patch.wrapper)
        _patches[key] = patch
    patch.users += 1
    return patch


def _uninstall(patch: _Patch) -> None:
    patch.users -= 1
    if patch.users:
        return
    key = (id(patch.owner), patch.attr)
    if _patches.get(key) is patch:
        del _patches[key]
    if vars(patch.owner).get(patch.attr) is not patch.wrapper:
        return  # replaced meanwhile by someone else: theirs stays
    if patch.had_own:
        setattr(patch.owner, patch.attr, patch.original)
    else:
        delattr(patch.owner, patch.attr)


def _places(target: _Target) -> Iterator[tuple[Any, str, Any, marks.IslandInfo]]:
    """``(owner, attr, original, info)`` for each attribute to wrap for ``target`` now."""
    if target.kind == "type":
        for cls in _with_subclasses(target.obj):
            fwd = vars(cls).get("forward")
            if cls is target.obj or fwd is not None:
                fn = fwd if fwd is not None else cls.forward  # inherited: wrap it on cls
                yield cls, "forward", fn, _info(fn, f"{cls.__qualname__}.forward")
        return
    if target.kind == "module":
        m = target.obj
        if is_eager_island(m):
            return  # marked for good already
        fn = vars(m).get("forward") or type(m).forward.__get__(m)
        yield m, "forward", fn, _info(fn, f"{type(m).__qualname__}.forward")
        return
    fn = target.obj
    if is_eager_island(fn):
        return
    if target.place is not None:
        owner, attr = target.place
        yield owner, attr, fn, _info(fn)
        return
    yield from ((owner, attr, fn, _info(fn)) for owner, attr in _lookups(fn))


def _info(fn: Any, name: str | None = None) -> marks.IslandInfo:
    return marks.describe_callable(fn, name)


def _with_subclasses(cls: type) -> list[type]:
    out, todo, seen = [], [cls], set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _lookups(fn: Any) -> list[tuple[Any, str]]:
    """Where code looks ``fn`` up by its own name: the globals of every loaded module bound to
    it under ``fn.__name__``, and for a method (``Class.name``), its class's attribute."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return []
    found: list[tuple[Any, str]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is fn:
            found.append((module, name))
    owner = _owner_class(fn)
    if owner is not None and vars(owner).get(name) is fn:
        found.append((owner, name))
    return found


def _owner_class(fn: Any) -> type | None:
    """The class defining method ``fn`` (by ``__qualname__`` ``Class.name`` in its module)."""
    qual = getattr(fn, "__qualname__", "")
    parts = qual.split(".")
    if len(parts) < 2 or "<locals>" in parts:
        return None
    obj: Any = sys.modules.get(getattr(fn, "__module__", "") or "")
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def resolve_islands(islands: Any) -> RunnerIslands:
    """``islands=`` checked and resolved (``ConfigError`` naming the first bad entry, saying
    what to pass instead). None or an empty list: no islands."""
    if islands is None:
        return RunnerIslands(())
    if isinstance(islands, (str, torch.nn.Module, type)) or callable(islands) \
            or not isinstance(islands, (list, tuple, set, frozenset)):
        raise ConfigError(f"{_USAGE}; got {islands!r:.80} (not a list): pass islands=[...]")
    return RunnerIslands(tuple(_target(item) for item in islands))


def _target(item: Any) -> _Target:
    place = None
    given = item
    if isinstance(item, str):
        item, place = _import(item)
    if isinstance(item, type):
        if not issubclass(item, torch.nn.Module):
            raise ConfigError(f"{_USAGE}; {item.__qualname__} is a class but not an nn.Module "
                              f"subclass: name the function or method that should run eagerly")
        return _Target("type", item)
    if isinstance(item, torch.nn.Module):
        return _Target("module", item)
    if not callable(item):
        raise ConfigError(f"{_USAGE}; got {given!r:.80} ({type(item).__name__})")
    if isinstance(item, (types.MethodType, functools.partial)) or not inspect.isroutine(item):
        raise ConfigError(
            f"islands=: {given!r:.80} is a {type(item).__name__}, not a function that model code "
            f"looks up by name; pass the function itself, or wrap the callable with "
            f"accel_graph.eager_island where the model calls it")
    if is_eager_island(item) or place is not None:
        return _Target("function", item, place)
    if not _lookups(item):
        raise ConfigError(
            f"islands=: function {getattr(item, '__qualname__', item)!r} is bound to no module "
            f"global or class attribute under its own name (a lambda, a local function, or one "
            f"imported under another name), so no call can be redirected: decorate it with "
            f"@accel_graph.eager_island where it is defined, or name where the model looks it "
            f"up as a 'package.module.attr' string")
    return _Target("function", item)


def _import(path: str) -> tuple[Any, tuple[Any, str] | None]:
    """The object ``path`` ('package.module.attr[.attr]') names, and for a function, the place
    it was found ``(owner, attr)``."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        owner = obj
        try:
            for attr in parts[cut:]:
                owner, obj = obj, getattr(obj, attr)
        except AttributeError:
            break
        if isinstance(owner, type) and isinstance(vars(owner).get(parts[-1]), (staticmethod, classmethod)):
            raise ConfigError(f"islands=: {path!r} is a static or class method; wrap it with "
                              f"accel_graph.eager_island where it is defined")
        return obj, ((owner, parts[-1]) if inspect.isroutine(obj) else None)
    raise ConfigError(f"islands=: cannot import {path!r}: {_USAGE} (for a string: "
                      f"'package.module.attr', importable now)")


class IslandProbe:
    """Installed on the thread during a runner's eager warm-up: islands run as plain calls
    (nested ones too) and ``seen`` says whether the step called any, so the runner knows that
    its capture will run pieces and islands for real (and must undo what they write)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, info: marks.IslandInfo, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.seen = True
        with marks.running_island():
            return fn(*args, **kwargs)

    @contextmanager
    def watching(self) -> Iterator[IslandProbe]:
        """Install the probe on this thread for the block (nothing when a capture or an island
        is underway here: that one decides)."""
        if marks.capture_runner() is not None or marks.running():
            yield self
            return
        token = marks.set_runner(self)
        try:
            yield self
        finally:
            marks.clear_runner(token)
