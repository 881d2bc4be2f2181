"""Chat data: assistant loss masks, bad records, topology-free order, micro-batches."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_mp import embedded
from dflash_mp.data import (
    BadRecord,
    DataError,
    DataOrder,
    JsonlIndex,
    MicroBatchReader,
    Sample,
    collate,
    epoch_permutation,
    load_tokenizer,
    micro_batches_per_epoch,
    parse_record,
    records_of_micro_batch,
    tokenize_chat,
)

LOGGER = logging.getLogger("test_data")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The embedded target's tokenizer, saved and loaded the way the runtime loads it (no model build)."""
    path = tmp_path_factory.mktemp("tokenizer")
    conversations = [
        json.loads(line)["messages"] for line in embedded.render_data()["data/train.jsonl"].splitlines()
    ]
    embedded.build_tokenizer(conversations).save_pretrained(path)
    return load_tokenizer(path)


def chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


def record(*turns: tuple[str, str]) -> str:
    return json.dumps({"messages": chat(*turns)})


GOOD = record(("user", "Count from 3 to 5."), ("assistant", "3 4 5."))


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ----------------------------------------------------------------------------------------
# loss masks


def test_assistant_mask_is_exact_on_multi_turn_with_system(tokenizer: Any) -> None:
    messages = chat(
        ("system", "You are a patient teacher."),
        ("user", "Count from 3 to 5."),
        ("assistant", "3 4 5."),
        ("user", "Spell the word cat."),
        ("assistant", "c a t"),
    )
    input_ids, loss_mask = tokenize_chat(tokenizer, messages, max_length=128)
    # Hand-built: the rendering cut where the loss starts and stops (word-level pieces never span a cut).
    segments = [
        ("<|im_start|>system\nYou are a patient teacher.<|im_end|>\n<|im_start|>user\nCount from 3 to 5."
         "<|im_end|>\n<|im_start|>assistant\n", 0),
        ("3 4 5.<|im_end|>", 1),
        ("\n<|im_start|>user\nSpell the word cat.<|im_end|>\n<|im_start|>assistant\n", 0),
        ("c a t<|im_end|>", 1),
        ("\n", 0),
    ]  # fmt: skip
    expected_ids, expected_mask = [], []
    for text, in_loss in segments:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        expected_ids += ids
        expected_mask += [in_loss] * len(ids)
    assert input_ids == expected_ids
    assert loss_mask == expected_mask
    learned = tokenizer.convert_ids_to_tokens([t for t, m in zip(input_ids, loss_mask, strict=True) if m])
    assert learned == ["▁3", "▁4", "▁5", ".", "<|im_end|>", "▁c", "▁a", "▁t", "<|im_end|>"]


# Like real Qwen3 templates: contents are trimmed, so the template's text resumes after the content.
TRIMMING_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content|trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)


def test_mask_follows_a_template_that_trims_contents(tokenizer: Any, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", TRIMMING_TEMPLATE)
    messages = chat(
        ("user", "Count from 3 to 5. "),
        ("assistant", " 3 4 5.\n"),
        ("user", "Spell cat."),
        ("assistant", "c a t"),
    )
    input_ids, loss_mask = tokenize_chat(tokenizer, messages, max_length=128)
    learned = tokenizer.convert_ids_to_tokens([t for t, m in zip(input_ids, loss_mask, strict=True) if m])
    assert learned == ["▁3", "▁4", "▁5", ".", "<|im_end|>", "▁c", "▁a", "▁t", "<|im_end|>"]


# ----------------------------------------------------------------------------------------
# bad records

BAD_RECORDS = {
    "malformed JSON": '{"messages": [',
    "unknown record format": json.dumps({"conversation": []}),
    '"messages" must be a list': json.dumps({"messages": "hi"}),
    'message 1 has no "role"': json.dumps({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}),
    'message 0 has no "content"': json.dumps({"messages": [{"role": "assistant"}]}),
    '"content" must be a string': json.dumps({"messages": [{"role": "assistant", "content": ["b"]}]}),
    "content parts of type": json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ),
    "empty conversation": json.dumps({"messages": []}),
    "no assistant turn": record(("user", "Count from 3 to 5.")),
}


@pytest.mark.parametrize("reason", list(BAD_RECORDS))
def test_parse_record_names_each_bad_kind(tokenizer: Any, reason: str) -> None:
    with pytest.raises(BadRecord, match=reason) as caught:
        parse_record(BAD_RECORDS[reason], "d.jsonl", 12, tokenizer, max_length=32)
    assert (caught.value.path, caught.value.line) == ("d.jsonl", 12)
    assert str(caught.value).startswith("d.jsonl:12: ")


