"""The router's packages are its layers: each imports only those below it, and no
module imports itself back through others.  Read from the source (every import,
type-only ones and those inside functions included), so a new arrow that runs
back up, or a new circle, fails here before a reader trips on it
(docs/architecture.md draws the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

from stackutil import REPO

# Top to bottom: a package may import those after it, never one before it.
LAYERS = ("ingress", "services", "lifecycle", "policy", "fleet", "tenancy", "observe", "api")
CHECKED = ("shared", "router", "engine_worker", "deploy", "simulation", "weir")


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Every project module this file names in an import (``from x import y``
    counts ``x.y`` when that is a module, else ``x``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            named = {f"{base}.{a.name}" for a in node.names}
            found.update(named & modules or {base})
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_of(f): f for top in CHECKED for f in (REPO / top).rglob("*.py")}
    known = set(files)
    return {m: {i for i in _imports(f, m, known) if i in known and i != m} for m, f in files.items()}


def _layer(module: str) -> str | None:
    """The layer a module is in: its package's, the package's own __init__ included."""
    parts = module.split(".")
    return parts[1] if parts[0] == "router" and len(parts) >= 2 and parts[1] in LAYERS else None


def test_the_top_of_the_router_holds_only_its_layers_and_the_process_entry():
    top = {p.name for p in (REPO / "router").iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert top == {"__init__.py", "__main__.py", *LAYERS}


def test_no_router_package_imports_one_above_it():
    back = []
    for mod, deps in _graph().items():
        here = _layer(mod)
        if here is None:
            continue
        for dep in deps:
            there = _layer(dep)
            if there is not None and LAYERS.index(there) < LAYERS.index(here):
                back.append(f"{mod} -> {dep}")
            elif dep in ("router", "router.__main__"):
                back.append(f"{mod} -> {dep}")
    assert not back, back


def test_no_import_circles_type_only_included():
    graph = _graph()
    # Tarjan's strongly connected components: any with two modules or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            # a package's __init__ that re-exports its modules is not a circle of the design
            members = [m for m in comp if not any(o.startswith(m + ".") for o in comp)]
            if len(members) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles
