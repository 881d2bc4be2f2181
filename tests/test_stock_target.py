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
from tests.conftest import run_train
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


@pytest.mark.slow
def test_a_stock_target_trains_under_torchrun_and_every_checkpoint_exports(
    stock_qwen3_target: Path, tmp_path: Path
) -> None:
    """No hand edits: the stock directory trains, the run keeps its tokenizer with the added mask
    token, and every retained checkpoint exports in one command to what the reference loads."""
    from dflash import model as reference
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from dflash_mp.eval import main as eval_main
    from dflash_mp.export import main as export_main

    run = tmp_path / "run"
    run_train(
        run,
        f"model.target_path={stock_qwen3_target}",
        "model.target_layer_ids=[1,2]",
        "topology=1t1d",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "train.micro_batch_size=2",
        "train.gamma=null",
        "data.max_length=256",
        "eval.every=0",
    )
    saved = OmegaConf.load(run / "config.yaml")
    assert (saved.model.mask_token_id, saved.train.gamma) == (151669, 4.0)
    tokenizer = AutoTokenizer.from_pretrained(str(run / "tokenizer"), local_files_only=True)
    assert tokenizer.convert_tokens_to_ids("<|MASK|>") == 151669
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert steps == [2, 4]
    for step in steps:
        out = tmp_path / f"export-{step}"
        assert export_main([str(run), "--step", str(step), "--out", str(out), "--dtype", "float32"]) == 0
        drafter = reference.DFlashDraftModel.from_pretrained(str(out))
        assert (drafter.block_size, drafter.mask_token_id) == (8, 151669)
        trained = load_file(run / "checkpoints" / f"step_{step:08d}" / "drafter.safetensors")
        assert torch.equal(drafter.fc.weight, trained["fc.weight"])
    final = reference.DFlashDraftModel.from_pretrained(str(run / "export"))
    assert final.mask_token_id == 151669
    # Speculative decoding with the full 151936-row LM head on CPU.
    args = [str(run), "--num-prompts", "1", "--max-new-tokens", "6", "--device", "cpu"]
    assert eval_main(args) == 0
    result = json.loads((run / "eval.json").read_text())
    assert result["tau"] >= 1.0 and result["matches_autoregressive"]
