"""The embedded default: a tiny random Qwen3-shaped target and a small bundled chat data set.

Nothing here touches the network. The target (weights, tokenizer, chat template) is built
deterministically on first use into a cache directory, atomically, so that every torchrun
rank can call `embedded_path("target")` at the same time. torch and transformers are imported
only inside the build: config validation imports this module and must stay fast.

    python -m dflash_mp.embedded --write-data            # regenerate assets/data/*.jsonl
    python -m dflash_mp.embedded --build-target [--force] # build the target, print its path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets"
DATA_FILES = ("data/train.jsonl", "data/eval.jsonl")
# The training prompts answered by the target (dflash_mp.regenerate); not part of the target's digest.
REGENERATED_DATA = "data/train_regenerated.jsonl"
# Bump when the build recipe changes; the data digest is appended, so new data gives a new target.
TARGET_VERSION = "embedded-target-v4"
# A random target's behaviour is the luck of its seed. This one (as 1234 did for v2, whose vocabulary
# differed) gives greedy continuations of every bundled eval prompt that run past 64 tokens with no
# stop or other special token, so speculative decoding of those prompts is measured at full length;
# 1234 (v3) stops on a third of them within 48 tokens.
TARGET_SEED = 1238
DATA_SEED = 20240601
MAX_TOKENS = 128

IM_START, IM_END, PAD, MASK, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|MASK|>", "<unk>"
# Fixed order: these become token ids 0..4.
SPECIAL_TOKENS = (PAD, IM_START, IM_END, MASK, UNK)
# Word-level tokens that are invertible on token sequences: encode(decode(ids)) == ids for any ids.
# Every word (a run of letters, digits, _) carries SentencePiece's word-boundary marker in front, so
# no two tokens can glue into one word when decoded; punctuation marks and the newline are tokens of
# their own. Encoding turns spaces into the marker and adds one before a word that starts the text
# or a line (or follows a special token); decoding drops exactly that one and turns the others back
# into spaces. Word-level tokens keep conversations short and decoding lossless.
BOUNDARY = "\u2581"
# After normalization: a word with its boundary, a boundary alone (a space before punctuation or
# another space), or any other single character.
PIECE_PATTERN = rf"{BOUNDARY}?\w+|{BOUNDARY}|[^\w{BOUNDARY}]"
# Where a word starts the text or a line: the boundary the encoder adds and the decoder drops.
LINE_START = r"(?:\A|(?<=\n))"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TARGET_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=192,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


def cache_dir() -> Path:
    """Where built artefacts live: $DFLASH_MP_CACHE, else ~/.cache/dflash_mp."""
    return Path(os.environ.get("DFLASH_MP_CACHE") or Path.home() / ".cache" / "dflash_mp")


def embedded_path(name: str) -> Path:
    """Path of an embedded asset: "target" (built on first use) or a bundled file such as data/train.jsonl."""
    if name == "target":
        return ensure_target()
    path = (ASSETS / name).resolve()
    if ASSETS not in path.parents or not path.is_file():
        raise FileNotFoundError(
            f"no embedded asset {name!r} (looked at {path}); known names: target, {', '.join(DATA_FILES)}, "
            f"{REGENERATED_DATA}. Regenerate the data with `python -m dflash_mp.embedded --write-data` "
            "(and the regenerated set with the command in `python -m dflash_mp.regenerate --help`)."
        )
    return path


# ----------------------------------------------------------------------------------------
# target


def target_dir() -> Path:
    """The versioned cache directory of the tiny target (it may not exist yet)."""
    digest = hashlib.sha256()
    for name in DATA_FILES:
        digest.update((ASSETS / name).read_bytes())
    return cache_dir() / f"{TARGET_VERSION}-{digest.hexdigest()[:10]}"


def ensure_target(force: bool = False) -> Path:
    """Build the tiny target unless it is already there; safe when many processes call it at once."""
    final = target_dir()
    if force and final.exists():
        # Move it aside first so that other processes never see a half-deleted directory.
        trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, trash / "old")
        shutil.rmtree(trash)
    return build_once(final, build_target)


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final` (a model directory), built by `build(tmp)` on first use and renamed into place:
    safe when many processes call it at once, world-readable for a shared cache."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must be readable by all
    try:
        build(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                path.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its build into place first: theirs is identical, use it.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_tokenizer(conversations: list[list[dict[str, str]]]) -> Any:
    """A word-level PreTrainedTokenizerFast whose vocabulary is every piece of `conversations`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = Counter(
        piece for messages in conversations for text in _render_chat(messages) for piece in pieces(text)
    )
    # Ties broken by the piece itself, so the vocabulary is the same on every machine.
    ordered = sorted(counts, key=lambda piece: (-counts[piece], piece))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ordered))}

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # The text between special tokens is normalized on its own, so \A also matches after each of them.
    backend.normalizer = normalizers.Sequence(
        [
            normalizers.Replace(Regex(rf"{LINE_START}(?=\w)"), BOUNDARY),
            normalizers.Replace(" ", BOUNDARY),
        ]
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")
    # Decoding sees the special tokens (unless skipped) but not where the text was cut around them.
    after_special = "|".join(re.escape(token) for token in SPECIAL_TOKENS)
    backend.decoder = decoders.Sequence(
        [
            decoders.Fuse(),
            decoders.Replace(Regex(rf"(?:\A|(?<=\n|{after_special})){BOUNDARY}(?=\w)"), ""),
            decoders.Replace(BOUNDARY, " "),
        ]
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, MASK],
        clean_up_tokenization_spaces=False,
        model_max_length=TARGET_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def pieces(text: str) -> list[str]:
    """The tokens of text without special tokens: the tokenizer's normalizer and pre-tokenizer in Python."""
    normalized = re.sub(rf"{LINE_START}(?=\w)", BOUNDARY, text).replace(" ", BOUNDARY)
    return re.findall(PIECE_PATTERN, normalized)


def build_target(out_dir: Path) -> None:
    """Write the tiny target (HF format: config, safetensors, tokenizer, chat template) into out_dir."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    conversations = [json.loads(line)["messages"] for name in DATA_FILES for line in _read_lines(name)]
    tokenizer = build_tokenizer(conversations)
    tokenizer.save_pretrained(out_dir)

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **TARGET_SHAPE,
    )
    model = Qwen3ForCausalLM(config).float()
    generator = torch.Generator().manual_seed(TARGET_SEED)
    # Uniform draws scaled by exact float ops are bitwise identical on every CPU, unlike normal_()
    # whose vectorised transcendental maths depends on the instruction set.
    # Embedding and head get a larger scale than the layers: token identity then dominates the
    # residual stream and the logits are peaked, as in a trained LLM, so a drafter has something
    # to learn from the features and the random target's greedy continuations are varied.
    std = {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.3}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:  # RMSNorm scales
                param.fill_(1.0)
            else:
                half_width = std.get(name, config.initializer_range) * 3**0.5
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * half_width)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)


def _read_lines(name: str) -> list[str]:
    return [line for line in (ASSETS / name).read_text().splitlines() if line.strip()]


def _render_chat(messages: list[dict[str, str]]) -> list[str]:
    """The chat template's text split around special tokens (those never reach the pre-tokenizer)."""
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return [part for part in re.split("|".join(map(re.escape, SPECIAL_TOKENS)), turns) if part]


# ----------------------------------------------------------------------------------------
# bundled data: templated tasks a small model can learn from the left context

_WORD_LIST = """
apple bird boat bread cake cat cloud door duck fish flower garden green hill horse house lamp leaf
lemon moon mouse music ocean orange paper pencil river road seed sheep snow star stone sun table
tiger train tree water window yellow
"""
WORDS = _WORD_LIST.split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Answer exactly.",
    "You are a patient teacher.",
)


