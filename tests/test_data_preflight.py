"""The preflight's data check: a sample read through the real tokenizer, failing before any worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflash_mp import embedded
from dflash_mp.config.schema import compose_config
from dflash_mp.data import ChatRenderer, DataError, JsonlIndex, load_tokenizer
from dflash_mp.data.preflight import Scoring, judge, sample_ids, sample_report
from dflash_mp.launch import doctor

TARGET = embedded.embedded_path("target")
SCORING = Scoring(block_size=8)


def record(user: str, assistant: str) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
    )


GOOD = record("Count from 3 to 5.", "3 4 5.")
LONG = record("Count from 1 to 30.", " ".join(str(i) for i in range(1, 31)))


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(load_tokenizer(TARGET))


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_report_counts_reasons_lengths_and_truncations(renderer: ChatRenderer, tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", [GOOD, "{", GOOD, LONG, '{"prompt": "x"}', GOOD, "{"])
    report = sample_report(
        JsonlIndex([path]), renderer, max_length=32, on_too_long="truncate", scoring=SCORING
    )
    assert (report.sampled, report.parsed, report.truncated) == (7, 4, 1)
    assert dict(report.bad) == {"malformed JSON": 2, "unknown format": 1}
    assert report.examples["malformed JSON"][0].startswith(f"{path}:2: ")
    (unknown,) = report.examples["unknown format"]
    assert unknown.startswith(f"{path}:5: unknown record format (keys: prompt); accepted: ")
    assert report.histogram().endswith(">32: 1") and len(report.scored_tokens) == 4
    text = report.summary()
    assert "4 of 7 sampled records usable" in text and "1 truncated" in text and f"{path}:5" in text
    assert judge(report, max_bad_fraction=0.5, on_bad_record="skip") is None
    assert "above data.max_bad_fraction=0.05" in judge(report, max_bad_fraction=0.05, on_bad_record="skip")
    assert "data.on_bad_record=fail" in judge(report, max_bad_fraction=0.5, on_bad_record="fail")

    skipped = sample_report(JsonlIndex([path]), renderer, max_length=32, on_too_long="skip", scoring=SCORING)
    assert (skipped.parsed, skipped.too_long_skipped, skipped.truncated) == (3, 1, 0)


def test_no_loss_tokens_fails_even_when_bad_records_are_tolerated(
    renderer: ChatRenderer, tmp_path: Path
) -> None:
    no_answer = json.dumps(
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": ""}]}
    )
    long_prompt = record(" ".join(str(i) for i in range(1, 31)), "3.")
    path = write(tmp_path / "d.jsonl", [long_prompt, json.dumps({"text": "a b", "loss_spans": []})])
    report = sample_report(
        JsonlIndex([path]), renderer, max_length=16, on_too_long="truncate", scoring=SCORING
    )
    assert report.parsed == 0 and "no loss tokens" in report.bad
    assert "no loss tokens remain" in judge(report, max_bad_fraction=1.0, on_bad_record="skip")
    # An empty answer renders the end-of-turn token alone: a usable record that trains nothing.
    empty = sample_report(
        JsonlIndex([write(tmp_path / "e.jsonl", [no_answer] * 3)]), renderer, 32, "truncate", SCORING
    )
    assert (empty.parsed, empty.trainable) == (3, 0)
    assert "3 of 3 sampled records usable, 0 trainable" in empty.summary()
    assert "none of the 3 usable sampled records" in judge(empty, max_bad_fraction=0.0, on_bad_record="fail")


def test_sample_is_random_seeded_bounded_and_skips_known_bad_records() -> None:
    assert sample_ids(5) == [0, 1, 2, 3, 4] and sample_ids(5, exclude={1, 3}) == [0, 2, 4]
    ids = sample_ids(10_000)
    assert len(ids) == len(set(ids)) == 1000 and ids == sorted(ids) and ids == sample_ids(10_000)
    assert ids != list(range(0, 10_000, 10)) and sample_ids(10_000, seed=1) != ids
    assert not set(sample_ids(10_000, exclude=set(range(0, 10_000, 2)))) & set(range(0, 10_000, 2))


def test_doctor_fails_fast_on_an_unknown_format_naming_file_line_and_formats(tmp_path: Path) -> None:
    path = write(tmp_path / "alpaca.jsonl", [json.dumps({"instruction": "a", "output": "b"})] * 3000)
    started = time.monotonic()
    checks = doctor.preflight(
        compose_config([f"data.train_files=[{path}]", "train.device=cpu"]), tmp_path / "run"
    )
    assert time.monotonic() - started < 120  # a sample, not the whole file: generous for a loaded machine
    failed = {c.name: c.message for c in doctor.failed(checks)}
    assert set(failed) == {"data"}, failed
    assert "no record of the data is in an accepted format" in failed["data"]
    assert f"{path}:1: unknown record format (keys: instruction, output)" in failed["data"]
    assert '"conversations"' in failed["data"] and "ShareGPT" in failed["data"]


def test_doctor_reports_the_bundled_data_as_usable(tmp_path: Path) -> None:
    checks = doctor.preflight(compose_config(["train.device=cpu"]), tmp_path / "run")
    data = next(c for c in checks if c.name == "data")
    assert (
        data.ok
        and "sampled records usable" in data.message
        and "scored tokens per trainable record" in data.message
    )


def test_config_names_bad_data_fields(tmp_path: Path) -> None:
    from dflash_mp.config.schema import ConfigError
    from dflash_mp.config.validation import validate

    overrides = [
        "data.on_too_long=cut",
        "data.max_bad_fraction=1.5",
        f"data.chat_template={tmp_path / 'missing.jinja'}",
        "+data.chat_template_kwargs.enable_thinking=false",
    ]
    with pytest.raises(ConfigError) as caught:
        validate(compose_config(overrides))
    message = str(caught.value)
    assert "data.on_too_long='cut'" in message and "data.max_bad_fraction=1.5" in message
    assert "missing.jinja" in message and "chat_template_kwargs" not in message


def test_doctor_refuses_an_eval_that_cannot_fit_the_targets_context(tmp_path: Path) -> None:
    base = ["train.device=cpu", "eval.every=5"]
    checks = doctor.preflight(compose_config([*base, "eval.max_new_tokens=500"]), tmp_path / "run")
    failed = {c.name: c.message for c in doctor.failed(checks)}
    assert set(failed) == {"eval"}, failed
    assert "eval.max_new_tokens=500" in failed["eval"] and "max_position_embeddings=512" in failed["eval"]
    assert "eval.jsonl:" in failed["eval"] and "set eval.max_new_tokens<=" in failed["eval"]
    fits = doctor.preflight(compose_config([*base, "eval.max_new_tokens=64"]), tmp_path / "run")
    assert not doctor.failed(fits) and any(c.name == "eval" for c in fits)


def test_bad_records_between_samples_are_caught_with_or_without_packing(tmp_path: Path) -> None:
    """Every record is checked (unpacked: decoded and format-checked; packed: the packing index), so
    10% bad records that all sit between an evenly spaced sample's records fail the check."""
    lines = [GOOD] * 2000
    for i in range(1, 2000, 10):  # an evenly spaced sample of 1000 reads records 0, 2, 4, ...: never these
        lines[i] = "{"
    path = write(tmp_path / "d.jsonl", lines)
    base = [f"data.train_files=[{path}]", "train.device=cpu"]
    for packing in ("false", "true"):
        checks = doctor.preflight(compose_config([*base, f"data.packing={packing}"]), tmp_path / "run")
        failed = {c.name: c.message for c in doctor.failed(checks)}
        assert set(failed) == {"data"}, (packing, failed)
        assert "200 of the 2000 records are bad (10.0%)" in failed["data"], packing
        if packing == "false":  # the packing index logs the first bad records as it meets them
            assert f"bad: 200 (malformed JSON), e.g. {path}:2: malformed JSON" in failed["data"]
    good = write(tmp_path / "good.jsonl", [GOOD] * 30)
    checks = doctor.preflight(
        compose_config([f"data.train_files=[{good}]", "train.device=cpu", "data.packing=true"]),
        tmp_path / "run",
    )
    data = next(c for c in checks if c.name == "data")
    assert data.ok and "packing: all 30 records read, 30 usable, 0 bad" in data.message


