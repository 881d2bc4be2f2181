"""The stock-layout Qwen3 fixture is what a downloaded Qwen3 directory is, and our code paths take it."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch

from dflash_mp.data import load_tokenizer, tokenize_chat
from dflash_mp.models.target import TargetFeatureExtractor, load_embedding_and_head
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
    assert masked == "4, of course.<|im_end|>6<|im_end|>"


def test_embedding_head_and_feature_extractor_load_the_full_vocabulary(stock_qwen3_target: Path) -> None:
    embedding, head = load_embedding_and_head(stock_qwen3_target, torch.float32, "cpu")
    assert embedding.shape == head.shape == (151936, 32)
    assert not torch.equal(embedding, head)  # untied, as Qwen3-8B
    extractor = TargetFeatureExtractor(stock_qwen3_target, [1, 3], torch.float32, "cpu")
    features = extractor(torch.tensor([[151644, 872, 198, 9707, 151645]]))
    assert features.shape == (1, 5, 64) and torch.isfinite(features).all()
