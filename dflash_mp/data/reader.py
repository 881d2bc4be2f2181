"""Records -> samples -> micro-batches: a rank reads and tokenizes only the records it produces."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from dflash_mp.data import packing
from dflash_mp.data.chat import ChatRenderer
from dflash_mp.data.errors import BadRecord, DataError
from dflash_mp.data.order import DataOrder
from dflash_mp.data.samples import Sample, TooLong, parse_record
from dflash_mp.data.sources import Records

ON_TOO_LONG = ("truncate", "skip")
# A reader judges its running bad fraction only after this many records: a few bad records early
# in a large data set must not stop the job before the fraction means anything.
MIN_RECORDS_TO_JUDGE = 200
FIX_BAD_DATA = "fix the data (`python -m dflash_mp.launch doctor` lists examples with file:line) or raise data.max_bad_fraction"


@dataclass
class MicroBatch:
    """The tokenized records of global micro-batch `index`, right-padded to the longest one."""

    index: int  # global micro-batch index m
    epoch: int
    input_ids: torch.Tensor  # int64 [B, S], padded with the tokenizer's pad id
    loss_mask: torch.Tensor  # uint8 [B, S]: 1 on assistant tokens (uint8 travels over gloo and NCCL alike)
    lengths: torch.Tensor  # int64 [B], real tokens per row
    sample_ids: torch.Tensor  # int64 [B], global record indices (of each row's first document)
    # Packed rows (data.packing): int64 [B, S], the record index of the document at each position,
    # -1 on padding (dflash_mp.models.packed_rows); None: one record per row.
    document_ids: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch on `device`. Host tensors reach a GPU through pinned memory without
        blocking: a copy from pageable memory first waits for everything queued on the device,
        which leaves the device idle while the host then prepares the next batch."""

        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)

        return replace(
            self,
            input_ids=move(self.input_ids),
            loss_mask=move(self.loss_mask),
            lengths=move(self.lengths),
            sample_ids=move(self.sample_ids),
            document_ids=move(self.document_ids),
        )


def padded_width(length: int, pad_to_multiple: int) -> int:
    """`length` rounded up to a multiple of `pad_to_multiple` (data.pad_to_multiple)."""
    return -(-length // pad_to_multiple) * pad_to_multiple


def collate(
    index: int, epoch: int, samples: list[Sample], pad_id: int, pad_to_multiple: int = 1
) -> MicroBatch:
    """Right-pad samples into a MicroBatch; no samples gives B = S = 0.

    The width is rounded up to a multiple of `pad_to_multiple`: few distinct shapes mean few
    recompilations of the compiled drafter and flex_attention masks on GPU.
    """
    lengths = [len(sample.input_ids) for sample in samples]
    width = padded_width(max(lengths, default=0), pad_to_multiple)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.uint8)
    for row, sample in enumerate(samples):
        input_ids[row, : lengths[row]] = torch.tensor(sample.input_ids, dtype=torch.long)
        loss_mask[row, : lengths[row]] = torch.tensor(sample.loss_mask, dtype=torch.uint8)
    return MicroBatch(
        index=index,
        epoch=epoch,
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_ids=torch.tensor([sample.sample_id for sample in samples], dtype=torch.long),
    )


def collate_packed(
    index: int, epoch: int, rows: list[list[Sample]], pad_id: int, pad_to_multiple: int = 1
) -> MicroBatch:
    """Rows of whole records back to back, right-padded; `document_ids` says where each one lies."""
    joined = [
        Sample(
            sample_id=row[0].sample_id,
            input_ids=[t for s in row for t in s.input_ids],
            loss_mask=[t for s in row for t in s.loss_mask],
        )
        for row in rows
    ]
    batch = collate(index, epoch, joined, pad_id, pad_to_multiple)
    document_ids = torch.full_like(batch.input_ids, -1)
    for r, row in enumerate(rows):
        at = 0
        for sample in row:
            document_ids[r, at : at + len(sample.input_ids)] = sample.sample_id
            at += len(sample.input_ids)
    batch.document_ids = document_ids
    return batch


