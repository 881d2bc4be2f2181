"""Sequence packing (data.packing): whole records packed into rows of at most data.max_length tokens.

The rule (docs/data.md, Packing):
- every record's token count is read once (`record_lengths`, cached on disk per data, tokenizer,
  template and length settings), which is also a full validity pass over the data;
- an epoch takes the usable records in its topology-free order (`epoch_permutation`), cuts it
  into windows of `PACKING_WINDOW` records, and packs each window best-fit decreasing: longest
  record first, each into the open row it fills most tightly, a new row when none has room;
- a window's rows are shuffled (seeded by seed, epoch and window), so long and short rows mix;
- micro-batch m of an epoch is rows [j*B, (j+1)*B) of that epoch; a tail of rows that fills no
  micro-batch is dropped, as unpacked epochs drop a tail of records.
Everything is a pure function of (seed, epoch) and the data: the same for any number of ranks.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import logging
import os
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_mp.data.errors import BadRecord, DataError
from dflash_mp.data.order import epoch_permutation
from dflash_mp.data.samples import TooLong, parse_record
from dflash_mp.embedded import cache_dir

# Records packed together: large enough that best-fit leaves rows ~99% full, small enough that a
# window's rows are spread over a short stretch of the epoch's order.
PACKING_WINDOW = 1024
_FORMAT = 2  # bump when the cached index's meaning changes, or which records data/records.py accepts
PROGRESS_EVERY = 20_000

USABLE, TRUNCATED, TOO_LONG, BAD = 0, 1, 2, 3


@dataclass
class RecordLengths:
    """Token count of every record as training reads it (0 where it is not used) and its status."""

    lengths: array  # 'i': tokens after truncation; 0 for bad and skipped records
    status: array  # 'b': USABLE, TRUNCATED, TOO_LONG or BAD

    def count(self, status: int) -> int:
        return sum(1 for s in self.status if s == status)

    @property
    def usable(self) -> int:
        return sum(1 for n in self.lengths if n > 0)


def measure_lengths(
    records: Any, parse: Any, on_bad_record: str, logger: logging.Logger, progress: Any = None
) -> RecordLengths:
    """Parse every record once. `parse(raw, path, line, record_id)` -> Sample, or raises
    BadRecord/TooLong (data.samples.parse_record with the job's tokenizer and settings);
    `progress()` is called every PROGRESS_EVERY records (a rank's heartbeat: large data takes minutes)."""
    lengths, status = array("i"), array("b")
    logged = 0
    for i in range(len(records)):
        if i and i % PROGRESS_EVERY == 0:
            logger.info("packing: %d of %d records read", i, len(records))
            if progress is not None:
                progress()
        path, line, raw = records.read_bytes(i)
        try:
            sample = parse(raw, path, line, i)
        except TooLong:
            lengths.append(0)
            status.append(TOO_LONG)
            continue
        except BadRecord as bad:
            if on_bad_record == "fail":
                raise DataError(f"{bad} (set data.on_bad_record=skip to skip such records)") from None
            if logged < 5:
                logger.warning("packing: bad record %s (skipped in every epoch)", bad)
            logged += 1
            lengths.append(0)
            status.append(BAD)
            continue
        lengths.append(len(sample.input_ids))
        status.append(TRUNCATED if sample.truncated else USABLE)
    return RecordLengths(lengths, status)


def lengths_cache_key(paths: Sequence[str], renderer: Any, settings: dict[str, Any]) -> str:
    """What decides every record's length: the files as they are now, the tokenizer, the chat
    template and its arguments, and the length settings."""
    files = []
    for path in paths:
        stat = os.stat(path) if os.path.exists(path) else None
        files.append([os.path.abspath(path), stat.st_size if stat else 0, stat.st_mtime_ns if stat else 0])
    tokenizer = renderer.tokenizer
    identity = {
        "format": _FORMAT,
        "files": files,
        "tokenizer": [str(getattr(tokenizer, "name_or_path", "")), len(tokenizer)],
        "template": renderer.chat_template or getattr(tokenizer, "chat_template", None) or "",
        "template_kwargs": renderer.template_kwargs,
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_lengths(cache: Path, key: str, build: Any, progress: Any = None) -> RecordLengths:
    """The index under `cache/key`, built by `build()` once: the first process of a node builds
    it under a file lock, the others wait and read it (calling `progress()` while they wait).
    Written to a temporary file and renamed."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{key}.lengths"
    with open(cache / f"{key}.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if progress is not None:
                    progress()
                time.sleep(1.0)
        if path.is_file():
            return _read_lengths(path)
        result = build()
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        with open(temporary, "wb") as f:
            f.write(len(result.lengths).to_bytes(8, "little"))
            f.write(result.lengths.tobytes())
            f.write(result.status.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        return result


def _read_lengths(path: Path) -> RecordLengths:
    data = path.read_bytes()
    count = int.from_bytes(data[:8], "little")
    lengths, status = array("i"), array("b")
    itemsize = lengths.itemsize
    lengths.frombytes(data[8 : 8 + count * itemsize])
    status.frombytes(data[8 + count * itemsize : 8 + count * itemsize + count])
    if len(lengths) != count or len(status) != count:
        raise DataError(f"{path}: a damaged packing index; delete it and rerun")
    return RecordLengths(lengths, status)


# ------------------------------------------------------------------------------ the rows of an epoch


def best_fit_decreasing(record_ids: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of `record_ids`, each at most `capacity` tokens: longest first, each into the open row
    it leaves least room in (ties: the earliest row), a new row when none has room."""
    ordered = sorted(record_ids, key=lambda r: -lengths[r])  # stable: ties keep the epoch's order
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for record in ordered:
        need = lengths[record]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            rows.append([record])
            room, row = capacity - need, len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(record)
            room -= need
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


def _window_generator(seed: int, epoch: int, window: int) -> torch.Generator:
    digest = hashlib.sha256(f"dflash_mp:packing:{seed}:{epoch}:{window}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def pack_epoch(
    lengths: Sequence[int], seed: int, epoch: int, capacity: int, window: int = PACKING_WINDOW
) -> list[list[int]]:
    """The packed rows of one epoch: lists of record ids, in the order micro-batches take them."""
    order = [r for r in epoch_permutation(len(lengths), seed, epoch) if lengths[r] > 0]
    rows: list[list[int]] = []
    for w, start in enumerate(range(0, len(order), window)):
        packed = best_fit_decreasing(order[start : start + window], lengths, capacity)
        shuffle = torch.randperm(len(packed), generator=_window_generator(seed, epoch, w)).tolist()
        rows.extend(packed[i] for i in shuffle)
    return rows


class PackedOrder:
    """Micro-batch m -> (epoch, rows of record ids): DataOrder's role for packed data.

    Epochs hold different numbers of rows, so m is placed by the epochs' cumulative counts,
    computed as m reaches them (m only increases on a rank; `micro_batches(epochs)` packs ahead).
    """

    def __init__(self, lengths: Sequence[int], capacity: int, micro_batch_size: int, seed: int) -> None:
        self.lengths, self.capacity = lengths, capacity
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self._starts = [0]  # first micro-batch index of each epoch computed so far
        self._rows: dict[int, list[list[int]]] = {}
        if not any(n > 0 for n in lengths):
            raise DataError("no usable record to pack: every record is bad or too long")

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        if epoch not in self._rows:
            self._rows = {epoch: pack_epoch(self.lengths, self.seed, epoch, self.capacity)}
        return self._rows[epoch]

    def _extend_to(self, epoch: int) -> None:
        while len(self._starts) <= epoch + 1:
            e = len(self._starts) - 1
            per_epoch = len(self._epoch_rows(e)) // self.micro_batch_size
            if per_epoch == 0:
                raise DataError(
                    f"the data packs into {len(self._epoch_rows(e))} row(s) of data.max_length="
                    f"{self.capacity} tokens, fewer than one micro-batch of {self.micro_batch_size}: "
                    "add data or lower train.micro_batch_size"
                )
            self._starts.append(self._starts[-1] + per_epoch)

    def micro_batches(self, epochs: int) -> int:
        """Micro-batches in the first `epochs` epochs."""
        self._extend_to(epochs - 1)
        return self._starts[epochs]

    def records(self, m: int) -> tuple[int, list[list[int]]]:
        epoch = 0
        while True:
            self._extend_to(epoch)
            if m < self._starts[epoch + 1]:
                break
            epoch += 1
        j = m - self._starts[epoch]
        size = self.micro_batch_size
        return epoch, self._epoch_rows(epoch)[j * size : (j + 1) * size]

    def first_of_epoch(self, m: int) -> bool:
        epoch, _ = self.records(m)
        return m == self._starts[epoch]


def job_lengths(
    records: Any, renderer: Any, data_cfg: Any, logger: logging.Logger, progress: Any = None
) -> RecordLengths:
    """The packing index of a job's training data (cached; see `cached_lengths`), with the job's
    bad-record rules applied to the whole data at once."""
    settings = {"max_length": data_cfg.max_length, "on_too_long": data_cfg.on_too_long}

    def parse(raw: bytes, path: str, line: int, record_id: int) -> Any:
        return parse_record(
            raw, path, line, renderer.tokenizer, data_cfg.max_length, record_id,
            renderer=renderer, on_too_long=data_cfg.on_too_long,
        )  # fmt: skip

    def build() -> RecordLengths:
        logger.info("packing: reading the token count of all %d records (once; cached)", len(records))
        return measure_lengths(records, parse, data_cfg.on_bad_record, logger, progress)

    key = lengths_cache_key(records.paths, renderer, settings)
    lengths = cached_lengths(cache_dir() / "packing", key, build, progress)
    bad = lengths.count(BAD)
    if data_cfg.on_bad_record == "fail" and bad:
        raise DataError(f"{bad} bad record(s) in the training data and data.on_bad_record=fail: see doctor")
    if bad > data_cfg.max_bad_fraction * len(records):
        raise DataError(
            f"{bad} of the {len(records)} records are bad ({bad / len(records):.1%}), above "
            f"data.max_bad_fraction={data_cfg.max_bad_fraction}: fix the data (`python -m dflash_mp.launch "
            "doctor` lists examples with file:line) or raise data.max_bad_fraction"
        )
    return lengths
