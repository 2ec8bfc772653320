"""The engine contract, checked on the source (issue 28, acceptance 2): walks the AST of every
file in moed/ and refuses

- `getattr(x, ...)` / `hasattr(x, ...)` where x is an engine, a runner or a component: callers
  use the typed contract (moed.engine.client.EngineClient, moed.engine.runner.StepRunner, the
  component's class) instead of probing;
- an annotation `Any` (or `Any | None`) on a name that holds an engine, a runner or a worker;
- `inspect.isawaitable` (add_request and abort have one, synchronous, signature);
- a component looked up by its name string (`c.name == "cluster"`): by type instead.

How an expression is recognised as an engine, runner or component: its last identifier (a
name, or the attribute of `self._engine`, `app.state.engine`, ...) is one of ENGINE_NAMES,
RUNNER_NAMES or COMPONENT_NAMES, or it is a variable bound by iterating over `.components`
(a for loop or a comprehension). Annotated names: their last identifier is in HELD_NAMES.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "moed"

ENGINE_NAMES = {"engine", "_engine", "eng", "inner", "local"}
RUNNER_NAMES = {"runner", "_runner"}
COMPONENT_NAMES = {"component", "comp", "prefill", "cluster", "membership", "_membership",
                   "_prefill"}
HELD_NAMES = {"engine", "_engine", "runner", "_runner", "worker", "_worker"}
ANY = {"Any", "Any | None", "Optional[Any]", "None | Any"}

# Uses that stay, each with why: (path relative to moed/, the source line stripped)
ALLOWED: dict[tuple[str, str], str] = {}


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _component_vars(tree: ast.AST) -> set[str]:
    """Names bound by iterating over something's `.components`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, (ast.For, ast.AsyncFor)):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.comprehension):
            pairs.append((node.target, node.iter))
        for target, it in pairs:
            if _last_name(it) in ("components", "_started") and isinstance(target, ast.Name):
                out.add(target.id)
    return out


def _violations(path: Path) -> list[tuple[int, str, str]]:
    src = path.read_text()
    tree = ast.parse(src, str(path))
    lines = src.splitlines()
    comps = _component_vars(tree)
    targets = ENGINE_NAMES | RUNNER_NAMES | COMPONENT_NAMES
    found: list[tuple[int, str, str]] = []

    def add(node: ast.AST, what: str) -> None:
        found.append((node.lineno, lines[node.lineno - 1].strip(), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and node.args:
            name = _last_name(node.args[0])
            if name in targets or (isinstance(node.args[0], ast.Name) and name in comps):
                add(node, f"{node.func.id} on an engine/runner/component ({name})")
        if isinstance(node, ast.Attribute) and node.attr == "isawaitable":
            add(node, "inspect.isawaitable")
        if isinstance(node, ast.ImportFrom) and node.module == "inspect" \
                and any(a.name == "isawaitable" for a in node.names):
            add(node, "inspect.isawaitable")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "name"
                     and _last_name(s.value) in comps | COMPONENT_NAMES]
            if named and any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                             for s in sides):
                add(node, "a component looked up by its name string")
        held: list[tuple[ast.AST, ast.AST | None]] = []
        if isinstance(node, ast.arg):
            held.append((node, node.annotation))
        elif isinstance(node, ast.AnnAssign):
            held.append((node.target, node.annotation))
        for target, ann in held:
            name = target.arg if isinstance(target, ast.arg) else _last_name(target)
            if ann is not None and name in HELD_NAMES and ast.unparse(ann) in ANY:
                add(target, f"{name}: {ast.unparse(ann)}")
    return found


def test_no_probing_of_engines_runners_or_components() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, text, what in _violations(path):
            if (rel, text) not in ALLOWED:
                bad.append(f"moed/{rel}:{line}: {what}: {text}")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_each_kind(tmp_path: Path) -> None:
    """The rules fire on the shapes issue 28 found (a checker that finds nothing is no check)."""
    f = tmp_path / "bad.py"
    f.write_text(
        "import inspect\n"
        "from typing import Any\n"
        "def f(app, engine: Any, worker: Any | None = None) -> None:\n"
        "    check = getattr(engine, 'ttft_over_deadline', None)\n"
        "    known = getattr(self.runner, 'argmax_of', None)\n"
        "    local = getattr(self._engine, 'local', None)\n"
        "    m = next((c for c in app.components if getattr(c, 'name', '') == 'cluster'), None)\n"
        "    for c in app.components:\n"
        "        if c.name == 'prefill':\n"
        "            pass\n"
        "    if inspect.isawaitable(check):\n"
        "        pass\n"
        "class C:\n"
        "    runner: Any = None\n")
    kinds = [what for _, _, what in _violations(f)]
    assert sum("getattr" in k for k in kinds) == 4, kinds
    assert sum("name string" in k for k in kinds) == 1, kinds
    assert sum("isawaitable" in k for k in kinds) == 1, kinds
    assert {k for k in kinds if ": Any" in k} == {"engine: Any", "worker: Any | None",
                                                   "runner: Any"}, kinds
