"""Which ``nn.Module`` to mark as an eager island, for each op ``check_capturable`` flags.

A refused op (a host read, a data-dependent shape) cannot be captured, but the module that
issues it can run eagerly between graph pieces (:func:`accel_graph.eager_island`). The smallest
module whose call contains the op is the island that leaves the most captured. While
``check_capturable`` runs the function, :class:`ModuleStack` follows the ``nn.Module`` calls
underway on the calling thread through torch's global forward hooks, registered for the
duration of the check only and removed after; each finding takes a snapshot of the stack
(:meth:`ModuleStack.snapshot`), and :meth:`ModuleStack.resolve` names, once the function has
returned, the innermost call of the snapshot that can be an island:

- its call returned: a call that raised has no outputs to make static;
- its outputs are tensors, or tuples/lists/dicts of tensors and None (what an island may
  return: its outputs become static buffers of fixed shape and dtype). A module returning
  anything else (a ``ModelOutput`` holding a cache object, a Python number) is skipped for the
  next one out.

Modules are named by attribute path, as ``nn.Module.get_submodule`` takes it, from a root: the
modules found among the function's arguments, the ``self`` of a bound method, the function
itself, its closure, and the globals its code names (a recipe's ``model``), through
``functools.partial``. A module no root reaches is named from the outermost module called.

Islands already marked run eagerly and unflagged during the check (:func:`islands_run_eagerly`,
the island runner a capture would install), so checking again after marking shows what is left.

The outputs' shapes are not checked for data dependence: a module whose output shape follows
the data (it returns the ``nonzero`` itself) is named all the same, and its island then fails at
replay with a ``ReplayError`` naming it. A module called through ``module.forward(...)``
directly is not seen by torch's hooks: the op is then named for the caller's module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.modules import module as nn_module

from ..backends.capture_common import islands as island_marks
from ..backends.capture_common.frames import user_frame

__all__ = ["ModuleCall", "ModuleStack", "island_advice", "islands_run_eagerly", "module_roots"]


@dataclass(eq=False)
class ModuleCall:
    """One call of a module: ``ok`` is None while it runs, then whether it returned tensors
    (or containers of tensors) only, which is what an island may return."""

    module: torch.nn.Module
    ok: bool | None = None


@dataclass
class ModuleStack:
    """The module calls underway on the thread that entered it, through torch's global forward
    hooks (registered on ``__enter__``, removed on ``__exit__``; other threads are ignored).

    ``roots``: ``(name, module)`` pairs that paths are spelt from, most preferred first
    (:func:`module_roots`)."""

    roots: list[tuple[str, torch.nn.Module]] = field(default_factory=list)
    _stack: list[ModuleCall] = field(default_factory=list)
    _thread: int | None = None
    _handles: list[Any] = field(default_factory=list)
    _names: dict[int, dict[int, str]] = field(default_factory=dict)

    def __enter__(self) -> ModuleStack:
        self._thread = threading.get_ident()
        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         # always_call: a forward that raises still pops its call
                         nn_module.register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self._stack.append(ModuleCall(module))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        # This module's call is the innermost one of it on the stack; anything above it (a
        # call left by a forward that raised before torch ran its hooks) ends with it.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i].module is module:
                # A forward that raised reaches here (always_call) from torch's except block,
                # with None for its output: no outputs to make static, not an island.
                raised = output is None and sys.exc_info()[1] is not None
                self._stack[i].ok = not raised and _tensor_outputs(output)
                del self._stack[i:]
                return

    def snapshot(self) -> tuple[ModuleCall, ...]:
        """The calls underway, outermost first (empty outside any module)."""
        return tuple(self._stack)

    def resolve(self, calls: tuple[ModuleCall, ...]) -> dict[str, Any] | None:
        """The island for an op issued under ``calls`` (a :meth:`snapshot`), once the function
        has returned: ``{"path", "class", "root", "submodule", "within"}``, or None when no
        call of the snapshot can be an island (the op was issued outside every module).

        ``path`` is ``root.submodule`` (``submodule`` as ``get_submodule`` takes it; empty when
        the module is the root itself), ``class`` the module's class name, and ``within`` the
        enclosing modules that could be islands too, ``{"path", "class"}`` innermost first
        (coarser islands that would also do, such as the sparse MoE block around its
        experts)."""
        for i in range(len(calls) - 1, -1, -1):
            if calls[i].ok:
                entry = self._named(calls[i].module, calls[0].module)
                entry["within"] = [
                    {k: v for k, v in self._named(c.module, calls[0].module).items()
                     if k in ("path", "class")}
                    for c in reversed(calls[:i]) if c.ok]
                return entry
        return None

    def _named(self, module: torch.nn.Module, outermost: torch.nn.Module) -> dict[str, Any]:
        best: tuple[int, int, str, str] | None = None
        for rank, (name, root) in enumerate(self.roots):
            sub = self._names_of(root).get(id(module))
            if sub is not None:
                key = (sub.count(".") + bool(sub), rank, name, sub)
                best = key if best is None or key < best else best
        if best is None:  # no root reaches it: spell it from the outermost module called
            name = f"<{type(outermost).__name__}>"
            sub = self._names_of(outermost).get(id(module), "")
        else:
            name, sub = best[2], best[3]
        return {"path": f"{name}.{sub}" if sub else name, "class": type(module).__name__,
                "root": name, "submodule": sub}

    def _names_of(self, root: torch.nn.Module) -> dict[int, str]:
        names = self._names.get(id(root))
        if names is None:
            names = {}
            for sub, mod in root.named_modules(remove_duplicate=False):
                names.setdefault(id(mod), sub)
            self._names[id(root)] = names
        return names


def _tensor_outputs(output: Any) -> bool:
    """Whether ``output`` is what an island may return: tensors, or tuples/lists/dicts (any
    pytree torch knows, a transformers ``ModelOutput`` included) of tensors and None."""
    return all(x is None or isinstance(x, torch.Tensor) for x in pytree.tree_leaves(output))


def module_roots(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` for each ``nn.Module`` the function can reach by name, most preferred
    first: its arguments (by parameter name), the ``self`` of a bound method (or ``fn`` itself,
    named by its class), its closure, the globals its code names, through ``functools.partial``."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def add(name: str, value: Any) -> None:
        if isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            found.append((name, value))

    for name, value in _bound_arguments(fn, args, kwargs):
        add(name, value)
    for name, value in _reachable(fn, depth=0):
        add(name, value)
    return found


def _bound_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
        pairs = list(bound.arguments.items())
    except (TypeError, ValueError):  # no signature (a builtin) or one that does not bind
        pairs = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in pairs:
        if isinstance(value, (tuple, list)):
            yield from ((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            yield from ((f"{name}[{k!r}]", v) for k, v in value.items())
        else:
            yield name, value


def _reachable(fn: Any, depth: int) -> Iterator[tuple[str, Any]]:
    """Named values a callable carries: partial arguments, ``self`` (and, for an object that is
    not a module, its attributes: a server holding its model), closure, named globals; then
    the same of the plain functions among them (a step calling a helper that holds the model)."""
    if depth > 3:
        return
    if isinstance(fn, functools.partial):
        yield from _bound_arguments(fn.func, fn.args, fn.keywords or {})
        yield from _reachable(fn.func, depth + 1)
        return
    if isinstance(fn, torch.nn.Module):  # check_capturable(model, ...): the model is the root
        yield type(fn).__name__, fn
        return
    owner = getattr(fn, "__self__", None)
    if owner is not None and not inspect.ismodule(owner):
        yield "self", owner
        if not isinstance(owner, torch.nn.Module):
            yield from ((f"self.{k}", v) for k, v in getattr(owner, "__dict__", {}).items())
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return
    named: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        try:
            named.append((name, cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned later)
            continue
    globs = getattr(func, "__globals__", {})
    named += [(name, globs[name]) for name in code.co_names if name in globs]
    yield from named
    for _, value in named:
        if inspect.isfunction(value) and value is not func:
            yield from _reachable(value, depth + 1)


def island_advice(islands: list[dict[str, Any] | None]) -> list[str]:
    """Report lines naming the modules to mark as eager islands, one line per class, with how
    many findings each would take in and the nearest enclosing module that would do too
    (``islands``: one entry per finding, None where the op was issued outside every module)."""
    by_class: dict[str, dict[str, int]] = {}
    enclosing: dict[str, dict[str, str]] = {}
    outside = 0
    for island in islands:
        if island is None:
            outside += 1
            continue
        paths = by_class.setdefault(island["class"], {})
        paths[island["path"]] = paths.get(island["path"], 0) + 1
        if island["within"]:
            enclosing.setdefault(island["class"], island["within"][0])
    if not by_class and not outside:
        return []
    lines = ["Eager islands (accel_graph.eager_island; serving with a GraphRunner, "
             "GraphRunner(..., islands=[<class>]) marks every instance of a class for all of "
             "its captures) that would run these ops eagerly between captured pieces:"]
    for cls, paths in by_class.items():
        names, count = list(paths), sum(paths.values())
        if len(names) == 1:
            line = f"  mark {names[0]} ({cls}) as an eager island ({count} finding(s))"
            outer = enclosing.get(cls)
            if outer is not None:
                line += f"; the enclosing {outer['path']} ({outer['class']}) would do too"
            line += f"; in a GraphRunner: islands=[{cls}]"
        else:
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
            line = (f"  mark {shown} ({cls}) as eager islands, or every {cls} "
                    f"(GraphRunner(..., islands=[{cls}]), or accel_graph.eager_island(m) for "
                    f"each {cls} m in model.modules()) ({count} finding(s))")
            outer = enclosing.get(cls)
            if outer is not None:
                line += f"; the enclosing {outer['class']} would do too"
        lines.append(line)
    if outside:
        lines.append(f"  {outside} finding(s) outside every nn.Module: move that code into a "
                     f"function decorated with @accel_graph.eager_island")
    return lines


@contextlib.contextmanager
def islands_run_eagerly(found: Callable[[str, str, str], None],
                        in_body: Callable[[], bool]) -> Iterator[Callable[[], None]]:
    """Eager islands (``accel_graph.eager_island``) called during ``check_capturable``: run
    eagerly and unflagged (a capture runs them eagerly at every replay), through the island
    runner a capture installs (:mod:`accel_graph.backends.capture_common.islands`); the
    flaggers let work through while ``islands.running()``.

    What a capture would refuse of an island itself goes to ``found(op, reason, where)``: a call
    while ``in_body()`` (a ``torch.cond`` / ``while_loop`` body), and outputs other than tensors
    or tuples/lists/dicts of them (None allowed). Yields ``quiet()``: after it, islands still
    run but report nothing (the baked-value check's later runs). Installs nothing when a capture
    or an island is underway on this thread (theirs decides)."""
    loud = [True]

    def run(info: island_marks.IslandInfo, fn: Callable[..., Any], args: tuple,
            kwargs: dict) -> Any:
        where, op = user_frame(), f"eager_island {info.name}"
        if loud[0] and in_body():
            found(op, f"eager island {info} is called inside a torch.cond branch or a "
                      f"while_loop body: capture refuses it (a body is recorded without running, "
                      f"so there are no real values to run the island on); call it outside the "
                      f"cond/while_loop", where)
        with island_marks.running_island():
            out = fn(*args, **kwargs)
        bad = [x for x in pytree.tree_leaves(out) if x is not None and not isinstance(x, torch.Tensor)]
        if loud[0] and bad:
            found(op, f"eager island {info} returns {type(bad[0]).__name__} {bad[0]!r:.60}: an "
                      f"island's outputs become static buffers, so they must be tensors or "
                      f"tuples/lists/dicts of them (None allowed); capture raises CaptureError. "
                      f"Return a tensor (torch.tensor(value, device=...)) or keep the value "
                      f"inside the island", where)
        return out

    def quiet() -> None:
        loud[0] = False

    if island_marks.capture_runner() is not None or island_marks.running():
        yield quiet
        return
    token = island_marks.set_runner(run)
    try:
        yield quiet
    finally:
        island_marks.clear_runner(token)
