"""The benchmark table: multi-turn decoding, sampling settings, thinking modes, the command line,
`make eval-benchmarks`, and eval.benchmarks logged during training."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_mp.data import ChatRenderer
from dflash_mp.data.benchmark_sets import Conversation, resolve_benchmarks
from dflash_mp.eval import main
from dflash_mp.evaluation.benchmark_table import (
    Sampling,
    decode_benchmark,
    format_benchmark_table,
    has_thinking_switch,
    plan_table,
    run_table,
    serving_sampling,
    thinking_modes,
)
from dflash_mp.evaluation.evaluator import AcceptanceEvaluator
from dflash_mp.evaluation.prompts import EvalError
from dflash_mp.export.hf import export_drafter
from dflash_mp.training.trainer import build_drafter
from tests.conftest import REPO, job_env, read_metrics, run_train
from tests.drafters import embedded_config, embedded_target
from tests.test_benchmark_sets import RECORDS, write_jsonl, write_parquet

QWEN3_TEMPLATE = REPO / "tests" / "fixtures" / "qwen3_chat_template.jinja"


@pytest.fixture(scope="module")
def tiny() -> dict:
    """The embedded target and an untrained drafter for it (decoding works; tau stays near 1)."""
    cfg = embedded_config()
    target, tokenizer = embedded_target(cfg)
    return {"cfg": cfg, "target": target, "tokenizer": tokenizer, "drafter": build_drafter(cfg).eval()}


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two benchmarks of two records each: GSM8K as JSONL, MT-Bench (two turns each) as Parquet."""
    root = tmp_path_factory.mktemp("sets")
    gsm8k = [
        {**RECORDS["gsm8k"], "question": q} for q in ("How many ducks are there?", "What is two plus two?")
    ]
    mtbench = [
        {"question_id": 81, "category": "writing", "turns": ["Write a short poem.", "Now make it shorter."]},
        {"question_id": 82, "category": "math", "turns": ["Add three and four.", "Now double it."]},
    ]
    return {
        "gsm8k": write_jsonl(root / "gsm8k.jsonl", gsm8k),
        "mtbench": write_parquet(root / "mt.parquet", mtbench),
    }


def test_a_second_turn_follows_the_answer_to_the_first(tiny: dict) -> None:
    renderer = ChatRenderer(tiny["tokenizer"])
    conversation = Conversation("mt.jsonl:1", ["Write a short poem.", "Now make it shorter."])
    result = decode_benchmark(
        tiny["drafter"], tiny["target"], renderer, [conversation], 12, Sampling(0.0), per_prompt=True
    )
    first, second = result["prompts"]
    assert (first["source"], second["source"]) == ("mt.jsonl:1 turn 1", "mt.jsonl:1 turn 2")
    answer = tiny["tokenizer"].decode(first["new_tokens"], skip_special_tokens=True)
    messages = [
        {"role": "user", "content": conversation.user_turns[0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": conversation.user_turns[1]},
    ]
    expected = tiny["tokenizer"](renderer.apply(messages, generation_prompt=True), add_special_tokens=False)
    assert (
        second["prompt_tokens"] == len(expected["input_ids"]) > first["prompt_tokens"] + len(answer.split())
    )
    assert result["num_prompts"] == 2 and result["matches_autoregressive"] is True


def test_sampling_settings_come_from_the_generation_config(tmp_path: Path) -> None:
    assert serving_sampling(tmp_path, 0.0) == Sampling(0.0)
    none = serving_sampling(tmp_path, 1.0)
    assert (none.top_k, none.top_p) == (0, 1.0) and "no top_k/top_p" in none.source
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05})
    )
    qwen = serving_sampling(tmp_path, 1.0)
    assert (qwen.temperature, qwen.top_k, qwen.top_p) == (1.0, 20, 0.95)
    assert "top_k 20, top_p 0.95 from" in qwen.source and "not applied here: min_p 0.05" in qwen.source
    given = serving_sampling(tmp_path, 1.0, top_k=0, top_p=0.8)
    assert (given.top_k, given.top_p) == (0, 0.8)


