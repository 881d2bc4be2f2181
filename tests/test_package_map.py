"""The package's rooms import one way (docs/DESIGN.md, "The package map").

Read from the source with ast, every import counts: at the top of a module, inside a function (the
lazy imports that keep the launcher fast) and under TYPE_CHECKING. A room may import only the rooms
below it; the entry points (the top-level modules, launch/, plan/, regenerate/) may import any room,
and no room imports an entry point.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "dflash_mp"
# Room -> the rooms it may import. `embedded` is the bundled tiny target and data: a top-level
# module (`python -m dflash_mp.embedded`) that imports nothing, so every room may use its paths.
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
    "runtime": {
        "training",
        "evaluation",
        "export",
        "objective",
        "models",
        "kernels",
        "config",
        "data",
        "run",
        "embedded",
    },
}
ENTRY_ROOMS = {"launch", "plan", "regenerate"}
# The training math: what it computes must not depend on how the job is laid out over processes.
MATH = {"objective", "kernels", "models"}


def _room(module: str) -> str:
    """dflash_mp.runtime.roles -> runtime; dflash_mp.train, dflash_mp.launch.sweep -> entry."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "entry"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dflash_mp module) for every import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dflash_mp":  # from dflash_mp import embedded
                found += [(node.lineno, f"dflash_mp.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: a relative import; name the module in full")
    return [(line, name) for line, name in found if name.split(".")[0] == "dflash_mp"]


def _modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(REPO).with_suffix("").parts), path)
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _violations(may_import: dict[str, set[str]]) -> list[str]:
    """Imports of a room in `may_import` that reach a room it does not list."""
    found = []
    for module, path in _modules():
        room = _room(module)
        if room not in may_import:
            continue
        for line, imported in _imports(path):
            target = _room(imported)
            if target != room and target not in may_import[room]:
                found.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {imported} ({target})")
    return found


def test_every_room_imports_only_the_rooms_below_it() -> None:
    problems = _violations(MAY_IMPORT)
    assert not problems, "imports against the package map (docs/DESIGN.md):\n" + "\n".join(problems)


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


def test_every_room_is_placed_in_the_map_and_the_design_doc() -> None:
    """A new folder gets a row here and in docs/DESIGN.md's package map before it gets code."""
    design = (REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(MAY_IMPORT) | ENTRY_ROOMS, (
        f"rooms missing from MAY_IMPORT: {folders - set(MAY_IMPORT)}"
    )
    unnamed = sorted(name for name in folders if f"`{name}/`" not in design)
    assert not unnamed, f"docs/DESIGN.md's package map lacks {unnamed}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from dflash_mp.runtime.roles import run_drafter", "runtime"),
        ("def f():\n    from dflash_mp.run import checkpoint", "run"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash_mp import train", "entry"),
    ],
)
def test_lazy_and_type_only_imports_count(tmp_path: Path, source: str, expected: str) -> None:
    path = tmp_path / "module.py"
    path.write_text(source + "\n")
    assert [_room(name) for _, name in _imports(path)] == [expected]
