"""One record -> one tokenized Sample, or the reason it cannot be used (BadRecord, TooLong)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_mp.data.chat import ChatRenderer, tokenize_spans
from dflash_mp.data.errors import BadRecord, DataError
from dflash_mp.data.records import Conversation, RecordError, decode_line, parse_json, to_record


class TooLong(BadRecord):
    """A record longer than data.max_length under data.on_too_long=skip (not a bad record)."""


@dataclass
class Sample:
    """One tokenized record."""

    sample_id: int  # global record index in the inputs (-1 when it has none)
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to data.max_length


def tokenize_record(
    record: Any, tokenizer: Any, renderer: ChatRenderer | None
) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask of a parsed record in any accepted format (no length limit)."""
    if isinstance(record, Conversation):
        text, spans = (renderer or ChatRenderer(tokenizer)).render(record.messages)
        return tokenize_spans(tokenizer, text, spans, end_of_turn=True)
    return tokenize_spans(tokenizer, record.text, record.loss_spans, end_of_turn=False)


def parse_record(
    text: str | bytes,
    path: str,
    line: int,
    tokenizer: Any,
    max_length: int,
    sample_id: int = -1,
    *,
    renderer: ChatRenderer | None = None,
    on_too_long: str = "truncate",
) -> Sample:
    """Parse and tokenize one JSONL line; raises BadRecord saying why it cannot be used.

    Any error of one record makes that record bad; DataError (a problem of the job) passes.
    """
    try:
        input_ids, loss_mask = tokenize_record(to_record(parse_json(decode_line(text))), tokenizer, renderer)
    except DataError:
        raise
    except RecordError as e:
        raise BadRecord(path, line, str(e), e.kind) from None
    except Exception as e:  # a template's raise_exception(), a RecursionError, anything of this record
        raise BadRecord(path, line, f"{type(e).__name__}: {e}", "cannot render") from None
    truncated = len(input_ids) > max_length
    if truncated:
        if on_too_long == "skip":
            raise TooLong(
                path, line, f"{len(input_ids)} tokens, longer than data.max_length={max_length}", "too long"
            )
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not any(loss_mask):
        where = f" in its first data.max_length={max_length} tokens" if truncated else ""
        raise BadRecord(
            path, line, f"no loss tokens{where} (no assistant content rendered)", "no loss tokens"
        )
    return Sample(sample_id=sample_id, input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)
