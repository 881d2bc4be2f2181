"""Inputs the preflight refuses on every entry point (the launcher, `doctor`, plain torchrun), with
exit 2 and one line naming the cause: a target whose config.json is not a model's config, and data
whose answers give the trainer nothing to score."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mp.embedded import embedded_path, target_dir
from dflash_mp.launch.__main__ import main as launch_main
from dflash_mp.launch.outcome import EXIT_PREFLIGHT
from tests.conftest import REPO, job_env

# config.json text from the tiny target's, and what the refusal says of it.
BROKEN_CONFIGS = {
    "truncated": (lambda text: text[:200], "not valid JSON (Unterminated string"),
    "empty": (lambda text: "{}", "lacks num_hidden_layers, hidden_size, num_attention_heads, vocab_size"),
    "list": (lambda text: "[1, 2]", "holds a JSON list, not an object of model fields"),
    "no hidden_size": (
        lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "hidden_size"}),
        "lacks hidden_size (fields of a causal LM's config",
    ),
    "zero heads": (
        lambda text: json.dumps(json.loads(text) | {"num_attention_heads": 0}),
        "num_attention_heads=0: not a positive integer",
    ),
}


def broken_target(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A copy of the tiny target with a broken config.json; what the refusal must say."""
    target = tmp_path / "target"
    shutil.copytree(target_dir(), target)
    edit, expected = BROKEN_CONFIGS[kind]
    config = target / "config.json"
    config.write_text(edit(config.read_text()))
    return target, f"{config}: {expected}"


def custom_job(target: Path, run_dir: Path, *more: str) -> list[str]:
    """experiment=custom on `target` (a real target's preset), cut to the tiny target's sizes."""
    return [
        "experiment=custom",
        f"model.target_path={target}",
        f"data.train_files=[{embedded_path('data/train.jsonl')}]",
        f"data.eval_files=[{embedded_path('data/eval.jsonl')}]",
        "data.max_length=128",
        "topology.targets=1",
        "topology.drafters=1",
        "train.device=cpu",
        f"run_dir={run_dir}",
        *more,
    ]


def failed_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("FAIL")]


@pytest.mark.parametrize("kind", sorted(BROKEN_CONFIGS))
def test_doctor_refuses_a_config_json_that_is_no_model_config(tmp_path, capsys, kind: str) -> None:
    target, expected = broken_target(tmp_path, kind)
    assert launch_main(["doctor", *custom_job(target, tmp_path / "run")]) == EXIT_PREFLIGHT
    (line,) = failed_lines(capsys.readouterr().out)
    assert line.split()[1] == "config" and expected in line, line


@pytest.mark.slow
def test_the_launcher_refuses_a_truncated_config_json_with_an_outcome_line(tmp_path) -> None:
    target, expected = broken_target(tmp_path, "truncated")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mp.train", *custom_job(target, run)],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_PREFLIGHT, proc.stderr[-3000:]
    assert f"  - config: {expected}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    log = (run / "logs" / "job.log").read_text()
    assert "job FAILED: exit code 2 after" in log and expected in log, log


@pytest.mark.slow
def test_plain_torchrun_ranks_refuse_a_config_json_that_is_a_list(tmp_path) -> None:
    target, expected = broken_target(tmp_path, "list")
    run = tmp_path / "run"
    job = [*custom_job(target, run), "topology=colocated", "topology.targets=0", "topology.drafters=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        + ["-m", "dflash_mp.train", *job],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert "exitcode  : 2" in output and f"  - {expected}" in output, output[-3000:]
    assert "AttributeError" not in output and not (run / "metrics.jsonl").exists()


def write_empty_answers(path: Path, count: int = 20) -> Path:
    record = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": ""}]}
    path.write_text((json.dumps(record) + "\n") * count)
    return path


@pytest.mark.parametrize("command", ["doctor", "start"])
def test_data_whose_answers_are_all_empty_is_refused(tmp_path, capsys, monkeypatch, command: str) -> None:
    """The end-of-turn token alone gives the trainer no anchor: nothing to learn, refused before any
    worker (`start` runs the launcher's preflight; it would detach only once that passed)."""
    from dflash_mp.launch import launcher

    def started(*args: object) -> int:
        raise AssertionError("the preflight passed and a job was started")

    monkeypatch.setattr(launcher, "start_detached", started)
    data = write_empty_answers(tmp_path / "empty.jsonl")
    run = tmp_path / "run"
    overrides = ["train.device=cpu", f"data.train_files=[{data}]", f"run_dir={run}"]
    assert launch_main([command, *overrides]) == EXIT_PREFLIGHT
    output = capsys.readouterr()
    expected = "none of the 20 usable sampled records gives the trainer a token to score"
    if command == "doctor":
        (line,) = failed_lines(output.out)
        assert line.split()[1] == "data" and expected in line, line
        assert "20 of 20 sampled records usable, 0 trainable" in output.out
    else:
        assert f"  - data: {expected}" in output.err, output.err
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
