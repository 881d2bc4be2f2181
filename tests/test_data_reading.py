"""Reading records as training does: edge cases of files, too-long records, counts, the bad fraction."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dflash_mp import embedded
from dflash_mp.data import (
    MIN_RECORDS_TO_JUDGE,
    DataError,
    JsonlIndex,
    MicroBatchReader,
    load_tokenizer,
    tokenize_chat,
)

LOGGER = logging.getLogger("test_data_reading")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tokenizer")
    conversations = [
        json.loads(line)["messages"] for line in embedded.render_data()["data/train.jsonl"].splitlines()
    ]
    embedded.build_tokenizer(conversations).save_pretrained(path)
    return load_tokenizer(path)


def record(user: str, assistant: str) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
    )


GOOD = record("Count from 3 to 5.", "3 4 5.")
LONG = record("Count from 1 to 30.", " ".join(str(i) for i in range(1, 31)))


def reader_for(paths: list[Path], tokenizer: Any, on_bad_record: str = "skip", size: int = 1, **kwargs: Any):
    return MicroBatchReader(JsonlIndex(paths), tokenizer, 32, on_bad_record, size, 0, LOGGER, **kwargs)


def test_byte_order_mark_starts_a_good_record(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\n" + GOOD + "\n").encode())
    reader = reader_for([path], tokenizer, "fail", size=2)
    batch = reader.read(0)
    assert batch.num_sequences == 2 and reader.bad_records == 0


def test_undecodable_bytes_make_a_bad_record_even_under_fail(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + GOOD.replace("Count", "Co\xfcnt").encode("latin-1") + b"\n")
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8 \(byte 0xfc"):
        reader_for([path], tokenizer, "fail", size=2).read(0)
    skipping = reader_for([path], tokenizer, "skip", size=2)
    assert skipping.read(0).num_sequences == 1 and skipping.bad_records == 1


def test_deeply_nested_record_is_a_bad_record_under_skip(tokenizer: Any, tmp_path: Path) -> None:
    nested = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "deep.jsonl"
    path.write_text(GOOD + "\n" + nested + "\n")
    reader = reader_for([path], tokenizer, "skip", size=2)
    assert reader.read(0).num_sequences == 1 and reader.bad_records == 1
    with pytest.raises(DataError, match=rf"{path}:2: malformed JSON"):
        reader_for([path], tokenizer, "fail", size=2).read(0)


@pytest.mark.parametrize("epochs", [1, 3])
def test_bad_count_is_the_same_for_any_number_of_target_ranks(
    tokenizer: Any, tmp_path: Path, epochs: int
) -> None:
    """Target rank r reads micro-batches m = r, r+T, ...; the sum of their counts must not depend on T."""
    lines = [GOOD, "{", GOOD, '{"messages": []}', GOOD, "[1]", GOOD, LONG, GOOD, LONG]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    totals = {}
    for targets in (1, 2, 3):
        readers = [reader_for([path], tokenizer, size=2) for _ in range(targets)]
        for m in range(epochs * readers[0].order.per_epoch):
            readers[m % targets].read(m)
        totals[targets] = (sum(r.bad_records for r in readers), sum(r.too_long_records for r in readers))
    assert totals == {t: (3 * epochs, 2 * epochs) for t in (1, 2, 3)}


def test_truncation_keeps_the_loss_mask_aligned(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(LONG + "\n" + GOOD + "\n")
    full_ids, full_mask = tokenize_chat(tokenizer, json.loads(LONG)["messages"], max_length=10_000)
    assert len(full_ids) > 32 and any(full_mask[:32]) and any(full_mask[32:])
    reader = reader_for([path], tokenizer, "fail", size=2)
    batch = reader.read(0)
    row = batch.sample_ids.tolist().index(0)
    assert batch.lengths[row] == 32
    assert batch.input_ids[row].tolist() == full_ids[:32] and batch.loss_mask[row].tolist() == full_mask[:32]
    assert reader.too_long_records == 1 and reader.bad_records == 0

    skipping = reader_for([path], tokenizer, "fail", size=2, on_too_long="skip")
    batch = skipping.read(0)
    assert batch.sample_ids.tolist() == [1] and skipping.too_long_records == 1 and skipping.bad_records == 0


def test_truncation_that_leaves_no_loss_is_a_bad_record(tokenizer: Any, tmp_path: Path) -> None:
    long_prompt = record(" ".join(str(i) for i in range(1, 31)), "3.")
    path = tmp_path / "d.jsonl"
    path.write_text(long_prompt + "\n")
    with pytest.raises(DataError, match="no loss tokens in its first data.max_length=32 tokens"):
        reader_for([path], tokenizer, "fail").read(0)


def test_running_bad_fraction_stops_the_reader_once_it_can_judge(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join((GOOD if i % 10 else "{") + "\n" for i in range(MIN_RECORDS_TO_JUDGE + 50)))
    size = 10
    reader = reader_for([path], tokenizer, size=size, max_bad_fraction=0.05)  # 10% bad
    with pytest.raises(DataError, match=r"bad \(10\.0%\), above data.max_bad_fraction=0.05") as caught:
        for m in range(reader.order.per_epoch):
            reader.read(m)
    assert reader.records_read == MIN_RECORDS_TO_JUDGE  # not judged before
    assert "raise data.max_bad_fraction" in str(caught.value)
    tolerant = reader_for([path], tokenizer, size=size, max_bad_fraction=0.2)
    for m in range(tolerant.order.per_epoch):
        tolerant.read(m)
    assert tolerant.bad_records == (MIN_RECORDS_TO_JUDGE + 50) // 10


def test_too_long_counts_reach_the_step_metrics() -> None:
    from dflash_mp.config.schema import compose_config, to_dataclass
    from dflash_mp.data import records_of_micro_batch
    from dflash_mp.reference import reference_train

    cfg = to_dataclass(compose_config(["train.max_steps=2", "data.max_length=48", "train.device=cpu"]))
    records: list[dict] = []
    reference_train(cfg, on_step=records.append)
    index = JsonlIndex(list(cfg.data.train_files))
    tokenizer = load_tokenizer(cfg.model.target_path)
    micro_batches = 2 * cfg.train.grad_accum
    expected = 0
    for m in range(micro_batches):
        for i in records_of_micro_batch(m, len(index), cfg.train.micro_batch_size, cfg.train.seed)[1]:
            ids, _ = tokenize_chat(tokenizer, json.loads(index.read(i)[2])["messages"], 10**9)
            expected += len(ids) > 48
    assert expected > 0
    assert [r["too_long_records"] for r in records] != [0, 0]
    assert sum(r["too_long_records"] for r in records) == expected


def test_a_small_data_set_without_a_usable_record_stops_the_reader(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"  # not JSONL at all: every "line" is a bad record
    path.write_bytes(bytes(range(256)) * 8)
    reader = reader_for([path], tokenizer, size=8, max_bad_fraction=0.05)
    records = len(reader.index)
    assert records < MIN_RECORDS_TO_JUDGE
    with pytest.raises(DataError, match=r"above data.max_bad_fraction=0.05"):
        for m in range(2 * records):
            reader.read(m)
    assert reader.records_read < records + 8  # judged once it read as many as the data holds
