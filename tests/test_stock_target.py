"""The stock-layout Qwen3 fixture is what a downloaded Qwen3 directory is, and our code paths take it."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dflash_mp.data import load_tokenizer, tokenize_chat
from dflash_mp.models.target import TargetFeatureExtractor, load_embedding_and_head
from tests.conftest import read_metrics, run_train
from tests.stock_qwen3 import QWEN3_ADDED_TOKENS, qwen_reference_encoding

TEXTS = [
    "Hello, world!",
    "I'm here.  Don't\n\n  tab\tstop 12345 ¿Qué tal? 日本語のテキスト 🤖🤖 def f(x):\n    return x**2",
    "   leading spaces and trailing   ",
    unicodedata.normalize("NFC", "naïve café, Straße, Ελληνικά, русский"),
]


def test_tokenizer_encodes_like_qwens_own_and_has_qwen3s_added_tokens(stock_qwen3_target: Path) -> None:
    tokenizer = load_tokenizer(stock_qwen3_target)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == qwen_reference_encoding(text)
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(content) == 151643 + offset
    assert tokenizer.convert_tokens_to_ids("<think>") == 151667
    assert len(tokenizer) == 151669
    assert "<|MASK|>" not in tokenizer.get_vocab()
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    config = json.loads((stock_qwen3_target / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (151936, False)


def test_chat_template_moves_thinking_and_honours_enable_thinking(stock_qwen3_target: Path) -> None:
    tokenizer = load_tokenizer(stock_qwen3_target)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "add them" not in text  # an earlier turn's thinking is dropped
    assert text.endswith("<|im_start|>assistant\n<think>\nagain\n</think>\n\n6<|im_end|>\n")
    prompt = messages[:1]
    thinking = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    direct = tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert direct.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The loss mask covers the answers and their <|im_end|> on the real vocabulary.
    plain = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4, of course."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    input_ids, loss_mask = tokenize_chat(tokenizer, plain, max_length=512)
    masked = tokenizer.decode([t for t, m in zip(input_ids, loss_mask, strict=True) if m])
    # The final turn's empty think block is what a thinking-mode Qwen3 generates after its prompt.
    assert masked == "4, of course.<|im_end|><think>\n\n</think>\n\n6<|im_end|>"


def test_embedding_head_and_feature_extractor_load_the_full_vocabulary(stock_qwen3_target: Path) -> None:
    embedding, head = load_embedding_and_head(stock_qwen3_target, torch.float32, "cpu")
    assert embedding.shape == head.shape == (151936, 32)
    assert not torch.equal(embedding, head)  # untied, as Qwen3-8B
    extractor = TargetFeatureExtractor(stock_qwen3_target, [1, 3], torch.float32, "cpu")
    features = extractor(torch.tensor([[151644, 872, 198, 9707, 151645]]))
    assert features.shape == (1, 5, 64) and torch.isfinite(features).all()


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def _sharegpt(messages: list[dict], reasoning: list[str] | None = None) -> str:
    """A conversation as a ShareGPT line; assistant turns get `reasoning` inline as <think>...</think>."""
    turns, answers = [], iter(reasoning or [])
    for message in messages:
        value = message["content"]
        if message["role"] == "assistant" and reasoning is not None:
            value = f"<think>\n{next(answers)}\n</think>\n\n{value}"
        turns.append({"from": SHAREGPT_ROLES[message["role"]], "value": value})
    return json.dumps({"conversations": turns})


# One record a step: 120 steps of 8 anchors at lr 3e-2 reach tau 1.36 on this data, clear of the
# test's bound (tau > 1) at a third of the CPU of 2-record steps.
STEPS = 120


def _sharegpt_data_with_thinking(target: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Training data as a user switching from SpecForge has it: ShareGPT records with inline
    thinking, whose reasoning and answers the target itself wrote (`python -m
    dflash_mp.regenerate`); and held-out ShareGPT prompts."""
    from dflash_mp.embedded import embedded_path
    from dflash_mp.regenerate import main as regenerate

    source = embedded_path("data/train.jsonl").read_text().splitlines()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(source[:STEPS]) + "\n")
    regenerated = tmp_path / "regenerated.jsonl"
    args = ["--input", str(prompts), "--output", str(regenerated), "--target", str(target)]
    args += ["--work-dir", str(tmp_path / "parts"), "--max-length", "256", "--max-new-tokens", "16"]
    args += ["--on-length", "keep", "--min-finished-fraction", "0"]  # a random target seldom stops
    assert regenerate([*args, "--batch-size", "32"]) == 0
    train = tmp_path / "train_sharegpt.jsonl"
    with open(train, "w") as out:
        for answered in regenerated.read_text().splitlines():
            # The target's answer is also its reasoning: a drafter learns what the target writes.
            messages = json.loads(answered)["messages"]
            thoughts = [m["content"] for m in messages if m["role"] == "assistant"]
            out.write(_sharegpt(messages, thoughts) + "\n")
    held_out = tmp_path / "eval_sharegpt.jsonl"
    held_out.write_text("".join(_sharegpt(json.loads(line)["messages"]) + "\n" for line in source[200:208]))
    return train, held_out