class MicroBatchReader:
    """Reads and tokenizes only the records of the micro-batches asked for.

    Counters (records_read, bad_records, too_long_records) count every read:
    each record is read once per epoch by exactly one target rank, so their sum over the target
    ranks is the same for any number of them.
    """

    def __init__(
        self,
        index: Records,
        tokenizer: Any,
        max_length: int,
        on_bad_record: str,
        micro_batch_size: int,
        seed: int,
        logger: logging.Logger,
        pad_to_multiple: int = 1,
        *,
        renderer: ChatRenderer | None = None,
        on_too_long: str = "truncate",
        max_bad_fraction: float = 0.05,
        full: Any = None,
    ) -> None:
        """`full`: the preflight's pass over every record (data.validity.FullPass); with it the bad
        fraction is judged as the preflight judges it: the pass's bad records exactly, and only the
        others (records that fail to render) by the running count."""
        if on_bad_record not in ("skip", "fail"):
            raise ValueError(f"on_bad_record={on_bad_record!r}: must be 'skip' or 'fail'")
        if on_too_long not in ON_TOO_LONG:
            raise ValueError(f"on_too_long={on_too_long!r}: must be 'truncate' or 'skip'")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError(
                "the tokenizer has neither a pad token nor an eos token to pad micro-batches with"
            )
        self.index, self.tokenizer, self.max_length = index, tokenizer, max_length
        self.renderer = renderer or ChatRenderer(tokenizer)
        self.on_bad_record, self.on_too_long, self.max_bad_fraction = (
            on_bad_record,
            on_too_long,
            max_bad_fraction,
        )
        self.logger, self.pad_id, self.pad_to_multiple = logger, pad_id, pad_to_multiple
        self.order = DataOrder(len(index), micro_batch_size, seed)
        self.records_read = 0
        self.bad_records = 0
        self.too_long_records = 0  # longer than max_length: truncated or skipped, per on_too_long
        self._logged: set[int] = set()  # each skipped record is logged once per reader
        self.full = full
        self._unforeseen_bad = 0  # bad records read that the full pass did not find
        if full is not None and full.bad_count and on_bad_record == "fail":
            first = next(iter(full.examples.values()))[0]
            raise DataError(f"{first} (set data.on_bad_record=skip to skip such records)")
        if full is not None and full.bad_fraction > max_bad_fraction:
            raise DataError(
                f"{full.bad_count} of the {full.checked} records are bad ({full.bad_fraction:.1%}), above "
                f"data.max_bad_fraction={max_bad_fraction}: {FIX_BAD_DATA}"
            )

    def read(self, m: int) -> MicroBatch:
        epoch, record_ids = self.order.records(m)
        samples = []
        for record_id in record_ids:
            path, line, raw = self.index.read_bytes(record_id)
            self.records_read += 1
            try:
                sample = parse_record(
                    raw,
                    path,
                    line,
                    self.tokenizer,
                    self.max_length,
                    record_id,
                    renderer=self.renderer,
                    on_too_long=self.on_too_long,
                )
            except TooLong as long:
                self.too_long_records += 1
                self._log_once(record_id, "skipping too long record %s (data.on_too_long=skip)", long)
                continue
            except BadRecord as bad:
                if self.on_bad_record == "fail":
                    raise DataError(f"{bad} (set data.on_bad_record=skip to skip such records)") from None
                # Dropped, not replaced: a substitute would make the data depend on the topology.
                self.bad_records += 1
                self._unforeseen_bad += self.full is not None and record_id not in self.full.bad_ids
                self._log_once(record_id, "skipping bad record %s", bad)
                continue
            self.too_long_records += sample.truncated
            samples.append(sample)
        self._check_bad_fraction()
        return collate(m, epoch, samples, self.pad_id, self.pad_to_multiple)

    def _log_once(self, record_id: int, message: str, problem: BadRecord) -> None:
        if record_id not in self._logged:
            self._logged.add(record_id)
            self.logger.warning(message, problem)

    def _check_bad_fraction(self) -> None:
        # A data set smaller than MIN_RECORDS_TO_JUDGE: a rank's share of it says little about the
        # fraction (the preflight judged the whole of it), but once the rank has read as many records
        # as the data holds and none was usable, training would learn nothing.
        hopeless = self.records_read >= len(self.index) and self.bad_records == self.records_read
        if self.records_read < MIN_RECORDS_TO_JUDGE and not hopeless:
            return
        if self.full is not None and not hopeless:
            # The full pass's fraction is exact; the running count judges only the records it passed.
            known = self.bad_records - self._unforeseen_bad
            passed = max(self.records_read - known, 1)
            estimate = self.full.bad_fraction + (1 - self.full.bad_fraction) * self._unforeseen_bad / passed
            if estimate <= self.max_bad_fraction:
                return
            raise DataError(
                f"{self.full.bad_count} of the {self.full.checked} records are bad and {self._unforeseen_bad} of "
                f"the {passed} well-formed records this rank read cannot be used: about {estimate:.1%} of the "
                f"data, above data.max_bad_fraction={self.max_bad_fraction}: {FIX_BAD_DATA}"
            )
        if self.bad_records <= self.max_bad_fraction * self.records_read:
            return
        raise DataError(
            f"{self.bad_records} of the {self.records_read} records this rank read are bad "
            f"({self.bad_records / self.records_read:.1%}), above data.max_bad_fraction={self.max_bad_fraction}: "
            f"{FIX_BAD_DATA}"
        )


class PackedMicroBatchReader(MicroBatchReader):
    """MicroBatchReader for data.packing: micro-batch m is B rows of whole records
    (dflash_mp.data.packing), read and tokenized by the rank that produces it.

    The records a packing index marked unusable are never read; they are counted once per
    epoch, by the rank producing the epoch's first micro-batch, so the counters' sums over the
    target ranks stay the same for any number of them.
    """

    def __init__(self, *args: Any, lengths: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lengths = lengths
        self.order = packing.PackedOrder(
            lengths.lengths, self.max_length, self.order.micro_batch_size, self.order.seed
        )
        self._unusable = {
            "bad": lengths.count(packing.BAD),
            "too_long": lengths.count(packing.TOO_LONG) + lengths.count(packing.TRUNCATED),
        }

    def read(self, m: int) -> MicroBatch:
        epoch, rows = self.order.records(m)
        if self.order.first_of_epoch(m):
            self.bad_records += self._unusable["bad"]
            self.too_long_records += self._unusable["too_long"]
            self.records_read += self._unusable["bad"]
        packed = [[self._sample(record_id) for record_id in row] for row in rows]
        return collate_packed(m, epoch, packed, self.pad_id, self.pad_to_multiple)

    def _sample(self, record_id: int) -> Sample:
        path, line, raw = self.index.read_bytes(record_id)
        self.records_read += 1
        try:
            sample = parse_record(
                raw, path, line, self.tokenizer, self.max_length, record_id,
                renderer=self.renderer, on_too_long=self.on_too_long,
            )  # fmt: skip
        except BadRecord as bad:
            raise DataError(
                f"{bad}: it was usable when the packing index was built; did the file change?"
            ) from None
        if len(sample.input_ids) != self.lengths.lengths[record_id]:
            raise DataError(
                f"{path}:{line} has {len(sample.input_ids)} tokens, {self.lengths.lengths[record_id]} when the "
                "packing index was built: the data or the tokenizer changed under a running job"
            )
        return sample
