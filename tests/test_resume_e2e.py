"""A used run directory, with real jobs: a fresh start over an earlier run is refused before any
worker works (by the launcher and under plain torchrun) unless train.overwrite=true clears it; a
resume that would move the data, or that leaves nothing to train, is refused naming the setting
before anything trains; one that changes only what does not move data continues."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mp.launch import outcome
from dflash_mp.run import checkpoint
from tests.conftest import REPO, job_env, read_metrics, run_train

FAST = ("train.micro_batch_size=1", "train.export=false", "eval.every=0", "logger.progress_every=100")
ONE_EACH = ("topology.targets=1", "topology.drafters=1")
# The run the resume test continues: one drafter taking two micro-batches a step, checkpointed at
# the end only (a resume with nothing left to train is then refused from meta.json, before any worker).
EARLIER = (*FAST, *ONE_EACH, "train.grad_accum=2", "train.max_steps=2")
LAUNCHER = ("-m", "dflash_mp.launch", "run")
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dflash_mp.train")


def run_job(command: tuple[str, ...], run: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *command, f"run_dir={run}", *overrides],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def refused_fresh_start(command: tuple[str, ...], run: Path) -> dict:
    """A fresh start in a run directory that a preempted run left (checkpoints, metrics, its
    job.json and PREEMPTED marker; their content does not matter here), and what it left there."""
    (run / "checkpoints" / "step_00000005").mkdir(parents=True)
    metrics = '{"step": 5, "loss": 2.0, "lr": 0.001}\n'
    (run / "metrics.jsonl").write_text(metrics)
    outcome.write_job_state(run, state="preempted", exit_code=outcome.EXIT_PREEMPTED, summary="SIGTERM")
    outcome.preempted_marker(run).write_text('{"step": 5, "signal": "SIGTERM"}')
    proc = run_job(command, run, *FAST, *ONE_EACH)
    return dict(
        proc=proc,
        metrics_kept=(run / "metrics.jsonl").read_text() == metrics,
        earlier_checkpoint=(run / "checkpoints" / "step_00000005").is_dir(),
        config_yaml=(run / "config.yaml").exists(),
        state=outcome.read_job_state(run)["state"],
        preempted_marker=outcome.preempted_marker(run).is_file(),
        rank_logs=list((run / "logs").glob("rank*.log")),
        heartbeats=(run / "heartbeats").exists(),
    )


@pytest.fixture(scope="module")
def overwritten(tmp_path_factory) -> tuple[Path, dict, subprocess.CompletedProcess]:
    """The launcher refused a fresh start in a used run directory; train.overwrite=true then cleared
    it and trained EARLIER there: the run the resume test continues (in a copy of its own)."""
    run = tmp_path_factory.mktemp("used") / "run"
    refused = refused_fresh_start(LAUNCHER, run)
    rerun = run_job(LAUNCHER, run, *EARLIER, "train.overwrite=true")
    return run, refused, rerun


@pytest.mark.parametrize("entry", ["dflash_mp.launch run", "torchrun"])
def test_a_fresh_start_in_a_used_run_dir_is_refused_before_any_worker_works(tmp_path, request, entry):
    """Without train.resume=true a used run directory is left alone, by the launcher and by plain
    torchrun alike (there every rank exits with the reason, code 2, before loading anything)."""
    if entry == "torchrun":
        run = tmp_path / "used"
        refused = refused_fresh_start(TORCHRUN, run)
    else:
        run, refused, rerun = request.getfixturevalue("overwritten")
    output = refused["proc"].stdout + refused["proc"].stderr
    if entry == "torchrun":
        # Every rank exits 2 with the reason (torchrun may end the slower one first).
        assert refused["proc"].returncode != 0 and "exitcode  : 2" in output, output[-3000:]
        assert "dflash_mp: rank 0: refused: run_dir=" in output
    else:
        assert refused["proc"].returncode == outcome.EXIT_PREFLIGHT, output[-3000:]
    assert f"run_dir={run} holds an earlier run" in output
    for way_out in ("train.resume=true", "a new run_dir", "train.overwrite=true"):
        assert way_out in output
    assert refused["metrics_kept"]  # not truncated
    assert refused["earlier_checkpoint"] and not refused["config_yaml"]
    # The earlier job's record stays for `status` and a requeue: this launch never started.
    assert refused["state"] == "preempted" and refused["preempted_marker"]
    assert not refused["rank_logs"] and not refused["heartbeats"]
    if entry == "torchrun":
        return
    # The explicit way out: train.overwrite=true clears the earlier run first; job.log keeps its story.
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]
    log = (run / "logs" / "job.log").read_text()
    assert "holds an earlier run" in log and "train.overwrite=true: removed the earlier run's" in log
    # A resume with nothing left to train is refused from the checkpoint's meta.json, before any worker.
    resumed = run_job(LAUNCHER, run, *EARLIER, "train.resume=true")  # train.max_steps=2 again
    assert resumed.returncode == outcome.EXIT_PREFLIGHT, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resume: cannot resume from" in resumed.stderr and "nothing left to train" in resumed.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


@pytest.mark.slow
def test_resume_refuses_a_changed_data_order_and_allows_a_new_split(overwritten, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(overwritten[0], run)  # 2 steps of EARLIER
    log_before = len((run / "logs" / "job.log").read_text())
    refused = run_train(
        run,
        *FAST,
        "train.checkpoint_every=1",
        "train.max_steps=3",
        *ONE_EACH,
        "train.grad_accum=1",
        "train.resume=true",
        check=False,
    )
    assert refused.returncode != 0
    job_log = (run / "logs" / "job.log").read_text()[log_before:]
    assert "train.grad_accum changed (train.grad_accum=2, topology.drafters=1 when it was saved" in job_log
    assert "preflight failed, no worker was started" in job_log  # known from meta.json alone
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # nothing trained on the wrong data

    # More targets, two drafters taking one micro-batch each instead of one taking two, another
    # learning rate: the same micro-batches in the same steps, so the run continues.
    run_train(
        run,
        *FAST,
        "train.checkpoint_every=1",
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
