"""Chat JSONL data: a byte-offset index, tokenization with assistant loss masks, micro-batches.

Data order is a pure function of (seed, epoch): micro-batch m holds the same records whatever
the number of ranks, and a rank reads (and tokenizes) only the records of the micro-batches it
produces. A record is one line `{"messages": [{"role": ..., "content": ...}, ...]}`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError


class DataError(Exception):
    """A data problem the job cannot continue past; the message names file:line where it applies."""


class BadRecord(Exception):
    """One record that cannot be used; skipped or fatal depending on data.on_bad_record."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer from its local directory (never a hub); it must be fast and have a chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=trust_remote_code, local_files_only=True
    )
    if not tokenizer.is_fast:
        raise DataError(
            f"{path}: the tokenizer is not a fast tokenizer; add its tokenizer.json to the directory"
        )
    if not tokenizer.chat_template:
        raise DataError(
            f"{path}: the tokenizer has no chat template; add chat_template.jinja (or a chat_template "
            "entry in tokenizer_config.json) to the directory"
        )
    return tokenizer


# ----------------------------------------------------------------------------------------
# index


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
            try:
                with open(path, "rb") as f:
                    offset = 0
                    for line_number, line in enumerate(f, start=1):
                        if line.strip():
                            self._file.append(file_index)
                            self._offset.append(offset)
                            self._length.append(len(line))
                            self._line.append(line_number)
                        offset += len(line)
            except OSError as e:
                raise DataError(f"{path}: cannot read data file ({e.strerror})") from e
        if not self._offset:
            raise DataError(
                f"no records in {', '.join(self.paths) or '(no files given)'}: every file is empty or blank. "
                'Point data.train_files at JSONL files with one {"messages": [...]} record per line.'
            )

    def __len__(self) -> int:
        return len(self._offset)

    def read(self, i: int) -> tuple[str, int, str]:
        """(path, 1-based line number, text) of record i; undecodable bytes become U+FFFD."""
        path = self.paths[self._file[i]]
        with open(path, "rb") as f:
            f.seek(self._offset[i])
            raw = f.read(self._length[i])
        return path, self._line[i], raw.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------
# tokenization

# Private-use characters: no real content contains them and templates pass them through untouched.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")
_UNALIGNED = (
    "cannot locate the assistant contents in the chat template's rendering (the template rewrites "
    "them beyond trimming, e.g. parses <think> blocks); put reasoning in a reasoning_content field"
)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant content in it.

    Rendering once more with placeholder contents gives the template's own text around every
    message, for any template: real Qwen3 templates have no {% generation %} markers, trim
    contents, and render a prefix of a conversation differently from the whole (the <think>
    block moves), so prefix rendering cannot be trusted.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    placeholders = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    # re.split with a group alternates: template text, message index, template text, ...
    pieces = _PLACEHOLDER_RE.split(tokenizer.apply_chat_template(placeholders, tokenize=False))
    template_texts, message_indices = pieces[0::2], [int(i) for i in pieces[1::2]]
    if not (text.startswith(template_texts[0]) and text.endswith(template_texts[-1])):
        raise ValueError(_UNALIGNED)
    spans, position = [], len(template_texts[0])
    for k, (i, following) in enumerate(zip(message_indices, template_texts[1:], strict=True)):
        content = messages[i]["content"]
        if text.startswith(content + following, position):
            end = position + len(content)
        elif k == len(message_indices) - 1:
            end = len(text) - len(following)
        else:
            # The template changed the content (e.g. trimmed it): it ends where the template resumes.
            end = text.find(following, position) if following else -1
        if end < position:
            raise ValueError(_UNALIGNED)
        if messages[i]["role"] == "assistant":
            spans.append((position, end))
        position = end + len(following)
    return text, spans


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], max_length: int
) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask of a conversation rendered with the tokenizer's chat template.

    loss_mask is 1 on the tokens of assistant contents and on the special token that ends each
    of them (<|im_end|> for Qwen), 0 elsewhere. Raises ValueError when the conversation is longer
    than max_length tokens (too long is a bad record, never truncated) or cannot be masked.
    """
    text, spans = _assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = encoding["input_ids"]
    if len(input_ids) > max_length:
        raise ValueError(f"{len(input_ids)} tokens, longer than data.max_length={max_length}")
    starts = [start for start, _ in encoding["offset_mapping"]]
    ends = [end for _, end in encoding["offset_mapping"]]
    special_ids = set(tokenizer.all_special_ids)
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in spans:
        first = bisect.bisect_right(ends, span_start)  # first token reaching into the span
        after = bisect.bisect_left(starts, span_end)  # first token starting after it
        loss_mask[first:after] = [1] * max(after - first, 0)
        if after < len(input_ids) and input_ids[after] in special_ids:
            loss_mask[after] = 1  # the end-of-turn token: the drafter must learn to stop
    return input_ids, loss_mask


@dataclass
class Sample:
    """One tokenized record."""

    sample_id: int  # global record index in the JsonlIndex (-1 when it has none)
    input_ids: list[int]
    loss_mask: list[int]


def _check_messages(record: Any) -> list[dict[str, Any]]:
    """The record's messages, or ValueError saying what is wrong with them."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ValueError('missing "messages" (expected {"messages": [{"role": ..., "content": ...}, ...]})')
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ValueError(f'"messages" must be a list, got {type(messages).__name__}')
    if not messages:
        raise ValueError("empty conversation")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be an object, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f'message {i} has no "{key}"')
            if not isinstance(message[key], str):
                raise ValueError(f'message {i}: "{key}" must be a string, got {type(message[key]).__name__}')
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("no assistant turn")
    return messages


