"""The package's rooms import one way (docs/DESIGN.md, "The package map").

Read from the source with ast, every import counts: at the top of a module, inside a function (the
lazy imports that keep the launcher fast) and under TYPE_CHECKING. The entry modules at the top
(`python -m dflash_mp.train`, `.eval`, `.reference`, `.plot`) import the rooms and nothing imports
them; a room imports only the rooms below it; and no module reaches itself through its imports, so
a function-local import may stand for a reason (a heavy or optional dependency, the launcher's start)
but never to hide a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "dflash_mp"
_BELOW_RUNTIME = {
    "training",
    "evaluation",
    "export",
    "objective",
    "models",
    "kernels",
    "config",
    "data",
    "run",
}
# Room -> the rooms it may import, from the bottom up. `embedded` is the bundled tiny target and data:
# a top-level module (`python -m dflash_mp.embedded`) that imports nothing, so every room may use its
# paths.
MAY_IMPORT: dict[str, set[str]] = {
    "embedded": set(),
    "kernels": set(),
    "run": set(),
    "models": {"kernels"},
    "objective": {"models", "kernels"},
    "data": {"embedded"},
    "config": {"data", "models", "kernels", "embedded"},
    "training": {"objective", "models", "kernels", "config", "data", "run", "embedded"},
    "evaluation": {"models", "kernels", "config", "data", "run", "embedded"},
    "export": {"training", "objective", "models", "kernels", "config", "data", "run", "embedded"},
    "runtime": _BELOW_RUNTIME | {"embedded"},
    "plan": {"config", "data", "models", "kernels", "embedded"},
    "regenerate": {"evaluation", "config", "data", "models", "kernels", "run", "embedded"},
    "launch": _BELOW_RUNTIME | {"runtime", "plan", "embedded"},
}
# The training math: what it computes must not depend on how the job is laid out over processes.
MATH = {"objective", "kernels", "models"}
# Circles between modules that this test knows of, each with the reason it still stands. An entry
# whose circle is gone fails the test below: delete it.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def _room(module: str) -> str:
    """dflash_mp.runtime.roles -> runtime; dflash_mp.launch.sweep -> launch; dflash_mp.train -> entry."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "entry"


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, not `__init__`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path] | None = None) -> list[tuple[int, str, bool]]:
    """(line, imported dflash_mp module, whether the import stands inside a function) for every
    import in the file. With `modules`, each name resolves to the module it loads: `from
    dflash_mp.data import packing` is dflash_mp.data.packing, `from dflash_mp.data import DataError`
    the package dflash_mp.data."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if modules is None and node.module != "dflash_mp":
                names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: a relative import; name the module in full")
        else:
            continue
        for name in names:
            while modules is not None and name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name.split(".")[0] == "dflash_mp":
                found.append((node.lineno, name, id(node) in local))
    return found


def _violations(may_import: dict[str, set[str]]) -> list[str]:
    """Imports of a room in `may_import` that reach a room it does not list."""
    found = []
    for module, path in _modules().items():
        room = _room(module)
        if room not in may_import:
            continue
        for line, imported, _ in _imports(path):
            target = _room(imported)
            if target != room and target not in may_import[room]:
                found.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {imported} ({target})")
    return found


def test_every_room_imports_only_the_rooms_below_it() -> None:
    problems = _violations(MAY_IMPORT)
    assert not problems, "imports against the package map (docs/DESIGN.md):\n" + "\n".join(problems)


def test_the_entry_modules_import_rooms_and_nothing_imports_them() -> None:
    """`train.py`, `eval.py`, `reference.py`, `plot.py` are commands: each imports rooms only, and
    the rooms (the launcher's agent included) import no command; what a command needs from another
    lives in a room (the rank's program in `launch/rank.py`, the preflight in `launch/doctor.py`)."""
    problems = [
        f"{path.relative_to(REPO)}:{line} imports the entry module {imported}"
        for module, path in _modules().items()
        if module != "dflash_mp"
        for line, imported, _ in _imports(path)
        if _room(imported) == "entry" and imported != "dflash_mp"
    ]
    assert not problems, "\n".join(problems)


def test_the_math_imports_nothing_from_the_distributed_runtime() -> None:
    """objective/, kernels/ and models/ compute the same whatever the job's layout: they import no
    room outside the math (not the runtime, the trainer, the config or the run directory)."""
    problems = _violations({room: MATH & MAY_IMPORT[room] for room in MATH})
    assert not problems, "\n".join(problems)


def test_the_rooms_form_no_cycle() -> None:
    """The table itself runs one way: a room never reaches itself through the rooms it may import."""

    def reachable(room: str, seen: frozenset[str]) -> None:
        for lower in MAY_IMPORT[room]:
            assert lower not in seen | {room}, f"{room} -> {lower} closes a cycle"
            reachable(lower, seen | {room})

    for room in MAY_IMPORT:
        reachable(room, frozenset())


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = {stack.pop()}
            while module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                circles.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_module_reaches_itself_through_its_imports() -> None:
    """Function-local imports included: one that only hides a circle fails here, naming its line."""
    modules = _modules()
    graph = {module: set() for module in modules}
    edges = {}
    for module, path in modules.items():
        for line, imported, local in _imports(path, modules):
            if imported != module:
                graph[module].add(imported)
                edges.setdefault(
                    (module, imported), f"{path.relative_to(REPO)}:{line}" + " (in a function)" * local
                )
    circles = _circles(graph)
    new = [circle for circle in circles if circle not in KNOWN_CIRCLES]
    described = [
        " and ".join(edges[(a, b)] for a in sorted(circle) for b in sorted(circle) if (a, b) in edges)
        for circle in new
    ]
    assert not new, "modules that import each other:\n" + "\n".join(described)
    gone = [sorted(circle) for circle in KNOWN_CIRCLES if circle not in circles]
    assert not gone, f"no longer circles, delete them from KNOWN_CIRCLES: {gone}"


def test_every_room_is_placed_in_the_map_and_the_design_doc() -> None:
    """A new folder gets a row here and in docs/DESIGN.md's package map before it gets code."""
    design = (REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(MAY_IMPORT), f"rooms missing from MAY_IMPORT: {folders - set(MAY_IMPORT)}"
    unnamed = sorted(name for name in folders if f"`{name}/`" not in design)
    assert not unnamed, f"docs/DESIGN.md's package map lacks {unnamed}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from dflash_mp.runtime.roles import run_drafter", ("runtime", False)),
        ("def f():\n    from dflash_mp.run import checkpoint", ("run", True)),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash_mp import train",
            ("entry", False),
        ),
    ],
)
def test_lazy_and_type_only_imports_count(tmp_path: Path, source: str, expected: tuple[str, bool]) -> None:
    path = tmp_path / "module.py"
    path.write_text(source + "\n")
    assert [(_room(name), local) for _, name, local in _imports(path)] == [expected]


def test_a_circle_hidden_in_a_function_is_found() -> None:
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _circles(graph) == [frozenset({"a", "b"})]
