"""Benchmark files as their publishers distribute them: formats, user turns, refusals, preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_mp.config.schema import ConfigError, compose_config
from dflash_mp.config.validation import validate
from dflash_mp.data.benchmark_sets import (
    HUMANEVAL_REQUEST,
    REASON,
    BenchmarkError,
    load_conversations,
    resolve_benchmark,
    resolve_benchmarks,
    split_spec,
)
from dflash_mp.launch import doctor
from tests.test_config import QWEN3_8B_SHAPE

# One record of each set, with the fields its publisher's file has (values shortened).
RECORDS = {
    "gsm8k": {"question": "Janet has 3 ducks. How many?", "answer": "3 ducks\n#### 3"},
    "math500": {
        "problem": "Compute $1+1$.",
        "solution": "It is $2$.",
        "answer": "2",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/1.json",
    },
    "aime": {"ID": "2024-I-1", "Problem": "Find the remainder.", "Solution": "...", "Answer": 204},
    "humaneval": {
        "task_id": "HumanEval/0",
        "prompt": "def add(a, b):\n    ",
        "canonical_solution": "return a + b\n",
        "test": "def check(c): assert c(1, 2) == 3",
        "entry_point": "add",
    },
    "mbpp": {
        "task_id": 2,
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b): return a + b",
        "test_list": ["assert add(1, 2) == 3"],
    },
    "livecodebench": {
        "question_title": "A",
        "question_content": "  Read N and print N+1.\n",
        "platform": "atcoder",
        "question_id": "abc001_a",
        "starter_code": "",
    },
    "mtbench": {
        "question_id": 81,
        "category": "writing",
        "turns": ["Write a travel blog post.", "Rewrite it starting every sentence with A."],
    },
    "alpaca": {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
}

USER_TURNS = {
    "gsm8k": ["Janet has 3 ducks. How many?" + REASON],
    "math500": ["Compute $1+1$." + REASON],
    "aime": ["Find the remainder." + REASON],
    "humaneval": [f"{HUMANEVAL_REQUEST}\n```python\ndef add(a, b):\n    \n```"],
    "mbpp": ["Write a function to add two numbers."],
    "livecodebench": ["Read N and print N+1."],
    "mtbench": ["Write a travel blog post.", "Rewrite it starting every sentence with A."],
    "alpaca": ["Translate to French.\n\nGood morning"],
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_every_format_is_recognised_from_its_fields_and_gives_its_turns(tmp_path: Path, suffix: str) -> None:
    write = write_jsonl if suffix == "jsonl" else write_parquet
    for name, record in RECORDS.items():
        path = write(tmp_path / f"set-{name}.{suffix}", [record, record])
        benchmark = resolve_benchmark(str(path))
        assert (benchmark.name, benchmark.format.name) == (name, name), path
        conversations = load_conversations(benchmark)
        assert [c.user_turns for c in conversations] == [USER_TURNS[name]] * 2, name
        assert conversations[1].source == f"{path}:2"


def test_mt_bench_keeps_both_turns_in_order_and_limit_counts_records(tmp_path: Path) -> None:
    records = [
        {**RECORDS["mtbench"], "question_id": 81 + i, "turns": [f"q{i}", f"then {i}"]} for i in range(5)
    ]
    path = write_parquet(tmp_path / "question.parquet", records)
    conversations = load_conversations(resolve_benchmark(f"mt-bench={path}"), limit=3)
    assert [c.user_turns for c in conversations] == [["q0", "then 0"], ["q1", "then 1"], ["q2", "then 2"]]
    bad = write_jsonl(tmp_path / "bad.jsonl", [RECORDS["mtbench"], {**RECORDS["mtbench"], "turns": "one"}])
    with pytest.raises(BenchmarkError, match=r"bad.jsonl:2: 'turns' must be a list"):
        load_conversations(resolve_benchmark(str(bad)))


def test_an_unknown_format_is_refused_naming_the_file_and_the_expected_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mystery.jsonl", [{"query": "hi", "reply": "hello"}])
    with pytest.raises(BenchmarkError) as caught:
        resolve_benchmark(str(path))
    message = str(caught.value)
    assert str(path) in message and "['query', 'reply']" in message
    for expected in (
        "GSM8K (question, answer)",
        "MT-Bench (question_id|category, turns)",
        "question_content",
    ):
        assert expected in message
    # A known name with a file in another format: the name's fields are what is expected.
    mbpp = write_parquet(tmp_path / "mbpp.parquet", [RECORDS["mbpp"]])
    with pytest.raises(BenchmarkError, match=r"mbpp.parquet: gsm8k expects GSM8K \(question, answer\)"):
        resolve_benchmark(f"gsm8k={mbpp}")
    # A later record without the fields is named by its line.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [RECORDS["gsm8k"], {"question": "no answer"}])
    with pytest.raises(BenchmarkError, match=r"mixed.jsonl:2: expected GSM8K"):
        load_conversations(resolve_benchmark(str(mixed)))


def test_missing_empty_and_compressed_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkError, match=r"gsm8k.jsonl: file does not exist"):
        resolve_benchmark(f"gsm8k={tmp_path / 'gsm8k.jsonl'}")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(BenchmarkError, match=r"empty.jsonl: no records"):
        resolve_benchmark(str(tmp_path / "empty.jsonl"))
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(b"\x1f\x8b\x08")
    with pytest.raises(BenchmarkError, match=r"decompress it first"):
        resolve_benchmark(str(tmp_path / "HumanEval.jsonl.gz"))
    (tmp_path / "gsm8k.csv").write_text("question,answer\nWhat is 1+1?,2\n")
    with pytest.raises(BenchmarkError) as caught:
        resolve_benchmark(str(tmp_path / "gsm8k.csv"))
    message = str(caught.value)
    assert "gsm8k.csv: unsupported format (.csv)" in message and "malformed JSON" not in message
    assert "JSONL (.jsonl), Parquet (.parquet), Arrow (.arrow)" in message
    # json's own "... starting at" is not followed by a second "at".
    (tmp_path / "cut.jsonl").write_text('{"question": "unterminated')
    with pytest.raises(
        BenchmarkError, match=r"cut.jsonl:1: malformed JSON \(Unterminated string starting at column 14\)"
    ):
        resolve_benchmark(str(tmp_path / "cut.jsonl"))


def test_names_paths_and_labels(tmp_path: Path) -> None:
    assert split_spec("gsm8k=/data/test.jsonl") == ("gsm8k", "/data/test.jsonl")
    assert split_spec("/data/test.jsonl") == (None, "/data/test.jsonl")
    odd = write_jsonl(tmp_path / "a=b.jsonl", [RECORDS["gsm8k"]])
    assert split_spec(str(odd)) == (None, str(odd))
    # A custom name keeps the format the fields say; a set inferred twice is told apart by file.
    first = write_jsonl(tmp_path / "aime24.jsonl", [RECORDS["aime"]])
    second = write_jsonl(tmp_path / "aime25.jsonl", [RECORDS["aime"]])
    custom = write_jsonl(tmp_path / "grade.jsonl", [RECORDS["gsm8k"]])
    labels = [
        (b.name, b.format.name) for b in resolve_benchmarks([str(first), str(second), f"easy={custom}"])
    ]
    assert labels == [("aime-aime24", "aime"), ("aime-aime25", "aime"), ("easy", "gsm8k")]


# ----------------------------------------------------------------------------------------- config


def test_config_refuses_missing_and_unknown_benchmarks_before_any_worker(tmp_path: Path) -> None:
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"query": "hi"}])
    good = write_jsonl(tmp_path / "gsm8k.jsonl", [RECORDS["gsm8k"]])
    overrides = [
        f"+eval.benchmarks.gsm8k={good}",
        f"+eval.benchmarks.mt={tmp_path / 'missing.jsonl'}",
        f"+eval.benchmarks.other={unknown}",
    ]
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(overrides))
    message = str(caught.value)
    assert "eval.benchmarks.mt=" in message and "missing.jsonl: file does not exist" in message
    assert "eval.benchmarks.other=" in message and "no benchmark format known here" in message
    assert "eval.benchmarks.gsm8k" not in message
    with pytest.raises(ConfigError, match=r"eval.benchmarks=.* but eval.every=0"):
        validate(compose_config(["eval.every=0", f"+eval.benchmarks.gsm8k={good}"]))
    # The launcher's preflight reports it as a config problem (it calls validate), so no worker starts.
    checks = doctor.preflight(compose_config(["train.device=cpu", *overrides[1:]]), tmp_path / "run")
    failed = " ".join(c.message for c in doctor.failed(checks) if c.name == "config")
    assert "missing.jsonl: file does not exist" in failed and "unknown.jsonl" in failed


def test_benchmarks_stand_in_for_held_out_prompts_of_a_real_target(tmp_path: Path) -> None:
    target = tmp_path / "Qwen3-8B"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_8B_SHAPE))
    data = write_jsonl(tmp_path / "train.jsonl", [{}])
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [RECORDS["gsm8k"]])
    common = ["experiment=paper", f"model.target_path={target}", f"data.train_files=[{data}]"]
    with pytest.raises(ConfigError, match=r"data.eval_files is empty: .* or \+eval.benchmarks.NAME=FILE"):
        validate(compose_config(common), world_size=8)
    validate(compose_config([*common, f"+eval.benchmarks.gsm8k={gsm8k}"]), world_size=8)


def test_preflight_reads_benchmark_prompts_against_the_context(tmp_path: Path) -> None:
    long_question = {"question": " ".join(["apples"] * 600), "answer": "#### 1"}
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [RECORDS["gsm8k"], long_question])
    base = ["train.device=cpu", "eval.every=5", "eval.num_prompts=2", f"+eval.benchmarks.gsm8k={path}"]
    checks = doctor.preflight(compose_config(base), tmp_path / "run")
    failed = {c.name: c.message for c in doctor.failed(checks)}
    assert set(failed) == {"eval"}, failed
    assert "gsm8k.jsonl:2" in failed["eval"] and "max_position_embeddings=512" in failed["eval"]
    fits = doctor.preflight(compose_config([*base[:2], "eval.num_prompts=1", *base[3:]]), tmp_path / "run")
    assert not doctor.failed(fits)
