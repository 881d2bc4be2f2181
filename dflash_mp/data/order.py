"""Which records, in which order: a byte-offset index of the JSONL files and a topology-free order.

Data order is a pure function of (seed, epoch): micro-batch m holds the same records whatever
the number of ranks, and a rank reads only the records of the micro-batches it produces.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash_mp.data.errors import DataError, EmptyData


class JsonlIndex:
    """Byte offsets of every non-blank line of some JSONL files, so a rank reads only its records."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        self.paths = [str(path) for path in paths]
        # Flat arrays instead of a list of tuples: ~28 bytes per record for large data sets.
        self._file = array("I")
        self._offset = array("q")
        self._length = array("q")
        self._line = array("q")
        for file_index, path in enumerate(self.paths):
            first = last = b""
            try:
                with open(path, "rb") as f:
                    if problem := _not_json_lines(path, f.read(6)):
                        raise DataError(problem)
                    f.seek(0)
                    offset = 0
                    for line_number, line in enumerate(f, start=1):
                        # A byte-order mark alone on a line is blank too.
                        if text := line.removeprefix(b"\xef\xbb\xbf").strip():
                            first, last = first or text, text
                            self._file.append(file_index)
                            self._offset.append(offset)
                            self._length.append(len(line))
                            self._line.append(line_number)
                        offset += len(line)
            except OSError as e:
                raise DataError(f"{path}: cannot read data file ({e.strerror})") from e
            if first.startswith(b"[") and last.endswith(b"]"):  # no line of it is a record (an object)
                raise DataError(
                    f"{path}: one JSON array, not JSON Lines (one record per line): convert it with "
                    f"`jq -c '.[]' {path} > {Path(path).with_suffix('.jsonl')}`"
                )
        if not self._offset:
            raise EmptyData(
                f"no records in {', '.join(self.paths) or '(no files given)'}: every file is empty or blank. "
                'Point data.train_files at JSONL files with one {"messages": [...]} record per line.'
            )

    def __len__(self) -> int:
        return len(self._offset)

    def read_bytes(self, i: int) -> tuple[str, int, bytes]:
        """(path, 1-based line number, raw bytes) of record i."""
        path = self.paths[self._file[i]]
        with open(path, "rb") as f:
            f.seek(self._offset[i])
            raw = f.read(self._length[i])
        return path, self._line[i], raw

    def read(self, i: int) -> tuple[str, int, str]:
        """(path, line, text) of record i; a byte-order mark dropped, undecodable bytes become U+FFFD.

        The trainer reads with read_bytes instead, where undecodable bytes make a bad record.
        """
        path, line, raw = self.read_bytes(i)
        return path, line, raw.decode("utf-8", errors="replace").removeprefix("\ufeff")


# What a data file is when its first bytes say it is no UTF-8 text.
_MAGIC = {
    b"\x1f\x8b": ("gzip-compressed", "gunzip -k"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "zstd -d"),
    b"BZh": ("bzip2-compressed", "bunzip2 -k"),
    b"\xfd7zXZ\x00": ("xz-compressed", "unxz -k"),
    b"PK\x03\x04": ("a zip archive", "unzip"),
}


def _not_json_lines(path: str, head: bytes) -> str | None:
    """Why the file starting with `head` is not JSON Lines text at all, with the command that makes
    it so (None: it may be; its records are judged one by one)."""
    for magic, (what, command) in _MAGIC.items():
        if head.startswith(magic):
            return f"{path}: {what}, not JSON Lines text: decompress it (`{command} {path}`) and give what that writes"
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return f"{path}: UTF-16 text: re-encode it as UTF-8 (`iconv -f UTF-16 -t UTF-8 {path} > FILE.jsonl`)"
    return None


def epoch_permutation(num_records: int, seed: int, epoch: int) -> list[int]:
    """Record order of one epoch: depends on (seed, epoch) only, never on the topology."""
    # Hashing keeps (seed, epoch) pairs apart; seed*K+epoch would collide across seeds.
    digest = hashlib.sha256(f"dflash_mp:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_records, generator=generator).tolist()


def micro_batches_per_epoch(num_records: int, micro_batch_size: int) -> int:
    """Full micro-batches per epoch (the tail that does not fill one is dropped)."""
    per_epoch = num_records // micro_batch_size
    if per_epoch == 0:
        raise DataError(
            f"{num_records} record(s) cannot fill one micro-batch of {micro_batch_size}: "
            "add data or lower train.micro_batch_size"
        )
    return per_epoch


def records_of_micro_batch(
    m: int, num_records: int, micro_batch_size: int, seed: int
) -> tuple[int, list[int]]:
    """(epoch, record indices) of global micro-batch m."""
    return DataOrder(num_records, micro_batch_size, seed).records(m)


class DataOrder:
    """records_of_micro_batch with the current epoch's permutation cached (m only increases)."""

    def __init__(self, num_records: int, micro_batch_size: int, seed: int) -> None:
        self.num_records, self.micro_batch_size, self.seed = num_records, micro_batch_size, seed
        self.per_epoch = micro_batches_per_epoch(num_records, micro_batch_size)
        self._epoch, self._permutation = -1, []

    def micro_batches(self, epochs: int) -> int:
        """Micro-batches in the first `epochs` epochs."""
        return epochs * self.per_epoch

    def records(self, m: int) -> tuple[int, list[int]]:
        epoch, j = divmod(m, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._permutation = epoch, epoch_permutation(self.num_records, self.seed, epoch)
        size = self.micro_batch_size
        return epoch, self._permutation[j * size : (j + 1) * size]
