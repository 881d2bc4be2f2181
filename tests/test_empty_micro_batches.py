"""Micro-batches whose records were all skipped as bad, with real torchrun jobs.

With one record per micro-batch a bad record empties a drafter's micro-batch. Every drafter
must still join the same gradient all-reduces, the empty micro-batch must add nothing, and a
step without a loss token anywhere is skipped by all drafters together.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_mp.data import records_of_micro_batch
from dflash_mp.embedded import embedded_path
from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 6
RECORDS = 40  # one epoch covers every micro-batch of the runs below
# Bad micro-batches (one record each). Two drafters (steps = pairs): drafter 1 empty at step 1,
# drafter 0 at step 4, steps 5 and 6 empty on both. Three drafters (triples): drafter 1 empty at
# step 1, drafters 0 and 2 at step 3, step 4 empty on all three.
BAD_MICRO_BATCHES = (1, 6, 8, 9, 10, 11)
COMMON = (
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=1",
    "train.grad_accum=1",
    "train.export=false",
    "eval.every=0",
    "logger.progress_every=100",
    "data.max_bad_fraction=0.5",  # 6 of 40 records are bad on purpose; the preflight would refuse them
)


@pytest.fixture(scope="module")
def data_with_empty_micro_batches(tmp_path_factory) -> Path:
    lines = embedded_path("data/train_regenerated.jsonl").read_text().splitlines()[:RECORDS]
    for m in BAD_MICRO_BATCHES:
        epoch, (record,) = records_of_micro_batch(m, RECORDS, micro_batch_size=1, seed=0)
        assert epoch == 0
        lines[record] = '{"messages": [{"role": "user", "content": "cut sho'
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_with_empty_micro_batches) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("runs")
    data = f"data.train_files=[{data_with_empty_micro_batches}]"
    out = {}
    for targets, drafters in ((1, 2), (2, 2), (1, 3)):
        name = f"{targets}t{drafters}d"
        run_train(root / name, *COMMON, data, f"topology.targets={targets}", f"topology.drafters={drafters}")
        out[name] = read_metrics(root / name)
    return out


def test_jobs_finish_and_count_every_skipped_record(runs):
    for name, records in runs.items():
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
        assert sum(r["bad_records"] for r in records) == len(BAD_MICRO_BATCHES), name


def test_a_step_without_loss_tokens_is_skipped_by_all_drafters(runs):
    two = runs["1t2d"]
    assert [r["micro_batches_without_loss"] for r in two] == [1, 0, 0, 1, 2, 2]
    assert [r["skip_reason"] for r in two] == [None, None, None, None, "no_loss_tokens", "no_loss_tokens"]
    assert [r["loss"] is None for r in two] == [False] * 4 + [True] * 2
    three = runs["1t3d"]
    assert [r["micro_batches_without_loss"] for r in three] == [1, 0, 2, 3, 0, 0]
    assert [r["skipped"] for r in three] == [False, False, False, True, False, False]


def test_loss_does_not_depend_on_the_number_of_targets_with_empty_micro_batches(runs):
    assert [r["loss"] for r in runs["1t2d"]] == [r["loss"] for r in runs["2t2d"]]  # bitwise