def test_other_spellings_of_a_chat_give_the_same_sample(tokenizer: Any) -> None:
    """OpenAI-style text parts (joined with newlines, as vLLM joins them), an assistant turn that
    only calls a tool (content null), and the ShareGPT dumps' assistants named by model."""
    parts = [{"type": "text", "text": "Count from 3"}, {"type": "text", "text": "to 5."}]
    spellings = {
        "parts": {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "3 4 5."}]},
        "string": {"messages": chat(("user", "Count from 3\nto 5."), ("assistant", "3 4 5."))},
        "chatgpt": {"conversations": [{"from": "human", "value": "Count from 3\nto 5."},
                                      {"from": "chatgpt", "value": "3 4 5."}]},
    }  # fmt: skip
    samples = {
        name: parse_record(json.dumps(obj), "d.jsonl", 1, tokenizer, 64) for name, obj in spellings.items()
    }
    for sample in samples.values():
        assert sample.input_ids == samples["string"].input_ids
        assert sample.loss_mask == samples["string"].loss_mask
    tool_call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f"}}],
    }
    turns = [{"role": "user", "content": "Count."}, tool_call, {"role": "assistant", "content": "3 4 5."}]
    assert any(parse_record(json.dumps({"messages": turns}), "d.jsonl", 1, tokenizer, 64).loss_mask)


def bad_file(tmp_path: Path) -> Path:
    """Each bad kind after a good record and a blank line: bad record k sits on line 3k+3."""
    lines = []
    for bad in BAD_RECORDS.values():
        lines += [GOOD, "", bad]
    return write_jsonl(tmp_path / "mixed.jsonl", lines)


def reader_for(path: Path, tokenizer: Any, on_bad_record: str, micro_batch_size: int = 1) -> MicroBatchReader:
    return MicroBatchReader(JsonlIndex([path]), tokenizer, 32, on_bad_record, micro_batch_size, 0, LOGGER)


def test_skip_drops_counts_per_epoch_and_logs_each_bad_record_once(
    tokenizer: Any, tmp_path: Path, caplog
) -> None:
    path = bad_file(tmp_path)
    reader = reader_for(path, tokenizer, "skip")
    per_epoch = reader.order.per_epoch
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        batches = [reader.read(m) for m in range(2 * per_epoch)]  # two epochs: logged once all the same
    assert reader.bad_records == 2 * len(BAD_RECORDS)  # counted once per epoch
    assert sum(b.num_sequences for b in batches) == 2 * len(BAD_RECORDS)
    empty = [b for b in batches if b.num_sequences == 0]
    assert all(tuple(b.input_ids.shape) == (0, 0) and b.lengths.numel() == 0 for b in empty)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(BAD_RECORDS)
    for k, reason in enumerate(BAD_RECORDS):
        assert any(f"{path}:{3 * k + 3}: " in m and reason in m for m in messages), reason


@pytest.mark.parametrize(
    "reason", ["malformed JSON", 'message 1 has no "role"', "empty conversation", "no assistant turn"]
)
def test_fail_raises_data_error_with_file_and_line(tokenizer: Any, tmp_path: Path, reason: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, next(v for k, v in BAD_RECORDS.items() if reason in k)])
    reader = reader_for(path, tokenizer, "fail", micro_batch_size=2)
    with pytest.raises(DataError, match=reason) as caught:
        reader.read(0)
    assert f"{path}:2: " in str(caught.value) and "data.on_bad_record=skip" in str(caught.value)


# ----------------------------------------------------------------------------------------
# index


def test_empty_data_set_names_the_files_and_the_fix(tmp_path: Path) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "   ", "\t"])
    with pytest.raises(DataError, match="data.train_files") as caught:
        JsonlIndex([empty, blank])
    assert str(empty) in str(caught.value) and str(blank) in str(caught.value)
    with pytest.raises(DataError, match="missing.jsonl"):
        JsonlIndex([tmp_path / "missing.jsonl"])


