"""A DSpark drafter's config fields (`dflash_config`), their defaults and checks: torch-free, so the
launcher's preflight (config/dspark_checks.py) reads them without importing the heads (dspark.py).
Also the rows per chunk of its loss's vocabulary-sized work (objective/dspark_rows.py)
and the blocks per chunk of XPress's (objective/xpress_loss.py `xpress_terms`), which the memory
model (plan/memory_heads.py) predicts from."""

from __future__ import annotations

from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# dflash_config fields of a DSpark drafter, with speculators' DSparkSpeculatorConfig defaults.
DSPARK_DEFAULTS: dict[str, Any] = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "sample_from_anchor": True,
}
DSPARK_FIELDS = tuple(DSPARK_DEFAULTS)


def dspark_field_problems(fields: dict[str, Any]) -> list[str]:
    """What is wrong with a DSpark drafter's fields (`DSPARK_FIELDS`), one sentence each."""
    problems = []
    rank = fields.get("markov_rank")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        problems.append(f"markov_rank must be an integer >= 0 (0: no Markov head), got {rank!r}")
    if fields.get("markov_head_type") not in MARKOV_HEAD_TYPES:
        problems.append(
            f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {fields.get('markov_head_type')!r}"
        )
    for key in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if not isinstance(fields.get(key), bool):
            problems.append(f"{key} must be true or false, got {fields.get(key)!r}")
    with_markov = fields.get("enable_confidence_head") and fields.get("confidence_head_with_markov")
    if with_markov and rank == 0:
        problems.append(
            "confidence_head_with_markov needs the Markov head's embedding: markov_rank > 0, "
            "or confidence_head_with_markov=false"
        )
    return problems


# One chunk's [rows, V] fp32 tensor stays under this many elements (512 MiB), and under this many rows
# (train.vocabulary_chunk_rows sets another). At Qwen3-8B's vocabulary that is 880 rows (55 blocks of
# 16), measured ~4 ms (DSpark) and ~10 ms (XPress) a step faster on an H100 than half as many, for
# ~1.9 GB more (BENCHMARKS.md "Drafter heads").
DSPARK_CHUNK_ELEMENTS = 1 << 27
DSPARK_CHUNK_MAX_ROWS = 2048


def dspark_chunk_rows(vocab: int) -> int:
    """Rows of one chunk of DSpark's row terms at vocabulary size `vocab`."""
    return min(DSPARK_CHUNK_MAX_ROWS, max(1, DSPARK_CHUNK_ELEMENTS // vocab))


def vocabulary_chunk_blocks(vocab: int, block_size: int, rows: int | None = None) -> int:
    """Blocks of one chunk of DSpark's and XPress's vocabulary-sized loss work: `rows`
    (train.vocabulary_chunk_rows; None: `dspark_chunk_rows`) rounded down to whole blocks, at least
    one (a block's D-PACE weights and Jacobi passes read only that block, so chunks split there)."""
    return max(1, (rows or dspark_chunk_rows(vocab)) // block_size)
