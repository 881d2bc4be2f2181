"""Data regeneration by the target: the answers, rank split, resume, the round-trip guard, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_mp.data import load_tokenizer, tokenize_chat
from dflash_mp.embedded import embedded_path
from dflash_mp.evaluation.acceptance import load_target_model, stop_token_ids
from dflash_mp.evaluation.decoding import autoregressive_generate
from dflash_mp.regenerate import RegenerateError, Settings, main, read_parts, regenerate
from dflash_mp.regenerate import local as regen
from tests.conftest import REPO, job_env

NEW_TOKENS = 10
KEEP_CUT_ANSWERS = ["--on-length", "keep", "--min-finished-fraction", "0"]
RECORDS = [
    [{"role": "user", "content": "Count from 3 to 9."}, {"role": "assistant", "content": "3 4 5 6 7 8 9."}],
    [
        {"role": "system", "content": "You are a patient teacher."},
        {"role": "user", "content": "Spell the word cat."},
        {"role": "assistant", "content": "c a t"},
        {"role": "user", "content": "Reverse these words: sun moon"},
        {"role": "assistant", "content": "moon sun"},
    ],
    [{"role": "user", "content": "What is 2 plus 3?"}],  # prompt only: gets an answer appended
    [{"role": "user", "content": "Repeat these words: tree bird"}, {"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "Continue the alphabet from d for 4 letters."}],
]


def _settings(**changes) -> Settings:
    values = dict(
        max_length=128, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0, batch_size=1, on_bad_record="fail"
    )
    # The tiny random target seldom stops by itself: these tests check the answers, cut or not.
    values.update(on_length="keep", min_finished_fraction=0.0)
    return Settings(**{**values, **changes})


@pytest.fixture(scope="module")
def target() -> Path:
    return embedded_path("target")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in RECORDS))
    return path


def _read(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_assistant_turns_are_the_targets_greedy_answers(target: Path, data: Path, tmp_path: Path) -> None:
    summary = regenerate([data], tmp_path / "out.jsonl", target, _settings())
    assert summary is not None and summary["records"] == len(RECORDS) and summary["turns"] == 6
    tokenizer = load_tokenizer(target)
    model = load_target_model(target, torch.float32, "cpu")
    stops = stop_token_ids(tokenizer, model)
    for original, regenerated in zip(RECORDS, _read(tmp_path / "out.jsonl"), strict=True):
        # Same non-assistant turns in the same places; an answer after a trailing user turn.
        assert [m for m in regenerated if m["role"] != "assistant"] == [
            m for m in original if m["role"] != "assistant"
        ]
        assert regenerated[-1]["role"] == "assistant"
        for i, message in enumerate(regenerated):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(
                regenerated[:i], add_generation_prompt=True, return_dict=True
            )
            new = autoregressive_generate(model, prompt["input_ids"], NEW_TOKENS, stops).new_tokens
            assert message["content"] == tokenizer.decode(new, skip_special_tokens=True)
        tokenize_chat(tokenizer, regenerated, 128)  # the trainer can read it


def test_round_trip_safe_answers_retokenize_to_the_same_ids(target: Path, data: Path, tmp_path: Path) -> None:
    # Sampled freely, the target writes special tokens (<|MASK|>, <|im_start|>, ...) inside answers;
    # text cannot carry them, so those answers do not come back as the same ids.
    free = regenerate([data], tmp_path / "free.jsonl", target, _settings(max_new_tokens=40, temperature=1.0))
    assert free is not None and free["same_tokens_fraction"] < 1.0
    safe = regenerate(
        [data],
        tmp_path / "safe.jsonl",
        target,
        _settings(max_new_tokens=40, temperature=0.3, round_trip_safe=True),
    )
    assert safe is not None and safe["same_tokens_fraction"] == 1.0
    tokenizer = load_tokenizer(target)
    for messages in _read(tmp_path / "safe.jsonl"):
        input_ids, _ = tokenize_chat(tokenizer, messages, 128)
        assert tokenizer.unk_token_id not in input_ids


def test_ranks_split_by_index_and_resume_after_a_kill(
    target: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected_dir = tmp_path / "one"
    regenerate([data], expected_dir / "out.jsonl", target, _settings())
    out, work = tmp_path / "two" / "out.jsonl", tmp_path / "two" / "out.jsonl.parts"

    answered: list[int] = []
    original = regen.regenerate_batch

    def counting(conversations, *args):
        answered.extend(c.index for c in conversations)
        return original(conversations, *args)

    monkeypatch.setattr(regen, "regenerate_batch", counting)
    assert regenerate([data], out, target, _settings(), rank=0, world_size=2) is None  # rank 1 not done
    assert not out.exists() and answered == [0, 2, 4]
    assert sorted(read_parts(work)) == [0, 2, 4]

    # Killed mid-write: record 4's line is cut short; a rerun cuts it off and redoes record 4 only.
    part = work / "part-00000.jsonl"
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:-1]) + lines[-1][:20])
    answered.clear()
    assert regenerate([data], out, target, _settings(), rank=0, world_size=2) is None
    assert answered == [4] and part.read_text().count("\n") == 3

    # The last rank to finish (here at another world size) merges everything in record order.
    answered.clear()
    summary = regenerate([data], out, target, _settings(), rank=0, world_size=1)
    assert answered == [1, 3] and summary is not None and summary["records"] == len(RECORDS)
    assert out.read_text() == (expected_dir / "out.jsonl").read_text()


@pytest.mark.slow
def test_under_torchrun(target: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "dflash_mp.regenerate",
    ]
    cmd += [
        "--target",
        "embedded",
        "--input",
        str(data),
        "--output",
        str(out),
        "--max-length",
        "128",
        "--max-new-tokens",
        str(NEW_TOKENS),
        *KEEP_CUT_ANSWERS,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_read(out)) == len(RECORDS)
    parts = tmp_path / "out.jsonl.parts"
    assert sorted(p.name for p in parts.iterdir()) == [
        "part-00000.jsonl",
        "part-00001.jsonl",
        "settings.json",
    ]
    made = json.loads((parts / "settings.json").read_text())
    assert (made["max_length"], made["max_new_tokens"], made["on_length"]) == (128, NEW_TOKENS, "keep")
    # Each rank's progress: records 0, 2, 4 on rank 0 and 1, 3 on rank 1.
    assert "rank 0: 3 of 3 records written; done in" in proc.stderr
    assert "rank 1: 2 of 2 records written; done in" in proc.stderr


# ----------------------------------------------------------------------------------------- bad input


def test_an_empty_input_is_an_error(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert (
        main(["--input", str(empty), "--output", str(tmp_path / "out.jsonl"), "--target", str(target)]) == 2
    )
    assert "no records in" in capsys.readouterr().err


def test_a_prompt_longer_than_max_length_fails_or_is_skipped(
    target: Path, data: Path, tmp_path: Path
) -> None:
    lines = data.read_text().splitlines()
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["Count"] * 200)}]}
    data.write_text("\n".join(lines[:2] + [json.dumps(long_prompt)] + lines[2:]) + "\n")
    with pytest.raises(
        RegenerateError, match=r"in.jsonl:3: the prompt has 20\d tokens: no room .*--on-bad-record skip"
    ):
        regenerate([data], tmp_path / "a.jsonl", target, _settings())
    summary = regenerate([data], tmp_path / "b.jsonl", target, _settings(on_bad_record="skip"))
    assert summary is not None and summary["records"] == len(RECORDS)
    assert list(summary["skipped"].values()) == [1]


def test_a_malformed_record_names_its_line(target: Path, data: Path, tmp_path: Path) -> None:
    data.write_text(data.read_text() + '{"messages": [{"role": "assistant", "content": "hi"}]}\n{"mess\n')
    with pytest.raises(RegenerateError, match=r"in.jsonl:6: message 0 is an assistant turn with no prompt"):
        regenerate([data], tmp_path / "a.jsonl", target, _settings())
    summary = regenerate([data], tmp_path / "b.jsonl", target, _settings(on_bad_record="skip"))
    assert summary is not None and sum(summary["skipped"].values()) == 2


def test_bad_settings_are_reported_together(target: Path, data: Path, tmp_path: Path) -> None:
    with pytest.raises(RegenerateError, match=r"--max-new-tokens=0: must be >= 1; --batch-size=0"):
        _settings(max_new_tokens=0, batch_size=0)
    with pytest.raises(RegenerateError, match="--max-length 4096 exceeds the target's context of 512"):
        regenerate([data], tmp_path / "a.jsonl", target, _settings(max_length=4096))


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_kwargs_reach_the_local_template(
    thinking: bool, target: Path, data: Path, tmp_path: Path
) -> None:
    # A Qwen3-style template closes an empty think block in the prompt when enable_thinking is false.
    qwen3_style = tmp_path / "qwen3-style"
    shutil.copytree(target, qwen3_style)
    shutil.copy(REPO / "tests/fixtures/qwen3_chat_template.jinja", qwen3_style / "chat_template.jinja")
    tokenizer = load_tokenizer(qwen3_style)
    lengths = {
        flag: len(
            tokenizer.apply_chat_template(
                RECORDS[0][:1], add_generation_prompt=True, return_dict=True, enable_thinking=flag
            )["input_ids"]
        )
        for flag in (True, False)
    }
    assert lengths[False] > lengths[True]
    # No room for an answer: the error gives the length of the prompt as rendered.
    settings = _settings(max_length=lengths[True], chat_template_kwargs={"enable_thinking": thinking})
    with pytest.raises(RegenerateError, match=rf"in.jsonl:1: the prompt has {lengths[thinking]} tokens"):
        regenerate([data], tmp_path / "out.jsonl", qwen3_style, settings)


def test_a_conversation_the_template_rejects_is_a_bad_record(
    target: Path, data: Path, tmp_path: Path
) -> None:
    strict = tmp_path / "no-system"
    shutil.copytree(target, strict)
    template = (target / "chat_template.jinja").read_text()
    guard = "{%- if messages[0]['role'] == 'system' %}{{- raise_exception('no system turns') }}{%- endif %}"
    (strict / "chat_template.jinja").write_text(guard + template)
    with pytest.raises(
        RegenerateError, match=r"in.jsonl:2: the chat template cannot render .*no system turns"
    ):
        regenerate([data], tmp_path / "a.jsonl", strict, _settings())
    summary = regenerate([data], tmp_path / "b.jsonl", strict, _settings(on_bad_record="skip"))
    assert summary is not None and summary["records"] == len(RECORDS) - 1


def test_resuming_onto_a_changed_input_is_an_error(target: Path, data: Path, tmp_path: Path) -> None:
    regenerate([data], tmp_path / "out.jsonl", target, _settings(), limit=2)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join([lines[1], lines[0], *lines[2:]]))  # same records, another order
    with pytest.raises(RegenerateError, match=r"in.jsonl:1 is not the record .*out.jsonl.parts holds"):
        regenerate([data], tmp_path / "out.jsonl", target, _settings())