@pytest.mark.parametrize("layout", ["indented", "one line"])
def test_a_json_array_is_refused_naming_the_conversion(tmp_path: Path, layout: str) -> None:
    records = [json.loads(GOOD)] * 3
    text = json.dumps(records, indent=2 if layout == "indented" else None)
    path = tmp_path / "data.json"
    path.write_text(text + "\n")
    with pytest.raises(DataError, match="one JSON array, not JSON Lines") as caught:
        JsonlIndex([path])
    assert f"jq -c '.[]' {path} > {tmp_path / 'data.jsonl'}" in str(caught.value)


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (gzip.compress, r"gzip-compressed, not JSON Lines text: decompress it \(`gunzip -k "),
        (lambda data: data.decode().encode("utf-16"), "UTF-16 text: re-encode it as UTF-8"),
    ],
)
def test_a_compressed_or_utf16_file_is_refused_naming_the_fix(
    tmp_path: Path, encode: Any, message: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(encode((GOOD + "\n").encode() * 3))
    with pytest.raises(DataError, match=message):
        JsonlIndex([path])


def test_index_reads_records_with_their_line_numbers(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", ["", '{"x": 1}', "  ", '{"x": "é"}'])
    b = write_jsonl(tmp_path / "b.jsonl", ['{"x": 3}'])
    index = JsonlIndex([a, b])
    assert len(index) == 3
    assert [index.read(i) for i in range(3)] == [
        (str(a), 2, '{"x": 1}\n'),
        (str(a), 4, '{"x": "é"}\n'),
        (str(b), 1, '{"x": 3}\n'),
    ]


# ----------------------------------------------------------------------------------------
# order


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    first = epoch_permutation(100, seed=3, epoch=0)
    torch.manual_seed(999)  # global RNG state must not leak in
    torch.rand(10)
    assert epoch_permutation(100, seed=3, epoch=0) == first
    assert sorted(first) == list(range(100))
    assert epoch_permutation(100, seed=3, epoch=1) != first
    assert epoch_permutation(100, seed=4, epoch=0) != first


def test_micro_batches_walk_epochs_and_drop_the_tail() -> None:
    num_records, size, seed = 10, 3, 5
    assert micro_batches_per_epoch(num_records, size) == 3
    order = DataOrder(num_records, size, seed)
    for m in range(7):
        assert order.records(m) == records_of_micro_batch(m, num_records, size, seed)
    epoch1 = [order.records(m) for m in range(3, 6)]
    assert {epoch for epoch, _ in epoch1} == {1}
    assert sum((ids for _, ids in epoch1), []) == epoch_permutation(num_records, seed, 1)[:9]
    with pytest.raises(DataError, match="train.micro_batch_size"):
        micro_batches_per_epoch(2, 3)


# ----------------------------------------------------------------------------------------
# micro-batches


def test_micro_batch_is_right_padded_with_lengths(tokenizer: Any, tmp_path: Path) -> None:
    lines = [
        record(("user", "Count from 1 to 9."), ("assistant", "1 2 3 4 5 6 7 8 9.")),
        record(("user", "Spell cat."), ("assistant", "c a t")),
        record(("system", "You are a patient teacher."), ("user", "What is 2 plus 1?"), ("assistant", "3.")),
    ]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    reader = MicroBatchReader(JsonlIndex([path]), tokenizer, 64, "fail", 3, 0, LOGGER)
    batch = reader.read(4)
    epoch, record_ids = records_of_micro_batch(4, 3, 3, 0)
    assert (batch.index, batch.epoch, batch.sample_ids.tolist()) == (4, epoch, record_ids)
    assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.uint8
    expected = [tokenize_chat(tokenizer, json.loads(lines[i])["messages"], 64) for i in record_ids]
    assert batch.lengths.tolist() == [len(ids) for ids, _ in expected]
    assert batch.input_ids.shape == (3, max(batch.lengths.tolist()))
    for row, (ids, mask) in enumerate(expected):
        n = len(ids)
        assert batch.input_ids[row, :n].tolist() == ids and batch.loss_mask[row, :n].tolist() == mask
        assert (batch.input_ids[row, n:] == tokenizer.pad_token_id).all() and not batch.loss_mask[
            row, n:
        ].any()


def test_reading_a_micro_batch_reads_only_its_records(tokenizer: Any, tmp_path: Path, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 20)
    reader = MicroBatchReader(JsonlIndex([path]), tokenizer, 64, "fail", 4, 1, LOGGER)
    read_ids: list[int] = []
    original = JsonlIndex.read_bytes

    def spy(self: JsonlIndex, i: int) -> tuple[str, int, bytes]:
        read_ids.append(i)
        return original(self, i)

    monkeypatch.setattr(JsonlIndex, "read_bytes", spy)
    reader.read(7)
    assert read_ids == records_of_micro_batch(7, 20, 4, 1)[1]


def test_collate_pads_to_a_multiple_and_keeps_lengths():
    samples = [Sample(sample_id=i, input_ids=[5] * n, loss_mask=[1] * n) for i, n in enumerate((3, 70))]
    batch = collate(0, 0, samples, pad_id=0, pad_to_multiple=64)
    assert batch.input_ids.shape == (2, 128)
    assert batch.lengths.tolist() == [3, 70]
    assert int(batch.loss_mask.sum()) == 73 and int(batch.input_ids[0, 3:].sum()) == 0