def _count_up(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(1, 25)
    end = start + rng.randint(4, 12)
    return f"Count from {start} to {end}.", " ".join(map(str, range(start, end + 1))) + "."


def _count_down(rng: random.Random) -> tuple[str, str]:
    end = rng.randint(0, 20)
    start = end + rng.randint(4, 12)
    return f"Count down from {start} to {end}.", " ".join(map(str, range(start, end - 1, -1))) + "."


def _count_by(rng: random.Random) -> tuple[str, str]:
    step, start = rng.randint(2, 5), rng.randint(0, 10)
    numbers = [start + step * i for i in range(rng.randint(4, 7))]
    return f"Count by {step} from {start} to {numbers[-1]}.", " ".join(map(str, numbers)) + "."


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return f"Repeat these words: {' '.join(words)}", " ".join(words)


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return f"Reverse these words: {' '.join(words)}", " ".join(reversed(words))


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word {word}.", f"The word {word} is spelled {' '.join(word)}."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 20), rng.randint(1, 6)
    steps = " ".join(str(a + i) for i in range(1, b + 1))
    return f"What is {a} plus {b}?", f"Start at {a} and count {b} more: {steps}. So {a} plus {b} is {a + b}."


def _times_table(rng: random.Random) -> tuple[str, str]:
    k, n = rng.randint(2, 5), rng.randint(3, 5)
    rows = " ".join(f"{k} times {i} is {k * i}." for i in range(1, n + 1))
    return f"Write the times table of {k} up to {n}.", rows


def _alphabet(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(4, 10)
    start = rng.randint(0, len(LETTERS) - n)
    letters = LETTERS[start : start + n]
    return f"Continue the alphabet from {letters[0]} for {n} letters.", " ".join(letters)


TASKS = (_count_up, _count_down, _count_by, _repeat, _reverse, _spell, _add, _times_table, _alphabet)


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(2 if rng.random() < 0.25 else 1):
        question, answer = rng.choice(TASKS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def _num_tokens(messages: list[dict[str, str]]) -> int:
    """Token count under the embedded tokenizer: <|im_start|> and <|im_end|> per turn, plus the pieces."""
    return 2 * len(messages) + sum(len(pieces(part)) for part in _render_chat(messages))


def generate_conversations(count: int, rng: random.Random) -> list[list[dict[str, str]]]:
    """`count` conversations, each shorter than MAX_TOKENS tokens with the chat template."""
    conversations: list[list[dict[str, str]]] = []
    while len(conversations) < count:
        messages = _conversation(rng)
        if _num_tokens(messages) < MAX_TOKENS:
            conversations.append(messages)
    return conversations


def render_data(num_train: int = 2000, num_eval: int = 64) -> dict[str, str]:
    """The bundled JSONL files' contents by name; the fixed seed always gives the same bytes."""
    rng = random.Random(DATA_SEED)
    return {
        name: "".join(json.dumps({"messages": m}) + "\n" for m in generate_conversations(count, rng))
        for name, count in zip(DATA_FILES, (num_train, num_eval), strict=True)
    }


def write_data() -> None:
    """Regenerate assets/data/{train,eval}.jsonl."""
    for name, text in render_data().items():
        path = ASSETS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {text.count(chr(10))} conversations to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.embedded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--write-data", action="store_true", help="regenerate the bundled JSONL data")
    parser.add_argument(
        "--build-target", action="store_true", help="build the tiny target and print its path"
    )
    parser.add_argument("--force", action="store_true", help="rebuild the target even if it is cached")
    args = parser.parse_args()
    if not (args.write_data or args.build_target):
        parser.error("nothing to do: pass --write-data and/or --build-target")
    if args.write_data:
        write_data()
    if args.build_target:
        print(ensure_target(force=args.force))


if __name__ == "__main__":
    main()