@pytest.mark.parametrize("bad_fraction", [0.10, 0.03])
@pytest.mark.parametrize("where", ["between samples", "at the start", "at the end"])
def test_doctor_and_training_agree_wherever_the_bad_records_sit(
    tmp_path: Path, where: str, bad_fraction: float
) -> None:
    """The same verdict from the preflight and from a target rank's reader reading an epoch, for bad
    records (above and below data.max_bad_fraction=0.05) spread or bunched anywhere in the file."""
    from dflash_mp.config.schema import to_dataclass
    from dflash_mp.data import open_records
    from dflash_mp.data.preflight import check_data_sample
    from dflash_mp.runtime.roles import make_reader

    n, count = 2000, round(2000 * bad_fraction)  # more records than the sample reads
    bad = {
        "between samples": range(1, n, n // count),
        "at the start": range(count),
        "at the end": range(n - count, n),
    }[where]
    path = write(tmp_path / "d.jsonl", ["{" if i in bad else GOOD for i in range(n)])
    cfg = to_dataclass(compose_config([f"data.train_files=[{path}]", "train.device=cpu"]))
    ok, message = check_data_sample(cfg)
    trained = True
    try:
        reader = make_reader(cfg, open_records([path]))
        for m in range(reader.order.per_epoch):
            reader.read(m)
    except DataError as e:
        trained = False
        assert f"{count} of the {n} records are bad" in str(e)
    assert ok == trained == (bad_fraction < 0.05), message
    assert (f"{count} of the {n} records are bad" in message) != ok


@pytest.mark.parametrize("block_size", [2, 3, 8])
def test_scored_tokens_are_the_labels_the_trainer_scores(block_size: int) -> None:
    """Scoring counts, over random loss masks, exactly the positions block_labels weights when
    every eligible anchor is drawn; under packing a record whose anchor budget is 0 scores none."""
    import torch

    from dflash_mp.objective.draft_blocks import block_labels, sample_anchors, sample_document_anchors

    gen = torch.Generator().manual_seed(block_size)
    for trial in range(60):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        mask = (torch.rand(1, n, generator=gen) < 0.6).to(torch.uint8)
        lengths, ids = torch.tensor([n]), torch.arange(n)[None]
        anchors, valid = sample_anchors(mask, lengths, torch.tensor([trial]), 0, 0, num_anchors=n)
        _, weights = block_labels(ids, mask, lengths, anchors, valid, block_size, gamma=4.0)
        scored = (anchors[:, :, None] + torch.arange(block_size))[weights > 0]
        assert Scoring(block_size).scored_tokens(mask[0].tolist()) == len(set(scored.tolist())), mask
        for num_anchors in (1, 4):  # one record alone in a packed row of 16 tokens
            documents = torch.full((1, n), trial)
            args = (mask, lengths, documents, 0, 0, num_anchors, 16)
            _, packed_valid = sample_document_anchors(*args)
            packed = Scoring(block_size, packed_anchors=num_anchors, max_length=16)
            assert (packed.scored_tokens(mask[0].tolist()) > 0) == bool(packed_valid.any()), (
                mask,
                num_anchors,
            )