def test_thinking_modes_follow_the_templates_switch(tiny: dict) -> None:
    plain = ChatRenderer(tiny["tokenizer"])
    qwen3 = ChatRenderer(tiny["tokenizer"], QWEN3_TEMPLATE.read_text(), {"enable_thinking": False})
    assert not has_thinking_switch(plain) and has_thinking_switch(qwen3)
    assert thinking_modes(plain, "both") == [None]
    assert thinking_modes(qwen3, "both") == [True, False] and thinking_modes(qwen3, "off") == [False]
    with pytest.raises(EvalError, match="no enable_thinking switch"):
        thinking_modes(plain, "on")


def test_a_template_with_the_switch_gets_a_row_per_thinking_mode(tiny: dict, sets: dict) -> None:
    renderer = ChatRenderer(tiny["tokenizer"], QWEN3_TEMPLATE.read_text())
    benchmarks = resolve_benchmarks([str(sets["gsm8k"])])
    target_path = tiny["cfg"].model.target_path
    plan = plan_table(renderer, benchmarks, target_path, limit=1, max_new_tokens=4, temperatures=[0.0])
    table = run_table(plan, tiny["drafter"], tiny["target"])
    assert [(r["benchmark"], r["thinking"]) for r in table["rows"]] == [("gsm8k", True), ("gsm8k", False)]
    printed = format_benchmark_table(table).splitlines()
    assert [line.split()[2] for line in printed if line.startswith("gsm8k")] == ["on", "off"]
    with pytest.raises(EvalError, match=r"do not fit the target's context of 512 .*gsm8k.jsonl:1"):
        plan_table(renderer, benchmarks, target_path, limit=1, max_new_tokens=500)


def test_command_line_prints_and_writes_the_table(
    tiny: dict, sets: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # `python -m dflash_mp.eval` is `sys.exit(main())`: its main, in process (a fresh interpreter
    # would only add torch's and transformers' imports).
    export = export_drafter(tiny["drafter"], tmp_path / "export")
    out = tmp_path / "table.json"
    argv = [
        str(export),
        "--benchmarks", f"gsm8k={sets['gsm8k']}", str(sets["mtbench"]),
        "--limit", "2", "--max-new-tokens", "6", "--top-k", "5", "--out", str(out), "--device", "cpu",
    ]  # fmt: skip
    code = main(argv)
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-3000:]
    table = json.loads(out.read_text())
    assert table["thinking"] == "no enable_thinking switch"
    assert table["sampling"]["1"]["top_k"] == 5 and table["sampling"]["0"]["source"] == "greedy"
    cells = [(r["benchmark"], r["temperature"], r["num_prompts"], r["top_k"]) for r in table["rows"]]
    assert cells == [("gsm8k", 0, 2, 0), ("gsm8k", 1, 2, 5), ("mtbench", 0, 4, 0), ("mtbench", 1, 4, 5)]
    for row in table["rows"]:
        counts = row["acceptance_length_counts"]
        rounds = sum(counts)
        # The prefill makes each turn's first token; each verify forward its acceptance length.
        assert row["num_prompts"] + sum(n * c for n, c in enumerate(counts, start=1)) == row["new_tokens"]
        assert row["tau"] == pytest.approx((row["new_tokens"] - row["num_prompts"]) / rounds)
        assert row["tokens_per_target_forward"] == pytest.approx(
            row["new_tokens"] / (rounds + row["num_prompts"])
        )
        assert row["speedup"] > 0 and len(row["acceptance_rate"]) == table["block_size"] - 1
        assert row.get("matches_autoregressive", True) is True
        # An export without its run: data.max_length unknown, powers of two from 256 up to the
        # longest prompt. These prompts are short: one bucket, whose numbers are the row's exactly.
        assert row["training_max_length"] is None and row["length_bucket_edges"] == [256]
        (bucket,) = row["length_buckets"]
        assert (bucket["label"], bucket["num_prompts"], bucket["beyond_max_length"]) == (
            "<= 256",
            row["num_prompts"],
            False,
        )
        assert bucket["tau"] == row["tau"]
        assert bucket["tokens_per_target_forward"] == row["tokens_per_target_forward"]
    lines = stdout.splitlines()
    assert any(line.startswith("benchmark") and "tau" in line and "speedup" in line for line in lines)
    assert sum(line.startswith(("gsm8k ", "mtbench ")) for line in lines) == 4
    by_length = lines[lines.index("tau by prompt length (data.max_length unknown)") + 2 :]
    assert [line.split()[:5] for line in by_length[:4]] == [
        ["gsm8k", "0", "-", "<=", "256"],
        ["gsm8k", "1", "-", "<=", "256"],
        ["mtbench", "0", "-", "<=", "256"],
        ["mtbench", "1", "-", "<=", "256"],
    ]


