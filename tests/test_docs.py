"""The docs point at things that exist: files, `make` targets and config keys."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_mp.config.schema import compose_config
from tests.conftest import REPO

DOCS = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")])
CONFIG_GROUPS = ("data", "eval", "logger", "model", "optim", "topology", "train", "watchdog")
# Names that read like `group.key` but are files (model.safetensors) or Python objects.
FILE_SUFFIXES = ("safetensors", "json", "jsonl", "yaml", "py", "md", "txt", "log", "parquet", "arrow")
# Roots of the repository's own paths; a cited path under one of them must exist.
REPO_ROOTS = ("dflash_mp/", "bench/", "tests/", "conf/", "docs/", "slurm/", ".ci/")
# Where scripts name the package's modules (`python -m dflash_mp.X`, Hydra's `_target_:`).
SCRIPTS = sorted([REPO / "Makefile", *(REPO / "slurm").glob("*.sbatch"), *(REPO / "conf").rglob("*.yaml")])


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code_spans(text: str) -> list[str]:
    """Inline code and fenced code lines: where docs name keys, files and commands."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return inline + [line for block in fenced for line in block.splitlines()]


def _config_keys(spans: list[str]) -> set[str]:
    pattern = rf"(?<![\w./-])\+?((?:{'|'.join(CONFIG_GROUPS)})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)"
    keys = set()
    for span in spans:
        for key in re.findall(pattern, span):
            if key.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                keys.add(key)
    return keys


def _brace_expanded(word: str) -> list[str]:
    """`a-{b,c}.json` -> [a-b.json, a-c.json], as the shell expands the docs' commands."""
    match = re.search(r"\{([^{}]*)\}", word)
    if not match:
        return [word]
    head, tail = word[: match.start()], word[match.end() :]
    return [out for part in match.group(1).split(",") for out in _brace_expanded(head + part + tail)]


def _cited_paths(text: str) -> set[str]:
    links = re.findall(r"\]\(([^)#\s]+)", text)
    # What a command writes (--out PATH) need not exist yet.
    spans = [re.sub(r"--out[ =]\S+", "", span) for span in _code_spans(text)]
    words = [word for span in spans for word in re.split(r"[\s=:()\[\]'\"]+", span)]
    return {
        path.rstrip(".,")
        for candidate in links + words
        for path in _brace_expanded(candidate)
        if path.startswith(REPO_ROOTS) and "*" not in path and "<" not in path
    }


def _module_names(text: str) -> set[str]:
    """`dflash_mp.x.y[.Name]`: a module of the package, or an object in one."""
    return set(re.findall(r"(?<![\w/.-])(dflash_mp(?:\.[A-Za-z_]\w*)+)(?![\w/-])", text))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):  # the longest prefix that is a module, then attributes
        module = ".".join(parts[:end])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a prefix that is a module, not a package, has no submodules
            continue
        value = importlib.import_module(module)
        for attribute in parts[end:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


@pytest.mark.parametrize("source", DOCS + SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_the_docs_and_scripts_name_exists(source: Path) -> None:
    text = _text(source)
    names = _module_names("\n".join(_code_spans(text)) if source.suffix == ".md" else text)
    missing = sorted(name for name in names if not _resolves(name))
    assert not missing, f"{source.name} names modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_the_docs_name_is_in_the_schema(doc: Path) -> None:
    config = OmegaConf.to_container(compose_config([]), resolve=False)
    missing = []
    for key in sorted(_config_keys(_code_spans(_text(doc)))):
        node = config
        for part in key.split("."):
            if node == {}:  # a free-form mapping (data.chat_template_kwargs): any key goes
                break
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    assert not missing, f"{doc.name} names config keys the schema does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_file_the_docs_cite_exists(doc: Path) -> None:
    missing = sorted(path for path in _cited_paths(_text(doc)) if not (REPO / path.split("::")[0]).exists())
    assert not missing, f"{doc.name} cites files that do not exist: {missing}"


def test_every_make_target_the_readme_names_exists() -> None:
    makefile = _text(REPO / "Makefile")
    targets = set(re.findall(r"^([a-zA-Z_-]+):", makefile, flags=re.M))
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"(?<![\w-])make ([a-z][a-z_-]*)", "\n".join(_code_spans(_text(doc)))))
    assert named, "the README names no make target"
    assert named <= targets, f"docs name make targets the Makefile lacks: {sorted(named - targets)}"


def test_every_benchmark_result_is_cited_by_a_doc() -> None:
    """A JSON in bench/results that no page names is a number nobody can find (or a stale one)."""
    text = "\n".join(page.read_text() for page in DOCS)
    uncited = [p.name for p in sorted((REPO / "bench" / "results").iterdir()) if p.name not in text]
    assert not uncited, f"cite these in BENCHMARKS.md (or delete them if superseded): {uncited}"
