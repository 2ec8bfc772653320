"""The config package stays at the bottom of moed and has no import circle of its own; the
pre-flight no longer imports the app (it got node_name from moed.app, which imports it)."""
from __future__ import annotations

import ast
from pathlib import Path

MOED = Path(__file__).resolve().parents[3] / "moed"
PACKAGE = MOED / "config"


def _module(path: Path) -> str:
    parts = ["moed", *path.relative_to(MOED).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """What `path` imports of moed, anywhere in it (functions too): `from a.b import c` as
    a.b.c when that is a module, else as a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("moed")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moed"):
            assert node.level == 0, f"{path}: relative import"
            base = MOED.parent.joinpath(*node.module.split("."))
            for a in node.names:
                sub = base / a.name
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                out.add(f"{node.module}.{a.name}" if is_module else node.module)
    return out


def test_config_imports_nothing_of_moed_above_it() -> None:
    """Every layer reads the config: it may import only itself, the safe-file reader and the
    version."""
    for path in PACKAGE.rglob("*.py"):
        for name in _imports(path):
            assert name.startswith(("moed.config", "moed.safefile")) or name in (
                "moed", "moed.__version__"), f"{path} imports {name}"


def test_no_import_circle_inside_config() -> None:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):          # the longest known module it names
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    # the package's __init__ re-exports everything: none of its modules may import it
    assert not [m for m, deps in graph.items() if "moed.config" in deps], graph
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, "import circle: " + " -> ".join((*path, m))
        if m in done:
            return
        for n in sorted(graph[m]):
            visit(n, (*path, m))
        done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_preflight_does_not_import_the_app() -> None:
    assert not {n for n in _imports(MOED / "preflight.py") if n.startswith("moed.app")}


def test_every_config_module_is_small() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 450, path
