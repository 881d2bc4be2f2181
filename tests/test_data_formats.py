"""Record formats, reasoning and chat templates: the same conversation gives the same training data."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dflash_mp import embedded
from dflash_mp.data import BadRecord, ChatRenderer, load_tokenizer, parse_record
from dflash_mp.data.chat import load_renderer

LOGGER = logging.getLogger("test_data_formats")
QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja"

SYSTEM, U1, R1, A1 = "You are a patient teacher.", "Count from 3 to 5.", "Start at 3.", "3 4 5."
U2, R2, A2 = "Spell the word cat.", "One letter at a time.", "c a t"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer (the embedded target's kind) whose vocabulary covers these tests' words."""
    path = tmp_path_factory.mktemp("tokenizer")
    words = [SYSTEM, U1, R1, A1, U2, R2, A2, "<think>\n</think>\n\n hmm"]
    embedded.build_tokenizer(
        [[{"role": r, "content": w} for w in words for r in ("system", "user", "assistant")]]
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def renderer(tokenizer_dir: Path) -> ChatRenderer:
    return load_renderer(tokenizer_dir, False, str(QWEN3_TEMPLATE))


def think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


# The same conversation in every accepted format.
FORMATS = {
    "messages + reasoning_content": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": U1},
            {"role": "assistant", "content": A1, "reasoning_content": R1},
            {"role": "user", "content": U2},
            {"role": "assistant", "content": A2, "reasoning_content": R2},
        ]
    },
    "messages + inline think": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": U1},
            {"role": "assistant", "content": think(R1, A1)},
            {"role": "user", "content": U2},
            {"role": "assistant", "content": think(R2, A2)},
        ]
    },
    "conversations": {
        "conversations": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": U1},
            {"role": "assistant", "content": think(R1, A1)},
            {"role": "user", "content": U2},
            {"role": "assistant", "content": A2, "reasoning_content": R2},
        ]
    },
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": U1},
            {"from": "gpt", "value": think(R1, A1)},
            {"from": "human", "value": U2},
            {"from": "gpt", "value": think(R2, A2)},
        ]
    },
}

# Written by hand from the template: reasoning before the last user turn is dropped, the last
# turn keeps it; the loss is what the model generates after "<|im_start|>assistant\n".
RENDERED = [
    (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{U1}<|im_end|>\n<|im_start|>assistant\n", 0),
    (f"{A1}<|im_end|>", 1),
    (f"\n<|im_start|>user\n{U2}<|im_end|>\n<|im_start|>assistant\n", 0),
    (f"<think>\n{R2}\n</think>\n\n{A2}<|im_end|>", 1),
    ("\n", 0),
]


def text_record(with_spans: bool) -> dict:
    text, spans, position = "", [], 0
    for piece, in_loss in RENDERED:
        if in_loss:
            spans.append([position, position + len(piece)])
        text += piece
        position += len(piece)
    return {"text": text, "loss_spans": spans} if with_spans else {"text": text}


def parse(obj: dict | str, renderer: ChatRenderer, max_length: int = 256, **kwargs: Any):
    line = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_record(line, "d.jsonl", 1, renderer.tokenizer, max_length, renderer=renderer, **kwargs)


def test_every_format_gives_the_same_ids_and_loss_mask(renderer: ChatRenderer) -> None:
    tokenizer = renderer.tokenizer
    expected_ids, expected_mask = [], []
    for piece, in_loss in RENDERED:
        ids = tokenizer(piece, add_special_tokens=False).input_ids
        expected_ids += ids
        expected_mask += [in_loss] * len(ids)
    assert tokenizer.unk_token_id not in expected_ids
    for name, obj in [*FORMATS.items(), ("text + loss_spans", text_record(with_spans=True))]:
        sample = parse(obj, renderer)
        assert (sample.input_ids, sample.loss_mask) == (expected_ids, expected_mask), name
    learned = tokenizer.decode([t for t, m in zip(expected_ids, expected_mask, strict=True) if m])
    assert R1 not in learned and R2 in learned and "</think>" in learned


def test_text_without_spans_is_trained_on_every_token(renderer: ChatRenderer) -> None:
    sample = parse(text_record(with_spans=False), renderer)
    assert sample.input_ids == parse(text_record(with_spans=True), renderer).input_ids
    assert sample.loss_mask == [1] * len(sample.input_ids)


def test_reasoning_field_and_inline_think_are_one_thing(renderer: ChatRenderer) -> None:
    for reasoning in ("hmm", "\nhmm\n", ""):
        inline = {
            "messages": [
                {"role": "user", "content": U1},
                {"role": "assistant", "content": f"<think>{reasoning}</think>{A1}"},
            ]
        }
        field = {
            "messages": [
                {"role": "user", "content": U1},
                {"role": "assistant", "content": A1, "reasoning_content": reasoning},
            ]
        }
        a, b = parse(inline, renderer), parse(field, renderer)
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask), reasoning
    with pytest.raises(BadRecord, match="both reasoning_content and an inline"):
        parse(
            {
                "messages": [
                    {"role": "user", "content": U1},
                    {"role": "assistant", "content": think(R1, A1), "reasoning_content": R1},
                ]
            },
            renderer,
        )


def test_template_kwargs_move_the_generation_prompt_out_of_the_loss(tokenizer_dir: Path) -> None:
    """enable_thinking=false: the empty think block is prompt, not something the model generates."""
    record = {"messages": [{"role": "user", "content": U1}, {"role": "assistant", "content": A1}]}
    thinking = load_renderer(tokenizer_dir, False, str(QWEN3_TEMPLATE))
    plain = load_renderer(tokenizer_dir, False, str(QWEN3_TEMPLATE), {"enable_thinking": False})
    tokenizer = thinking.tokenizer
    for r, expected in ((thinking, f"<think>\n\n</think>\n\n{A1}<|im_end|>"), (plain, f"{A1}<|im_end|>")):
        sample = parse(record, r)
        learned = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        assert learned == tokenizer(expected, add_special_tokens=False).input_ids


def test_chat_template_file_overrides_the_tokenizers(tokenizer_dir: Path) -> None:
    record = FORMATS["messages + inline think"]
    own = load_tokenizer(tokenizer_dir)  # embedded ChatML: keeps the content verbatim
    kept = own.decode(parse(record, ChatRenderer(own)).input_ids)
    moved = own.decode(parse(record, load_renderer(tokenizer_dir, False, str(QWEN3_TEMPLATE))).input_ids)
    assert R1 in kept and R2 in kept
    assert R1 not in moved and R2 in moved  # the file's template drops reasoning before the last user turn


def test_template_errors_and_unknown_formats_are_bad_records(renderer: ChatRenderer, tmp_path: Path) -> None:
    with pytest.raises(
        BadRecord, match=r"unknown record format \(keys: prompt, response\); accepted: .*sharegpt|ShareGPT"
    ) as caught:
        parse({"prompt": "a", "response": "b"}, renderer)
    assert caught.value.kind == "unknown format"
    with pytest.raises(BadRecord, match='unknown "from"'):
        parse({"conversations": [{"from": "robot", "value": "x"}]}, renderer)
    with pytest.raises(BadRecord, match="loss_spans"):
        parse({"text": "abc", "loss_spans": [[2, 9]]}, renderer)
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('only user turns here') }}")
    with pytest.raises(BadRecord, match="only user turns here"):
        parse(FORMATS["sharegpt"], ChatRenderer(renderer.tokenizer, raising.read_text()))
