"""The package's shape, checked from its own source (docs/architecture.md).

Imports are parsed with :mod:`ast` (nothing is imported), so the rules hold for every module,
whether a test imports it or not:

- **Layers.** Every module belongs to one layer of :data:`LAYERS`; it may import its own layer
  and lower ones, never a higher one. Imports inside functions and under ``TYPE_CHECKING`` count:
  a lazy import still makes the lower layer depend on the higher one.
- **No circles.** The graph of module-level imports (the ones that run at import time, not those
  under ``TYPE_CHECKING``) has no cycle.
- **No private names across modules.** No module imports another module's ``_name`` or reads
  ``module._name`` of an accel_graph module it imported.
- **No hidden circles.** Counting the imports inside functions too (not those under
  ``TYPE_CHECKING``), there is still no cycle: an in-function import that only hides a circle
  is a circle.
- **Small modules.** No Python module is over 500 lines (the aim is about 400: the cap is a
  backstop, not a target).
- **Every module is on the map.** docs/architecture.md's table "Where each behaviour lives"
  names every module (its path under ``accel_graph/``, or a tail of the path that no other
  module shares), and every ``.py`` path it names exists. A package's ``__init__.py`` needs a
  row only when it defines a function or class.
- **The recorder is reached only through the registry.** No module outside
  ``accel_graph.backends.recorder`` imports from it (what the recorder shares with the native
  backends, ``graphs`` and ``runner`` lives in ``accel_graph.backends.capture_common``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "accel_graph"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"

#: Lowest first. A module's layer is the one of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("accel_graph.foundation", "accel_graph.errors"),
    ("accel_graph.allocator.units", "accel_graph.allocator.alloc_conf",
     "accel_graph.allocator.devices"),
    ("accel_graph.allocator.traces",),
    ("accel_graph.allocator.core",),
    ("accel_graph.allocator.sim",),
    ("accel_graph.allocator.tune", "accel_graph.allocator.analysis"),
    ("accel_graph.allocator",),  # the lazy package face
    ("accel_graph.backends.base",),
    ("accel_graph.backends",),
    ("accel_graph.graphs",),
    ("accel_graph.runner",),
    # The package face: lazy public names over the layers below. Everything above uses the
    # public API through it, as a user would.
    ("accel_graph",),
    ("accel_graph.models", "accel_graph.bench", "accel_graph.testing", "accel_graph.serving"),
    ("accel_graph.cli",),
)

MAX_LINES = 500


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    #: (target module, imported names, line, runs at import time)
    imports: list[tuple[str, tuple[str, ...], int, bool]] = field(default_factory=list)


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                ids.update(id(n) for n in ast.walk(sub))
    return ids


def _import_time_nodes(tree: ast.Module) -> set[int]:
    """Import nodes that run when the module is imported: outside every function body."""
    ids: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            ids.add(id(child))
            visit(child)

    visit(tree)
    return ids


def _load() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted(ROOT.rglob("*.py")):
        name, is_pkg = _module_name(path)
        text = path.read_text()
        modules[name] = Module(name, path, is_pkg, ast.parse(text), len(text.splitlines()))
    for mod in modules.values():
        typing_only = _type_checking_blocks(mod.tree)
        at_import = _import_time_nodes(mod.tree)
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        for node in ast.walk(mod.tree):
            eager = id(node) in at_import and id(node) not in typing_only
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("accel_graph"):
                    continue
                names = tuple(a.name for a in node.names)
                # `from pkg import submodule` depends on the submodule
                subs = [n for n in names if f"{target}.{n}" in modules]
                for n in subs:
                    mod.imports.append((f"{target}.{n}", (), node.lineno, eager))
                rest = tuple(n for n in names if n not in subs)
                if rest or not subs:
                    mod.imports.append((target, rest, node.lineno, eager))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("accel_graph"):
                        mod.imports.append((a.name, (), node.lineno, eager))
    return modules


MODULES = _load()


def _resolve(target: str) -> str | None:
    """The module an import names (a compiled extension or unknown name: None)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_import_runs_up_a_layer():
    bad = []
    for mod in MODULES.values():
        own = layer_of(mod.name)
        for target, _names, line, _eager in mod.imports:
            resolved = _resolve(target)
            if resolved is None:
                continue
            # a package's own face imports its submodules; that is down, not up
            if resolved.startswith(mod.name + ".") and mod.is_package:
                continue
            if layer_of(resolved) > own:
                bad.append(f"{mod.path.relative_to(ROOT.parent)}:{line} imports {resolved} "
                           f"(layer {layer_of(resolved)} > {own})")
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    edges: dict[str, set[str]] = {}
    for mod in MODULES.values():
        for target, _names, _line, eager in mod.imports:
            resolved = _resolve(target)
            if eager and resolved is not None and resolved != mod.name:
                edges.setdefault(mod.name, set()).add(resolved)
    assert not _cycles(edges), f"import circles: {_cycles(edges)}"


