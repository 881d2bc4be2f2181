"""Standard benchmark prompt sets, in the files their publishers distribute, as user turns to decode.

A benchmark is given as NAME=PATH or as PATH alone: a known NAME picks the format, any other
name (or none) lets the fields of the file's first record decide. The formats, the fields that
identify each, and the user turn built from a record:

    gsm8k          question, answer                          question + REASON
    math500        problem, solution, answer,
                   subject|level|unique_id                   problem + REASON
    aime           problem|Problem|question, answer|Answer   problem + REASON
    humaneval      task_id, prompt, canonical_solution       "Write a solution ..." around the prompt
    mbpp           task_id, text|prompt, test_list|code      the description as it is
    livecodebench  question_content                          question_content, stripped
    mtbench        question_id|category, turns               each turn, one after another
    alpaca         instruction, output (input)               instruction, and the input below it

REASON is "Please reason step by step, and put your final answer within \\boxed{}." on a new line.
The wording is the DFlash authors' evaluation (github.com/z-lab/dflash, dflash/benchmark.py:
GSM8K, MATH-500, HumanEval, MBPP, MT-Bench); AIME's suffix and LiveCodeBench's bare question are
SpecForge's (github.com/sgl-project/SpecForge, benchmarks/benchmarker/aime.py, livecodebench.py).
Files are JSONL, Parquet or anything else `dflash_mp.data.open_records` reads; no network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BenchmarkError(ValueError):
    """A benchmark file that cannot be used; the message names the file and what was expected."""


REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_REQUEST = "Write a solution to the following problem and make sure that it passes the tests:"


def _first(record: dict[str, Any], names: Sequence[str]) -> Any:
    return next(record[name] for name in names if name in record)


def _alpaca_turn(record: dict[str, Any]) -> list[str]:
    extra = str(record.get("input") or "").strip()
    return [record["instruction"] + (f"\n\n{extra}" if extra else "")]


def _mtbench_turns(record: dict[str, Any]) -> list[str]:
    turns = record["turns"]
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
        raise ValueError("'turns' must be a list of non-empty strings (MT-Bench has two)")
    return list(turns)


@dataclass(frozen=True)
class BenchmarkFormat:
    """A set's record format: the fields that identify it and how its records become user turns."""

    name: str
    title: str
    # Every group must be present (one field of it) for a record to be this format.
    fields: tuple[tuple[str, ...], ...]
    # The user turns of a record, one decoding each, the later ones after the model's answers.
    user_turns: Callable[[dict[str, Any]], list[str]]

    def describe(self) -> str:
        return f"{self.title} ({', '.join('|'.join(group) for group in self.fields)})"

    def matches(self, record: dict[str, Any]) -> bool:
        return all(any(name in record for name in group) for group in self.fields)


# In the order inference tries them: MATH-500 before AIME (AIME files may carry a solution too),
# GSM8K before AIME (some AIME files say question, not problem: name those aime=PATH), HumanEval
# before MBPP (both have task_id and may have prompt).
FORMATS: tuple[BenchmarkFormat, ...] = (
    BenchmarkFormat("mtbench", "MT-Bench", (("question_id", "category"), ("turns",)), _mtbench_turns),
    BenchmarkFormat(
        "livecodebench",
        "LiveCodeBench",
        (("question_content",),),
        lambda r: [str(r["question_content"]).strip()],
    ),
    BenchmarkFormat(
        "humaneval",
        "HumanEval",
        (("task_id",), ("prompt",), ("canonical_solution",)),
        lambda r: [f"{HUMANEVAL_REQUEST}\n```python\n{r['prompt']}\n```"],
    ),
    BenchmarkFormat(
        "mbpp",
        "MBPP",
        (("task_id",), ("text", "prompt"), ("test_list", "code")),
        lambda r: [str(_first(r, ("prompt", "text")))],
    ),
    BenchmarkFormat(
        "math500",
        "MATH-500",
        (("problem",), ("solution",), ("answer",), ("subject", "level", "unique_id")),
        lambda r: [f"{r['problem']}{REASON}"],
    ),
    BenchmarkFormat("gsm8k", "GSM8K", (("question",), ("answer",)), lambda r: [f"{r['question']}{REASON}"]),
    BenchmarkFormat(
        "aime",
        "AIME",
        (("problem", "Problem", "question"), ("answer", "Answer")),
        lambda r: [f"{_first(r, ('problem', 'Problem', 'question'))}{REASON}"],
    ),
    BenchmarkFormat("alpaca", "Alpaca", (("instruction",), ("output",)), _alpaca_turn),
)
BY_NAME = {f.name: f for f in FORMATS}
# Other spellings of the names, as the sets' own pages and other evaluations write them.
ALIASES = {
    "math-500": "math500",
    "math_500": "math500",
    "aime24": "aime",
    "aime25": "aime",
    "aime2024": "aime",
    "aime2025": "aime",
    "mt-bench": "mtbench",
    "mt_bench": "mtbench",
    "lcb": "livecodebench",
    "human-eval": "humaneval",
    "openai_humaneval": "humaneval",
}


def known_format(name: str) -> BenchmarkFormat | None:
    key = name.lower()
    return BY_NAME.get(ALIASES.get(key, key))


@dataclass(frozen=True)
class Benchmark:
    """One benchmark of a table: its label, its file and the format its records are read in."""

    name: str
    path: str
    format: BenchmarkFormat


@dataclass
class Conversation:
    """One record's user turns and where it came from (file:line or file:row)."""

    source: str
    user_turns: list[str]


