"""The data check of the preflight: every record checked, a sample read through the real tokenizer.

Every record is decoded and checked for an accepted format (dflash_mp.data.validity, no tokenizer;
with data.packing the packing index, which tokenizes every record, takes its place), so malformed
records are counted wherever they sit. A random sample of the well-formed ones (SAMPLE_SIZE, or all
when fewer; seeded by train.seed) is parsed exactly as the target ranks will parse it, and its labels
counted where the drafter's trainer scores them; the report says what the data holds, how sure the
sample is, and the check fails, before any worker starts, when training would stop on it or learn
from nothing.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash_mp.data.chat import ChatRenderer, load_renderer
from dflash_mp.data.errors import BadRecord, DataError
from dflash_mp.data.samples import TooLong, parse_record
from dflash_mp.data.sources import Records, open_records
from dflash_mp.data.validity import FullPass, full_pass, upper_bound

SAMPLE_SIZE = 1000
EXAMPLES_PER_REASON = 3
# Upper edges of the length histogram, as fractions of data.max_length.
HISTOGRAM_EDGES = (0.25, 0.5, 0.75, 1.0)
# Continuation lines of the report line up under the message column of `doctor`'s output.
INDENT = " " * 16


@dataclass(frozen=True)
class Scoring:
    """Where the trainer scores labels (dflash_mp.objective.draft_blocks): an anchor p is a response
    token at p >= 1 whose next token is a response token too; it scores the response tokens at
    p + 1 .. p + block_size - 1. Under data.packing a record of n tokens gets
    num_anchors * n // max_length anchors, none when that is 0."""

    block_size: int
    packed_anchors: int | None = None  # data.num_anchors when data.packing, else None
    max_length: int = 1

    def scored_tokens(self, loss_mask: list[int]) -> int:
        """How many of the record's tokens some anchor scores."""
        if self.packed_anchors is not None and self.packed_anchors * len(loss_mask) // self.max_length == 0:
            return 0
        scored, last_anchor = 0, None
        for q in range(1, len(loss_mask)):
            if loss_mask[q] and last_anchor is not None and q - last_anchor < self.block_size:
                scored += 1
            if q + 1 < len(loss_mask) and loss_mask[q] and loss_mask[q + 1]:
                last_anchor = q
        return scored


