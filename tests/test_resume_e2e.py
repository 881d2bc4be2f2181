"""Resuming real torchrun jobs: a resume that would move the data is refused, naming the
setting, before anything trains; one that changes only what does not move data continues."""

from __future__ import annotations

import pytest

from dflash_mp.run import checkpoint
from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

FAST = (
    "train.micro_batch_size=1",
    "train.export=false",
    "eval.every=0",
    "logger.progress_every=100",
    "train.checkpoint_every=1",
)


def test_resume_refuses_a_changed_data_order_and_allows_a_new_split(tmp_path):
    run = tmp_path / "run"
    run_train(
        run, *FAST, "train.max_steps=2", "topology.targets=1", "topology.drafters=1", "train.grad_accum=2"
    )

    refused = run_train(
        run,
        *FAST,
        "train.max_steps=3",
        "topology.targets=1",
        "topology.drafters=1",
        "train.grad_accum=1",
        "train.resume=true",
        check=False,
    )
    assert refused.returncode != 0
    job_log = (run / "logs" / "job.log").read_text()
    assert "train.grad_accum changed (train.grad_accum=2, topology.drafters=1 when it was saved" in job_log
    assert "preflight failed, no worker was started" in job_log  # known from meta.json alone
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # nothing trained on the wrong data

    # More targets, two drafters taking one micro-batch each instead of one taking two, another
    # learning rate: the same micro-batches in the same steps, so the run continues.
    run_train(
        run,
        *FAST,
        "train.max_steps=3",
        "topology.targets=2",
        "topology.drafters=2",
        "train.grad_accum=1",
        "optim.lr=5e-3",
        "train.resume=true",
    )
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    layout = checkpoint.read_meta(checkpoint.latest(run / "checkpoints"))["data_layout"]
    assert (layout["micro_batch_index"], layout["drafters"], layout["grad_accum"]) == (6, 2, 1)
