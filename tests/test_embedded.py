"""The embedded default: a deterministic, race-safe tiny target and learnable bundled data."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mp import embedded
from dflash_mp.data import load_tokenizer, parse_record

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_MP_CACHE", str(tmp_path_factory.mktemp("cache")))
        return embedded.embedded_path("target")


def test_build_is_bitwise_deterministic(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DFLASH_MP_CACHE", str(tmp_path))
    again = embedded.embedded_path("target")
    assert again != target
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (target / name).read_bytes(), name


def test_concurrent_builds_end_with_one_valid_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_MP_CACHE", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # The child pays its imports first, then both processes build at the same moment.
    code = (
        "import sys; from transformers import Qwen3ForCausalLM; from dflash_mp.embedded import ensure_target; "
        "print('ready', flush=True); sys.stdin.readline(); print(ensure_target())"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    ours = embedded.ensure_target()
    theirs = Path(child.communicate(timeout=60)[0].strip())
    assert child.returncode == 0 and theirs == ours
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in ours.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == [ours.name]  # the loser's build is gone


def test_losing_the_rename_race_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_MP_CACHE", str(tmp_path))
    build = embedded.build_target

    def build_then_lose(out_dir: Path) -> None:
        build(out_dir)
        shutil.copytree(out_dir, embedded.target_dir())  # another rank renames its build in first

    monkeypatch.setattr(embedded, "build_target", build_then_lose)
    assert embedded.ensure_target() == embedded.target_dir()
    assert [p.name for p in tmp_path.iterdir()] == [embedded.target_dir().name]


def test_importing_embedded_stays_light() -> None:
    code = "import sys, dflash_mp.embedded; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_target_shape(target: Path) -> None:
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 6, 16)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False


def test_tokenizer_special_tokens_and_chat_template(target: Path) -> None:
    tokenizer = load_tokenizer(target)
    assert len(tokenizer(embedded.MASK, add_special_tokens=False).input_ids) == 1
    assert tokenizer.convert_tokens_to_ids(list(embedded.SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (embedded.IM_END, embedded.PAD)
    messages = [{"role": "user", "content": "Spell the word cat."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nSpell the word cat.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == prompt  # word-level but lossless


def test_tokenizer_is_invertible_on_token_sequences(target: Path) -> None:
    """Data is stored as text: whatever ids the target generates must come back from their text."""
    tokenizer = load_tokenizer(target)
    special = tokenizer.convert_tokens_to_ids(list(embedded.SPECIAL_TOKENS))
    words = [i for i in range(len(tokenizer)) if i not in special]
    assert 100 < len(words) < 400
    role = dict(
        zip(
            ("system", "user", "assistant"),
            tokenizer.convert_tokens_to_ids(
                [embedded.BOUNDARY + name for name in ("system", "user", "assistant")]
            ),
            strict=True,
        )
    )
    newline, im_start, im_end = tokenizer.convert_tokens_to_ids(["\n", embedded.IM_START, embedded.IM_END])

    def round_trip(ids: list[int]) -> list[int]:
        return tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids

    rng = random.Random(0)
    for _ in range(500):
        ids = rng.choices(words, k=rng.randint(1, 40))
        assert round_trip(ids) == ids, tokenizer.convert_ids_to_tokens(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids)
        mixed = rng.choices(words + special, k=rng.randint(1, 40))  # special tokens anywhere
        assert round_trip(mixed) == mixed, tokenizer.convert_ids_to_tokens(mixed)
    for _ in range(200):  # as the chat template places them, with any content (even empty)
        ids = []
        for name in rng.choices(list(role), k=rng.randint(1, 4)):
            content = rng.choices(words, k=rng.randint(0, 20))
            ids += [im_start, role[name], newline, *content, im_end, newline]
        assert round_trip(ids) == ids, tokenizer.convert_ids_to_tokens(ids)
    # Two words never glue into one (" bird" + "hill" used to decode to one unknown word).
    bird, hill = tokenizer.convert_tokens_to_ids([embedded.BOUNDARY + "bird", embedded.BOUNDARY + "hill"])
    assert tokenizer.decode([newline, bird, hill, newline, hill]) == "\nbird hill\nhill"


def test_bundled_data_is_committed_and_fits(target: Path) -> None:
    rendered = embedded.render_data()
    tokenizer = load_tokenizer(target)
    for name, text in rendered.items():
        path = embedded.embedded_path(name)
        assert path.read_text() == text, f"{name} is stale: run python -m dflash_mp.embedded --write-data"
        for line, record in enumerate(text.splitlines(), start=1):
            sample = parse_record(
                record, str(path), line, tokenizer, embedded.MAX_TOKENS - 1, on_too_long="skip"
            )
            assert any(sample.loss_mask) and tokenizer.unk_token_id not in sample.input_ids
    records = [json.loads(line)["messages"] for line in rendered["data/train.jsonl"].splitlines()]
    assert sum(m[0]["role"] == "system" for m in records) > 100
    assert sum(len(m) > 3 for m in records) > 100  # multi-turn


def test_unknown_asset_names_the_known_ones() -> None:
    with pytest.raises(FileNotFoundError, match="data/train.jsonl"):
        embedded.embedded_path("data/nope.jsonl")


def test_random_target_continuations_depend_on_the_prompt(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(target)
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    continuations = []
    for question in ("Count from 3 to 9.", "Reverse these words: sun moon star"):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
        continuations.append(out[0, ids.shape[1] :].tolist())
    assert continuations[0] != continuations[1]
    assert all(len(set(c)) > 3 for c in continuations)  # not one token repeated