def test_command_line_refuses_a_bad_benchmark_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    unknown = write_jsonl(tmp_path / "mystery.jsonl", [{"query": "hi"}])
    # Through the module's own entry line (`python -m dflash_mp.eval`), as a user runs it.
    command = [
        sys.executable,
        "-m",
        "dflash_mp.eval",
        str(tmp_path / "no-such-run"),
        "--benchmarks",
        str(unknown),
    ]
    proc = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mystery.jsonl: record 1 has the fields ['query']" in proc.stderr
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--temperature", "0", "1"])  # two columns need --benchmarks
    assert "--temperature takes one value without --benchmarks" in capsys.readouterr().err


def test_make_eval_benchmarks_expands_to_the_command() -> None:
    args = [
        "make",
        "-n",
        "eval-benchmarks",
        "RUN_DIR=runs/x",
        "BENCHMARKS=gsm8k=g.jsonl mt.parquet",
        "ARGS=--limit 2",
    ]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True)
    assert (
        ".venv/bin/python -m dflash_mp.eval runs/x --benchmarks gsm8k=g.jsonl mt.parquet --limit 2"
        in proc.stdout
    )
    empty = subprocess.run(
        ["make", "-n", "eval-benchmarks", "RUN_DIR=runs/x"], cwd=REPO, capture_output=True, text=True
    )
    assert empty.returncode != 0 and "BENCHMARKS is empty" in empty.stderr


# ----------------------------------------------------------------------------------------- training


def test_the_training_evaluator_measures_each_benchmark(tiny: dict, sets: dict, tmp_path: Path) -> None:
    cfg = embedded_config(
        "eval.num_prompts=2",
        "eval.max_new_tokens=6",
        f"+eval.benchmarks.gsm8k={sets['gsm8k']}",
        f"+eval.benchmarks.mt={sets['mtbench']}",
    )
    evaluator = AcceptanceEvaluator(cfg, torch.device("cpu"))
    assert sorted(evaluator.benchmarks.conversations) == ["gsm8k", "mt"]
    measured = evaluator.measure(tiny["drafter"])
    assert sorted(measured) == ["tau", "tau/gsm8k", "tau/mt"] and all(v >= 1 for v in measured.values())
    # The console's (and job.log's) line: every tau and the held-out prompts' acceptance by position.
    from dflash_mp.runtime.job import eval_line

    rates = evaluator.acceptance_rate
    assert len(rates) == cfg.model.block_size - 1
    line = eval_line(7, measured, rates)
    assert line.startswith(f"eval at step 7: tau {measured['tau']:.3f} on the held-out prompts, tau/gsm8k ")
    assert line.endswith("; acceptance by block position " + " ".join(f"{r:.2f}" for r in rates))
    # A target of the user's own (here a copy) with benchmarks and no data.eval_files: tau/<name> only.
    own_target = shutil.copytree(tiny["cfg"].model.target_path, tmp_path / "target")
    benchmarks_only = embedded_config(
        f"model.target_path={own_target}",
        "data.eval_files=[]",
        "eval.num_prompts=1",
        "eval.max_new_tokens=6",
        f"+eval.benchmarks.gsm8k={sets['gsm8k']}",
    )
    assert list(AcceptanceEvaluator(benchmarks_only, torch.device("cpu")).measure(tiny["drafter"])) == [
        "tau/gsm8k"
    ]


@pytest.mark.slow
def test_training_logs_tau_per_benchmark(sets: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_train(
        run,
        "train.max_steps=2",
        "topology.targets=1",
        "topology.drafters=1",
        "train.micro_batch_size=2",
        "train.export=false",
        "eval.every=2",
        "eval.num_prompts=1",
        "eval.max_new_tokens=6",
        f"+eval.benchmarks.gsm8k={sets['gsm8k']}",
        f"+eval.benchmarks.mt={sets['mtbench']}",
    )
    last = read_metrics(run)[-1]
    assert last["step"] == 2 and {"tau", "tau/gsm8k", "tau/mt"} <= set(last)
    assert (
        f"eval at step 2: tau {last['tau']:.3f} on the held-out prompts"
        in (run / "logs" / "job.log").read_text()
    )
    assert last["tau/gsm8k"] >= 1 and last["tau/mt"] >= 1
