"""Training data: record formats, chat rendering with loss masks, order, micro-batches, preflight.

records   one JSONL line -> a conversation or a pre-rendered text (the accepted formats)
chat      the chat template's rendering and the assistant loss mask
order     the byte-offset index and the topology-free record order
sources   JSONL, Parquet, Arrow, save_to_disk directories and hf:org/name, read by record index
samples   one record -> one tokenized sample, or why it cannot be used
reader    records -> samples -> micro-batches, with bad/truncated counts
validity  every record decoded and format-checked, no tokenizer (the preflight's and ranks' full pass)
preflight the full pass and a random sample read the way training reads it, before any worker starts
"""

from dflash_mp.data.chat import (
    ChatRenderer,
    load_renderer,
    load_tokenizer,
    read_chat_template,
    tokenize_chat,
    tokenize_spans,
)
from dflash_mp.data.errors import BadRecord, DataError, EmptyData
from dflash_mp.data.order import (
    DataOrder,
    JsonlIndex,
    epoch_permutation,
    micro_batches_per_epoch,
    records_of_micro_batch,
)
from dflash_mp.data.reader import (
    MIN_RECORDS_TO_JUDGE,
    MicroBatch,
    MicroBatchReader,
    collate,
    padded_width,
)
from dflash_mp.data.records import ACCEPTED_FORMATS, Conversation, TextRecord
from dflash_mp.data.samples import Sample, TooLong, parse_record
from dflash_mp.data.sources import Records, input_problem, open_records

__all__ = [
    "ACCEPTED_FORMATS",
    "MIN_RECORDS_TO_JUDGE",
    "padded_width",
    "BadRecord",
    "ChatRenderer",
    "load_renderer",
    "Conversation",
    "DataError",
    "DataOrder",
    "EmptyData",
    "JsonlIndex",
    "MicroBatch",
    "MicroBatchReader",
    "Sample",
    "TextRecord",
    "TooLong",
    "collate",
    "epoch_permutation",
    "load_tokenizer",
    "micro_batches_per_epoch",
    "parse_record",
    "open_records",
    "input_problem",
    "read_chat_template",
    "Records",
    "records_of_micro_batch",
    "tokenize_chat",
    "tokenize_spans",
]
