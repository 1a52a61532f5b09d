"""The layering rules of router.api and router.ingress, read from the code's
own imports (type-only ones included, as a reader sees them):

- router.api is pure: it imports nothing of the router but itself, and no
  module that does I/O, runs an event loop or starts threads;
- router.ingress's handlers never import the server (router.ingress.http_server):
  they see their request and connection through router.ingress.connection,
  so the package's imports have no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPURE = ("asyncio", "concurrent", "multiprocessing", "selectors", "socket", "subprocess", "threading", "zmq")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import stands (``from a import b``: a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def modules(package: str) -> dict[str, Path]:
    folder = ROOT / package.replace(".", "/")
    return {f"{package}.{p.stem}": p for p in sorted(folder.glob("*.py")) if p.stem != "__init__"}


def test_api_imports_only_itself_and_shared_and_nothing_impure() -> None:
    wrong = {}
    for name, path in modules("router.api").items():
        bad = sorted(
            m
            for m in imports(path)
            if (m.startswith("router.") and not m.startswith("router.api"))
            or m.split(".")[0] in IMPURE
            or m.startswith("shared.transport")
        )
        if bad:
            wrong[name] = bad
    assert wrong == {}


def test_ingress_handlers_never_import_the_server_and_no_module_imports_itself_back() -> None:
    mods = modules("router.ingress")
    graph = {name: {m for m in imports(path) if m in mods and m != name} for name, path in mods.items()}
    assert sorted(n for n, deps in graph.items() if "router.ingress.http_server" in deps) == []

    def on_a_circle(name: str) -> bool:
        seen: set[str] = set()
        todo = list(graph[name])
        while todo:
            m = todo.pop()
            if m == name:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return False

    assert sorted(n for n in graph if on_a_circle(n)) == []