def split_spec(spec: str) -> tuple[str | None, str]:
    """(NAME, PATH) of "NAME=PATH", (None, PATH) of a bare PATH (a path may hold '=' if it exists)."""
    name, sep, path = spec.partition("=")
    if not sep or os.path.exists(spec) or not name or "/" in name:
        return None, spec
    return name, path


def _expected() -> str:
    return "; ".join(f.describe() for f in FORMATS)


def _record(text: str, source: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        from dflash_mp.data.records import malformed_json

        raise BenchmarkError(f"{source}: {malformed_json(e)}") from None
    if not isinstance(record, dict):
        raise BenchmarkError(f"{source}: a record must be a JSON object, got {type(record).__name__}")
    return record


# Suffixes read as JSONL; Parquet, Arrow and save_to_disk directories are told apart by theirs.
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
SUPPORTED = "JSONL (.jsonl), Parquet (.parquet), Arrow (.arrow) or a datasets save_to_disk directory"


def _unsupported(path: str) -> str | None:
    """Why `path` is in no format read here (a CSV or spreadsheet export), or None."""
    from dflash_mp.data.sources import input_kind

    suffix = Path(path).suffix.lower()
    if input_kind(path) != "jsonl" or not suffix or suffix in JSONL_SUFFIXES or suffix == ".gz":
        return None
    return f"{path}: unsupported format ({suffix}); give the set as {SUPPORTED}"


def _open(path: str) -> Any:
    from dflash_mp.data import DataError, EmptyData, open_records
    from dflash_mp.data.sources import input_problem

    if _unsupported(path) is not None:
        raise BenchmarkError(_unsupported(path))
    if path.startswith("hf:"):
        raise BenchmarkError(
            f"{path}: give a local copy of the set (a JSONL or Parquet file), not a hub name"
        )
    if path.endswith(".gz"):
        raise BenchmarkError(f"{path}: compressed; decompress it first (gunzip -k {path})")
    problem = input_problem(path)
    if problem is not None:
        raise BenchmarkError(f"{path}: {problem}")
    try:
        return open_records([path])
    except EmptyData:
        raise BenchmarkError(f"{path}: no records (the file is empty or blank)") from None
    except DataError as e:
        raise BenchmarkError(str(e)) from None


def _first_record(path: str) -> tuple[int, str]:
    """(line or row, text) of a file's first record; a JSONL file is read only up to it (the
    preflight of every rank reads it, and LiveCodeBench's files are large)."""
    from dflash_mp.data.sources import input_kind

    if input_kind(path) != "jsonl" or not os.path.isfile(path) or path.endswith(".gz") or _unsupported(path):
        _, row, text = _open(path).read(0)  # the checks and messages of a full read
        return row, text
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.removeprefix(b"\xef\xbb\xbf")
            if line.strip():
                return line_number, line.decode("utf-8", errors="replace")
    raise BenchmarkError(f"{path}: no records (the file is empty or blank)")


def resolve_benchmark(spec: str, name: str | None = None) -> Benchmark:
    """The benchmark of "NAME=PATH" or PATH (or PATH with `name` given apart, as in the config):
    the file must exist and its first record must be in the named format, or, for an unknown or
    no name, in one of the known formats. BenchmarkError names the file and the expected fields."""
    if name is None:
        name, path = split_spec(spec)
    else:
        path = spec
    row, text = _first_record(path)
    record = _record(text, f"{path}:{row}")
    wanted = known_format(name) if name else None
    if wanted is not None:
        if not wanted.matches(record):
            raise BenchmarkError(
                f"{path}: {name} expects {wanted.describe()} in every record, but record {row} has the "
                f"fields {sorted(record)}. Give the set's file as its publisher distributes it, or name "
                "it after the format it is in"
            )
        return Benchmark(name, path, wanted)
    found = next((f for f in FORMATS if f.matches(record)), None)
    if found is None:
        raise BenchmarkError(
            f"{path}: record {row} has the fields {sorted(record)}, which is no benchmark format known "
            f"here. Expected one of: {_expected()}"
        )
    return Benchmark(name or found.name, path, found)


def benchmark_problem(spec: str, name: str | None = None) -> str | None:
    """Why a benchmark cannot be read (missing file, unknown format), or None; for the preflight."""
    try:
        resolve_benchmark(spec, name)
    except BenchmarkError as e:
        return str(e)
    return None


def resolve_benchmarks(specs: Sequence[str]) -> list[Benchmark]:
    """Every benchmark of the command line; a label inferred twice gets its file's name appended."""
    benchmarks = [resolve_benchmark(spec) for spec in specs]
    labels = [b.name for b in benchmarks]
    return [
        Benchmark(f"{b.name}-{Path(b.path).stem}", b.path, b.format) if labels.count(b.name) > 1 else b
        for b in benchmarks
    ]


def load_conversations(benchmark: Benchmark, limit: int | None = None) -> list[Conversation]:
    """The first `limit` records (all: None) of a benchmark as user turns."""
    records = _open(benchmark.path)
    conversations = []
    for i in range(len(records) if limit is None else min(limit, len(records))):
        where, row, text = records.read(i)
        source = f"{where}:{row}"
        record = _record(text, source)
        if not benchmark.format.matches(record):
            raise BenchmarkError(
                f"{source}: expected {benchmark.format.describe()}, the record has the fields {sorted(record)}"
            )
        try:
            turns = benchmark.format.user_turns(record)
        except (ValueError, TypeError) as e:
            raise BenchmarkError(f"{source}: {e}") from None
        conversations.append(Conversation(source, turns))
    return conversations