def parse_record(
    text: str, path: str, line: int, tokenizer: Any, max_length: int, sample_id: int = -1
) -> Sample:
    """Parse and tokenize one JSONL line; raises BadRecord saying why it cannot be used."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(path, line, f"malformed JSON ({e.msg} at column {e.colno})") from None
    try:
        input_ids, loss_mask = tokenize_chat(tokenizer, _check_messages(record), max_length)
    except (ValueError, TemplateError) as e:  # a template's raise_exception() is a TemplateError
        raise BadRecord(path, line, str(e)) from None
    if not any(loss_mask):
        raise BadRecord(path, line, "no loss tokens (the template rendered no assistant content)")
    return Sample(sample_id=sample_id, input_ids=input_ids, loss_mask=loss_mask)


# ----------------------------------------------------------------------------------------
# order


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

    def records(self, m: int) -> tuple[int, list[int]]:
        epoch, j = divmod(m, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._permutation = epoch, epoch_permutation(self.num_records, self.seed, epoch)
        size = self.micro_batch_size
        return epoch, self._permutation[j * size : (j + 1) * size]


# ----------------------------------------------------------------------------------------
# micro-batches


@dataclass
class MicroBatch:
    """The tokenized records of global micro-batch `index`, right-padded to the longest one."""

    index: int  # global micro-batch index m
    epoch: int
    input_ids: torch.Tensor  # int64 [B, S], padded with the tokenizer's pad id
    loss_mask: torch.Tensor  # uint8 [B, S]: 1 on assistant tokens (uint8 travels over gloo and NCCL alike)
    lengths: torch.Tensor  # int64 [B], real tokens per row
    sample_ids: torch.Tensor  # int64 [B], global record indices

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]


def collate(
    index: int, epoch: int, samples: list[Sample], pad_id: int, pad_to_multiple: int = 1
) -> MicroBatch:
    """Right-pad samples into a MicroBatch; no samples gives B = S = 0.

    The width is rounded up to a multiple of `pad_to_multiple`: few distinct shapes mean few
    recompilations of the compiled drafter and flex_attention masks on GPU.
    """
    lengths = [len(sample.input_ids) for sample in samples]
    width = -(-max(lengths, default=0) // pad_to_multiple) * pad_to_multiple
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


class MicroBatchReader:
    """Reads and tokenizes only the records of the micro-batches asked for."""

    def __init__(
        self,
        index: JsonlIndex,
        tokenizer: Any,
        max_length: int,
        on_bad_record: str,
        micro_batch_size: int,
        seed: int,
        logger: logging.Logger,
        pad_to_multiple: int = 1,
    ) -> None:
        if on_bad_record not in ("skip", "fail"):
            raise ValueError(f"on_bad_record={on_bad_record!r}: must be 'skip' or 'fail'")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError(
                "the tokenizer has neither a pad token nor an eos token to pad micro-batches with"
            )
        self.index, self.tokenizer, self.max_length = index, tokenizer, max_length
        self.on_bad_record, self.logger, self.pad_id = on_bad_record, logger, pad_id
        self.pad_to_multiple = pad_to_multiple
        self.order = DataOrder(len(index), micro_batch_size, seed)
        self.bad_records = 0  # distinct bad records met so far by this reader
        self._seen_bad: set[int] = set()

    def read(self, m: int) -> MicroBatch:
        epoch, record_ids = self.order.records(m)
        samples = []
        for record_id in record_ids:
            path, line, text = self.index.read(record_id)
            try:
                samples.append(parse_record(text, path, line, self.tokenizer, self.max_length, record_id))
            except BadRecord as bad:
                if self.on_bad_record == "fail":
                    raise DataError(f"{bad} (set data.on_bad_record=skip to skip such records)") from None
                # Dropped, not replaced: a substitute would make the data depend on the topology.
                if record_id not in self._seen_bad:
                    self._seen_bad.add(record_id)
                    self.bad_records += 1
                    self.logger.warning("skipping bad record %s", bad)
        return collate(m, epoch, samples, self.pad_id, self.pad_to_multiple)