def test_no_circles_hidden_in_functions():
    edges: dict[str, set[str]] = {}
    for mod in MODULES.values():
        typing_only = {line for line in _typing_only_lines(mod)}
        for target, _names, line, _eager in mod.imports:
            resolved = _resolve(target)
            if line in typing_only or resolved is None or resolved == mod.name:
                continue
            # a package's face importing its own submodules (lazily) is down, not a circle
            if mod.is_package and resolved.startswith(mod.name + "."):
                continue
            edges.setdefault(mod.name, set()).add(resolved)
    assert not _cycles(edges), f"import circles through in-function imports: {_cycles(edges)}"


def _typing_only_lines(mod: Module) -> set[int]:
    ids = _type_checking_blocks(mod.tree)
    return {n.lineno for n in ast.walk(mod.tree)
            if id(n) in ids and isinstance(n, (ast.Import, ast.ImportFrom))}


def _relpath(mod: Module) -> str:
    return mod.path.relative_to(ROOT).as_posix()


def _needs_row(mod: Module) -> bool:
    if not mod.is_package:
        return True
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in mod.tree.body)


def table_paths(doc: str) -> set[str]:
    """The ``.py`` paths the table of docs/architecture.md names (in backticks)."""
    section = doc.split("## Where each behaviour lives", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([\w/]+\.py)`", section))


def unmapped(paths: list[str], named: set[str]) -> tuple[list[str], list[str]]:
    """(modules the table does not name, table paths that name no single module)."""
    def matches(token: str) -> list[str]:
        return [p for p in paths if p == token or p.endswith("/" + token)]

    resolved = {t: matches(t) for t in named}
    stale = sorted(t for t, hits in resolved.items() if len(hits) != 1)
    covered = {hits[0] for hits in resolved.values() if len(hits) == 1}
    return sorted(set(paths) - covered), stale


def test_every_module_is_in_the_architecture_table():
    paths = [_relpath(m) for m in MODULES.values()]
    needed = [_relpath(m) for m in MODULES.values() if _needs_row(m)]
    named = table_paths(ARCHITECTURE.read_text())
    # paths outside the package (tests/, tools/) must exist; the rest must name one module
    outside = {t for t in named if t.split("/", 1)[0] in ("tests", "tools")}
    gone = sorted(t for t in outside if not (ROOT.parent / t).is_file())
    assert not gone, "paths in docs/architecture.md's table that do not exist:\n" + "\n".join(gone)
    missing, stale = unmapped(paths, named - outside)
    missing = [p for p in missing if p in needed]
    assert not missing, ("modules docs/architecture.md's table does not name (add a row, or "
                         "the module to a row):\n" + "\n".join(missing))
    assert not stale, ("paths in docs/architecture.md's table that name no module, or more "
                       "than one (spell more of the path):\n" + "\n".join(stale))


_XREF = re.compile(r":(mod|class|func|data|meth|attr|exc):`~?(\.+[\w.]+)`")


def stale_references(package: str, text: str, modules: set[str]) -> list[str]:
    """The relative Sphinx references in ``text`` (``:mod:`.x```, ``:func:`..y.f```) of a module
    of ``package`` that name no module; ``:func:`.name``` and ``:meth:`.Class.name``` (this
    module's own) pass."""
    stale = []
    for role, ref in _XREF.findall(text):
        dots = len(ref) - len(ref.lstrip("."))
        base = package.split(".")
        base = base[: len(base) - (dots - 1)] if dots > 1 else base
        parts = ref[dots:].split(".")
        known = any(".".join(base + parts[:k]) in modules for k in range(len(parts), 0, -1))
        # ``.name`` or ``.Class.attr`` name something of this module itself
        own = role != "mod" and dots == 1 and (len(parts) == 1 or (len(parts) == 2 and parts[0][:1].isupper()))
        if not known and not own:
            stale.append(f":{role}:`{ref}`")
    return stale


def test_docstring_references_name_modules_that_exist():
    """A module that moved leaves no ``:mod:`.old_name``` behind in its neighbours' docstrings."""
    names = set(MODULES)
    stale = []
    for mod in MODULES.values():
        package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
        stale += [f"{_relpath(mod)}: {r}" for r in stale_references(package, mod.path.read_text(), names)]
    assert not stale, "references to modules that do not exist:\n" + "\n".join(stale)


def _private_uses(mod: Module) -> Iterator[str]:
    aliases: dict[str, str] = {}
    for target, names, line, _eager in mod.imports:
        resolved = _resolve(target)
        if resolved is None:
            continue
        for n in names:
            if n.startswith("_") and not n.startswith("__") and resolved != mod.name:
                yield f"{mod.path.relative_to(ROOT.parent)}:{line} imports {resolved}.{n}"
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
            for a in node.names:
                full = None
                if isinstance(node, ast.Import) and a.name.startswith("accel_graph"):
                    full = a.name
                elif isinstance(node, ast.ImportFrom):
                    for target, _n, line, _e in mod.imports:
                        if line == node.lineno and target.endswith("." + a.name):
                            full = target
                if full and full in MODULES and full != mod.name:
                    aliases[a.asname or a.name.split(".")[0]] = full
    for node in ast.walk(mod.tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            yield (f"{mod.path.relative_to(ROOT.parent)}:{node.lineno} reads "
                   f"{aliases[node.value.id]}.{node.attr}")


def test_no_private_names_across_modules():
    bad = [use for mod in MODULES.values() for use in _private_uses(mod)]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    mod = MODULES[name]
    assert mod.lines <= MAX_LINES, (
        f"{mod.path.relative_to(ROOT.parent)} has {mod.lines} lines (at most {MAX_LINES}): "
        "split it where a reader would look for the behaviour"
    )


RECORDER = "accel_graph.backends.recorder"
#: Modules outside the recorder that may import it: the registry that creates the recorder
#: backend (today it names it by string, "accel_graph.backends.recorder:RecorderBackend").
RECORDER_IMPORTERS_ALLOWED: frozenset[str] = frozenset({"accel_graph.backends"})


def _reaches_into(package: str, allowed: frozenset[str]) -> list[str]:
    """Imports of ``package`` (or anything under it) by modules outside it, except ``allowed``."""
    bad = []
    for mod in MODULES.values():
        if mod.name == package or mod.name.startswith(package + ".") or mod.name in allowed:
            continue
        for target, _names, line, _eager in mod.imports:
            resolved = _resolve(target)
            if resolved is not None and (resolved == package or resolved.startswith(package + ".")):
                bad.append(f"{mod.path.relative_to(ROOT.parent)}:{line} imports {resolved}")
    return bad


def test_nothing_outside_the_recorder_imports_it():
    bad = _reaches_into(RECORDER, RECORDER_IMPORTERS_ALLOWED)
    assert not bad, ("modules reaching into the recorder (move what they share to "
                     "accel_graph/backends/capture_common/):\n" + "\n".join(bad))


def test_the_rules_catch_what_they_claim(tmp_path):
    """The checks themselves can fail: a made-up cycle and an upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layer_of("accel_graph.allocator.core.engine") < layer_of("accel_graph.backends.cuda")
    assert layer_of("accel_graph.foundation.tolerances") < layer_of("accel_graph.runner.verify")
    assert layer_of("accel_graph.runner") < layer_of("accel_graph") < layer_of("accel_graph.cli")
    paths = ["a/x.py", "b/x.py", "b/y.py", "z.py"]
    assert unmapped(paths, {"a/x.py", "y.py", "z.py"}) == (["b/x.py"], [])
    assert unmapped(paths, {"x.py", "b/x.py", "a/x.py", "y.py", "z.py", "gone.py"}) == (
        [], ["gone.py", "x.py"])
    doc = "## Where each behaviour lives\n| a | `b/y.py`, `z.py` |\n## Recipes\n`a/x.py`"
    assert table_paths(doc) == {"b/y.py", "z.py"}
    mods = {"p", "p.a", "p.q", "p.q.b"}
    assert stale_references("p.q", ":mod:`.b` :func:`..a.f` :class:`.Local` :meth:`.Local.m`", mods) == []
    assert stale_references("p.q", ":mod:`.gone` :func:`.a.f` :mod:`..b`", mods) == [
        ":mod:`.gone`", ":func:`.a.f`", ":mod:`..b`"]
    # the recorder's own modules import each other; the boundary check sees the others' imports
    assert _reaches_into(RECORDER, frozenset()) == _reaches_into(RECORDER, RECORDER_IMPORTERS_ALLOWED)
    assert _reaches_into("accel_graph.backends.capture_common", frozenset())