@dataclass
class SampleReport:
    """What a sample of the data holds, read the way training reads it."""

    total_records: int
    max_length: int
    parsed: int = 0
    truncated: int = 0
    too_long_skipped: int = 0
    # Per usable record: the tokens the trainer scores (Scoring); 0 for one it learns nothing from.
    scored_tokens: list[int] = field(default_factory=list)
    # Full token lengths, before truncation (so the histogram shows how much is cut).
    lengths: list[int] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)  # kind -> count
    # kind -> the first bad record in full ("file:line: reason"), then only where others are.
    examples: dict[str, list[str]] = field(default_factory=dict)
    # Every record checked before the sample (None: the sample alone); the sample is drawn from
    # the records it found well-formed.
    full: FullPass | None = None

    def add_bad(self, bad: BadRecord) -> None:
        self.bad[bad.kind] += 1
        examples = self.examples.setdefault(bad.kind, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(str(bad) if not examples else f"{bad.path}:{bad.line}")

    @property
    def sampled(self) -> int:
        return self.parsed + self.too_long_skipped + sum(self.bad.values())

    @property
    def bad_fraction(self) -> float:
        """The data's estimated fraction of bad records: the full pass's, plus the sample's share
        of the records it left (those it found well-formed, and those beyond its bound)."""
        sampled = sum(self.bad.values()) / max(self.sampled, 1)
        if self.full is None:
            return sampled
        return self.full.bad_fraction + (1 - self.full.bad_fraction) * sampled

    def confidence(self) -> str:
        """How sure the sample is of the fraction it found (95%, Wilson)."""
        bad = sum(self.bad.values())
        among = "well-formed records" if self.full is not None else "records"
        return (
            f"sample: {bad} of {self.sampled} unusable ({bad / max(self.sampled, 1):.1%}); with 95% "
            f"confidence at most {upper_bound(bad, self.sampled):.1%} of the {among} are"
        )

    def histogram(self) -> str:
        edges = [round(f * self.max_length) for f in HISTOGRAM_EDGES]
        counts = [0] * (len(edges) + 1)
        for length in self.lengths:
            counts[next((k for k, edge in enumerate(edges) if length <= edge), len(edges))] += 1
        labels = [f"<={edge}" for edge in edges] + [f">{self.max_length}"]
        return ", ".join(f"{label}: {count}" for label, count in zip(labels, counts, strict=True))

    @property
    def trainable(self) -> int:
        return sum(1 for tokens in self.scored_tokens if tokens)

    def summary(self) -> str:
        lines = self.full.summary() if self.full is not None else []
        drawn = "random well-formed" if self.full is not None else "random"
        lines.append(
            f"{self.parsed} of {self.sampled} sampled records usable, {self.trainable} trainable "
            f"({drawn} records of the {self.total_records} in the data)"
        )
        if self.sampled:
            lines.append(self.confidence())
        if self.trainable:
            tokens = sorted(t for t in self.scored_tokens if t)
            lines.append(
                f"scored tokens per trainable record: mean {sum(tokens) / len(tokens):.0f}, min {tokens[0]}, "
                f"median {tokens[len(tokens) // 2]}, max {tokens[-1]}"
            )
        if self.trainable < self.parsed:
            lines.append(
                f"{self.parsed - self.trainable} usable record(s) give the trainer nothing to score: "
                "an answer needs two tokens in a row (the end-of-turn token alone gives no anchor)"
            )
        if self.lengths:
            lines.append(f"tokens per record vs data.max_length={self.max_length}: {self.histogram()}")
        if self.truncated or self.too_long_skipped:
            lines.append(f"too long: {self.truncated} truncated, {self.too_long_skipped} skipped")
        for kind, count in self.bad.most_common():
            first, *others = self.examples[kind]
            also = f" (also {', '.join(others)})" if others else ""
            lines.append(f"skipped {count} ({kind}), e.g. {first}{also}")
        return "\n".join(lines)


def sample_ids(
    num_records: int, size: int = SAMPLE_SIZE, seed: int = 0, exclude: set[int] | frozenset = frozenset()
) -> list[int]:
    """`size` record indices drawn at random (seeded), none of `exclude`; all the others when fewer."""
    if num_records - len(exclude) <= size:
        return [i for i in range(num_records) if i not in exclude]
    rng, chosen = random.Random(seed), set()
    while len(chosen) < size:
        i = rng.randrange(num_records)
        if i not in exclude:
            chosen.add(i)
    return sorted(chosen)


def sample_report(
    index: Records,
    renderer: ChatRenderer,
    max_length: int,
    on_too_long: str,
    scoring: Scoring,
    size: int = SAMPLE_SIZE,
    *,
    seed: int = 0,
    full: FullPass | None = None,
) -> SampleReport:
    """The sample's report; `full`: the pass over every record (the sample skips its bad ones)."""
    report = SampleReport(total_records=len(index), max_length=max_length, full=full)
    tokenizer = renderer.tokenizer
    for record_id in sample_ids(len(index), size, seed, full.bad_ids if full is not None else frozenset()):
        path, line, raw = index.read_bytes(record_id)
        try:
            # Parsed whole (no limit) for the length histogram, then cut the way training cuts.
            sample = parse_record(raw, path, line, tokenizer, 1 << 62, record_id, renderer=renderer)
        except BadRecord as bad:
            report.add_bad(bad)
            continue
        length = len(sample.input_ids)
        report.lengths.append(length)
        if length > max_length:
            try:
                sample = parse_record(
                    raw,
                    path,
                    line,
                    tokenizer,
                    max_length,
                    record_id,
                    renderer=renderer,
                    on_too_long=on_too_long,
                )
            except TooLong:
                report.too_long_skipped += 1
                continue
            except BadRecord as bad:  # nothing to learn in what truncation keeps
                report.add_bad(bad)
                continue
            report.truncated += 1
        report.parsed += 1
        report.scored_tokens.append(scoring.scored_tokens(sample.loss_mask))
    return report


def judge(report: SampleReport, max_bad_fraction: float, on_bad_record: str) -> str | None:
    """Why training on this data must not start (None: it may)."""
    bad = sum(report.bad.values())
    full = report.full
    if full is not None and full.bad["unknown format"] == full.checked:
        return "no record of the data is in an accepted format"
    if "unknown format" in report.bad and report.bad["unknown format"] == report.sampled:
        return "no record of the sample is in an accepted format"
    if full is not None and full.bad_count and on_bad_record == "fail":
        return (
            f"{full.bad_count} bad record(s) in the data and data.on_bad_record=fail: fix them or set "
            "data.on_bad_record=skip"
        )
    if bad and on_bad_record == "fail":
        return f"{bad} bad record(s) in the sample and data.on_bad_record=fail: fix them or set data.on_bad_record=skip"
    fix = f"above data.max_bad_fraction={max_bad_fraction}: fix the data or raise data.max_bad_fraction"
    if full is not None and full.bad_fraction > max_bad_fraction:  # what training's reader says too
        checked = f"the {full.checked}" if full.complete else f"the first {full.checked}"
        return f"{full.bad_count} of {checked} records are bad ({full.bad_fraction:.1%}), {fix}"
    if report.bad_fraction > max_bad_fraction:
        where = "" if full is None else f"{full.bad_count} of the {full.checked} records are bad and "
        return (
            f"{where}{bad} of {report.sampled} sampled records are unusable: about {report.bad_fraction:.1%} "
            f"of the data, {fix}"
        )
    if not report.parsed:
        return "no loss tokens remain in the sample: training would learn nothing (see the reasons above)"
    if not report.trainable:
        return (
            f"none of the {report.parsed} usable sampled records gives the trainer a token to score: "
            "every answer is empty or one token (an anchor needs a response token followed by another): "
            "fix or regenerate the answers"
        )
    return None


def check_data_sample(cfg: Any) -> tuple[bool, str]:
    """The preflight's data check for a RootConfig: (ok, report and verdict)."""
    d = cfg.data
    try:
        index = open_records(list(d.train_files))
        renderer = load_renderer(
            cfg.model.target_path, cfg.model.trust_remote_code, d.chat_template, d.chat_template_kwargs
        )
        scoring = Scoring(cfg.model.block_size, d.num_anchors if d.packing else None, d.max_length)
        # data.packing: the packing index reads every record (tokenized): no second pass.
        packed, full = packing_pass(index, renderer, cfg) if d.packing else (None, full_pass(index))
        report = sample_report(
            index, renderer, d.max_length, d.on_too_long, scoring, seed=cfg.train.seed, full=full
        )
    except DataError as e:
        return False, str(e)
    except Exception as e:  # e.g. a tokenizer that does not load: the target check names the cause
        return False, f"cannot read the data through the target's tokenizer: {type(e).__name__}: {e}"
    problem = judge(report, d.max_bad_fraction, d.on_bad_record)
    lines = ([] if problem is None else [problem]) + report.summary().splitlines()
    if packed is not None:
        lines.append(packed)
    return problem is None, f"\n{INDENT}".join(lines)


def packing_pass(index: Records, renderer: ChatRenderer, cfg: Any) -> tuple[str, FullPass]:
    """data.packing: every record read once (the job's cached packing index; DataError where the job
    would stop on it), epoch 0's rows, and the index's bad records as the full pass."""
    import logging
    import time

    from dflash_mp.data import packing

    started = time.monotonic()
    lengths = packing.job_lengths(index, renderer, cfg.data, logging.getLogger(__name__))
    seconds = time.monotonic() - started
    rows = packing.pack_epoch(lengths.lengths, cfg.train.seed, 0, cfg.data.max_length)
    fill = sum(lengths.lengths) / max(1, len(rows) * cfg.data.max_length)
    bad_ids = {i for i, status in enumerate(lengths.status) if status == packing.BAD}
    full = FullPass(len(index), len(index), seconds=seconds, source="read by the packing index")
    for record_id in sorted(bad_ids):  # the index keeps no reasons: the first few are read again
        if len(full.examples.get("bad record", [])) == EXAMPLES_PER_REASON:
            full.bad["bad record"] += 1
            full.bad_ids.add(record_id)
            continue
        path, line, raw = index.read_bytes(record_id)
        try:
            d = cfg.data
            parse_record(
                raw, path, line, renderer.tokenizer, d.max_length, record_id,
                renderer=renderer, on_too_long=d.on_too_long,
            )  # fmt: skip
            bad = BadRecord(path, line, "bad when the packing index was built", "bad record")
        except BadRecord as e:
            bad = BadRecord(e.path, e.line, e.reason, "bad record")
        full.add_bad(record_id, bad)
    summary = (
        f"packing: all {len(index)} records read, {lengths.usable} usable, {len(bad_ids)} bad; "
        f"{len(rows)} rows of {cfg.data.max_length} tokens per epoch, {fill:.0%} full"
    )
    return summary, full