@pytest.mark.slow
def test_a_stock_target_with_sharegpt_thinking_data_gives_a_drafter_dflash_decodes(
    stock_qwen3_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 12's end-to-end path with no hand edits: a stock Qwen3 directory (no <|MASK|>) and
    ShareGPT data with thinking train under torchrun; the run keeps its tokenizer with the added
    mask token; every retained checkpoint exports in one command; the export loads in the
    reference `dflash` 0.1.0 and its `dflash_generate` accepts drafted tokens (tau > 1)."""
    import time

    from dflash import model as reference
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from dflash_mp.evaluation.acceptance import load_target_model, stop_token_ids
    from dflash_mp.evaluation.prompts import load_prompts
    from dflash_mp.export.cli import main as export_main

    train, held_out = _sharegpt_data_with_thinking(stock_qwen3_target, tmp_path)
    run = tmp_path / "run"
    run_train(
        run,
        "experiment=custom",  # a real target: the embedded experiment refuses it
        f"model.target_path={stock_qwen3_target}",
        "model.draft_layers=2",
        "model.block_size=8",
        "model.target_layer_ids=[1,3]",
        "topology=1t1d",
        f"train.max_steps={STEPS}",
        f"train.checkpoint_every={STEPS // 2}",
        "train.micro_batch_size=1",
        "train.gamma=null",
        "optim.lr=3e-2",
        f"data.train_files=[{train}]",
        f"data.eval_files=[{held_out}]",
        "data.max_length=256",
        "data.num_anchors=8",
        "eval.every=0",
        timeout=900,
    )
    metrics = read_metrics(run)
    assert sum(m["bad_records"] for m in metrics) == 0  # every ShareGPT record with thinking was used
    saved = OmegaConf.load(run / "config.yaml")
    assert (saved.model.mask_token_id, saved.train.gamma) == (151669, 4.0)
    tokenizer = AutoTokenizer.from_pretrained(str(run / "tokenizer"), local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("<|MASK|>") == 151669
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert steps == [STEPS // 2, STEPS]
    for step in steps:
        out = tmp_path / f"export-{step}"
        assert export_main([str(run), "--step", str(step), "--out", str(out), "--dtype", "float32"]) == 0
        drafter = reference.DFlashDraftModel.from_pretrained(str(out))
        assert (drafter.block_size, drafter.mask_token_id) == (8, 151669)
        trained = load_file(run / "checkpoints" / f"step_{step:08d}" / "drafter.safetensors")
        assert torch.equal(drafter.fc.weight, trained["fc.weight"])

    # The reference decodes the run's own export (bf16 on disk) against the stock target.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times with CUDA syncs
    drafter, info = reference.DFlashDraftModel.from_pretrained(
        str(run / "export"), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    target_tokenizer = load_tokenizer(stock_qwen3_target)
    target = load_target_model(stock_qwen3_target, torch.float32, "cpu")
    stops = stop_token_ids(target_tokenizer, target)
    accepted = []
    for prompt in load_prompts([held_out], target_tokenizer, limit=4):
        result = reference.dflash_generate(
            drafter.eval(), target, torch.tensor([prompt.input_ids]), 16, stops, return_stats=True
        )
        accepted += result.acceptance_lengths
    tau = sum(accepted) / len(accepted)
    assert tau > 1.0, accepted
