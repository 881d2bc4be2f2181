"""Micro-batches with the lengths of real chat data, packed (data.packing) or one record per row.

The length distribution is the one users train on after regeneration (BENCHMARKS.md, Real data):
a prompt of 30-400 tokens, an answer of 50-3000 words uniformly at 0.8 tokens a word, and a third
of the records with a thinking block a quarter as long as the answer; records are cut at the row
length as `data.on_too_long=truncate` cuts them. Tokens are random, the loss covers the answer.

    python bench/benchlib/chat_data.py --records 1000 --out chats.jsonl   # the same lengths as JSONL

writes ShareGPT records of those lengths (filler words), for a real training run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from dflash_mp.data import MicroBatch
from dflash_mp.data.packing import pack_epoch
from dflash_mp.data.reader import collate, collate_packed
from dflash_mp.data.samples import Sample

TOKENS_PER_WORD = 0.8
PROMPT_TOKENS = (30, 400)
ANSWER_WORDS = (50, 3000)
THINKING_SHARE = 1 / 3


def chat_lengths(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) of `count` records, answers including any thinking block."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        words = rng.randint(*ANSWER_WORDS)
        thinking = words // 4 if rng.random() < THINKING_SHARE else 0
        records.append((rng.randint(*PROMPT_TOKENS), round((words + thinking) * TOKENS_PER_WORD)))
    return records


class ChatShapedReader:
    """MicroBatchReader's stand-in: micro-batch m holds B rows of chat-shaped records; packed, each
    row holds whole records up to `row_tokens` (dflash_mp.data.packing's rule), else one each."""

    def __init__(
        self, vocab: int, row_tokens: int, micro_batch: int, packed: bool, pad_to: int = 64, seed: int = 0
    ) -> None:
        self.vocab, self.row_tokens, self.micro_batch = vocab, row_tokens, micro_batch
        self.packed, self.pad_to = packed, pad_to
        # Cut at the row as data.on_too_long=truncate cuts (prompts at a quarter of a tiny row).
        prompts = [(min(p, row_tokens // 4), a) for p, a in chat_lengths(4096, seed)]
        self.records = [(p, min(a, row_tokens - p)) for p, a in prompts]
        lengths = [p + a for p, a in self.records]
        self.rows = pack_epoch(lengths, seed, 0, row_tokens) if packed else [[r] for r in range(len(lengths))]
        self.generator = torch.Generator().manual_seed(seed)
        self.bad_records = self.too_long_records = 0  # the counters run_target reads
        self.tokens_read = 0  # real (unpadded) tokens of the micro-batches read

    def _sample(self, record: int) -> Sample:
        prompt, answer = self.records[record]
        ids = torch.randint(0, self.vocab - 1, (prompt + answer,), generator=self.generator).tolist()
        return Sample(sample_id=record, input_ids=ids, loss_mask=[0] * prompt + [1] * answer)

    def read(self, m: int) -> MicroBatch:
        b = self.micro_batch
        rows = [self.rows[(m * b + i) % len(self.rows)] for i in range(b)]
        epoch = m * b // len(self.rows)  # a new pass over the rows draws new anchors
        samples = [[self._sample(r) for r in row] for row in rows]
        if self.packed:
            batch = collate_packed(m, epoch, samples, pad_id=0, pad_to_multiple=self.pad_to)
        else:
            batch = collate(m, epoch, [row[0] for row in samples], pad_id=0, pad_to_multiple=self.pad_to)
        self.tokens_read += int(batch.lengths.sum())
        return batch

    def mean_row_tokens(self) -> float:
        lengths = [sum(sum(self.records[r]) for r in row) for row in self.rows]
        return sum(lengths) / len(lengths)


def write_jsonl(path: Path, count: int, seed: int = 0) -> None:
    """ShareGPT records whose rendered lengths follow `chat_lengths` (filler words)."""
    rng = random.Random(seed + 1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    with open(path, "w") as f:
        for prompt, answer in chat_lengths(count, seed):
            question = " ".join(rng.choice(words) for _ in range(round(prompt / TOKENS_PER_WORD)))
            reply = " ".join(rng.choice(words) for _ in range(round(answer / TOKENS_PER_WORD)))
            record = {
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": reply}]
            }
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Write chat records with the benchmark's length distribution."
    )
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    write_jsonl(args.out, args.records, args.seed)
