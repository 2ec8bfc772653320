"""moed's import graph: no circle, and no package imports one above it in the layering.

The graph is read from the source with `ast` (nothing is imported): every `import` and
`from ... import` of moed, at module level and inside functions alike (a function-level import
is still a dependency, only a later one); imports under `if TYPE_CHECKING:` are left out (they
never run). A `from moed.pkg import name` where `name` is a module counts as an import of that
module. Dynamic imports (`importlib.import_module`: the architecture registry's discovery) are
not in the graph.

LAYERS is the layering, written once here and in docs/architecture.md ("Layering"): top to
bottom, a module imports only from its own package and the layers below it; the packages that
share a layer do not import one another.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "moed"

# top-level package (or module) of moed -> its layer, top first; "__init__" is moed/__init__.py
LAYERS: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),                  # argv -> config -> app; `moed model init` calls dev/
    ("app", "dev"),            # app wires the roles; dev/: tools outside the serving path
    ("preflight",),            # the checks serve and check-config run before loading weights
    ("roles", "ops"),
    ("api",),
    ("engine",),
    ("parallel",),
    ("kvcache",),
    ("model",),                # nothing of balance/: expert routing lives in the model
    ("transfer",),
    ("balance",),              # pure policy, below everything that applies it
    ("cluster",),
    ("obs",),
    ("config",),
    ("safefile",),
    ("types",),
    ("__init__",),             # the version
]

# Edges (importer module, imported module) that break the rules for now, each with the issue
# that removes it. Empty: keep it so (test_pending_edges_still_exist makes it only shrink).
PENDING: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ["moed", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The moed modules `module` imports (outside TYPE_CHECKING blocks)."""
    package = module if is_package else module.rpartition(".")[0]

    def owner(name: str) -> str | None:       # the longest known module that `name` is in
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "moed" or alias.name.startswith("moed."):
                    found.add(owner(alias.name) or "moed")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "moed" or source.startswith("moed."):
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    found.add(sub if sub in known else owner(source) or "moed")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(ast.parse(p.read_text(), str(p)), m, p.name == "__init__.py", known)
            for m, p in known.items()}


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from `start` back to itself, if any (BFS)."""
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        m = queue.popleft()
        for n in sorted(graph[m]):
            if n == start:
                path = [m]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if m != start else [start, start]
            if n not in prev:
                prev[n] = m
                queue.append(n)
    return None


def _without_pending(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {n for n in out if (m, n) not in PENDING} for m, out in graph.items()}


def test_the_graph_sees_what_it_must() -> None:
    """Guards the reader: module-level, function-level, relative and TYPE_CHECKING imports."""
    g = import_graph()
    assert "moed.model.hf_config" in g["moed.model.runner"]                      # module level
    assert "moed.model.hf_config" in g["moed.engine.build"]                      # in a function
    assert "moed.cluster.clock" in g["moed.cluster.swim"]                        # relative
    assert "moed.model.archs" in g["moed.model.hf_config"]                       # from pkg import mod
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moed.app import App\n"
    assert _imports(ast.parse(src), "moed.x", False, {"moed.app": ROOT}) == set()


def test_no_import_circle() -> None:
    g = _without_pending(import_graph())
    cycles = []
    for m in sorted(g):
        path = _cycle_through(g, m)
        if path is not None and min(path) == m:      # each circle once, from its least module
            cycles.append(" -> ".join(path))
    assert not cycles, "import circles:\n  " + "\n  ".join(cycles)


def test_every_package_has_a_layer() -> None:
    listed = [p for layer in LAYERS for p in layer]
    assert len(listed) == len(set(listed)), "a package is in two layers"
    missing = sorted({top(m) for m in import_graph()} - set(listed))
    assert not missing, f"packages without a layer in LAYERS: {missing}"


def test_no_package_imports_one_above_it() -> None:
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    bad = []
    for m, out in sorted(_without_pending(import_graph()).items()):
        for n in sorted(out):
            a, b = top(m), top(n)
            if a in rank and b in rank and a != b and rank[b] <= rank[a]:   # unlisted: the test above
                where = f"in {a}'s layer" if rank[a] == rank[b] else f"above {a}"
                bad.append(f"{m} imports {n}: {b} is {where}")
    assert not bad, "layering violations:\n  " + "\n  ".join(bad)


def test_pending_edges_still_exist() -> None:
    """An entry whose import is gone must leave PENDING, so the set only shrinks."""
    g = import_graph()
    stale = sorted(f"{m} -> {n}" for m, n in PENDING if n not in g.get(m, set()))
    assert not stale, f"remove from PENDING (no longer imported): {stale}"


# Rooms stay small (issue 28): a module past this many lines is split by owner. The exceptions
# are declarative tables, each with why.
MAX_LINES = 450
LONG_TABLES = {
    "moed/obs/metrics.py": "every moed_* metric declared in one table (docs/metrics.md maps it)",
}


def test_no_module_over_max_lines() -> None:
    root = Path(__file__).resolve().parents[2]
    long = {str(p.relative_to(root)): n for p in (root / "moed").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= set(LONG_TABLES), f"over {MAX_LINES} lines, split them: {long}"
