"""End to end on CPU with real torchrun subprocesses (gloo point-to-point).

The loss trajectory must not depend on the split into target and drafter ranks, must equal
the single-process reference trainer, and a killed-and-resumed job must end with exactly
the weights of an uninterrupted one.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.embedded import embedded_path
from dflash_mp.launch import agent
from dflash_mp.run import checkpoint
from dflash_mp.runtime.watchdog import FAULT_ENV, read_heartbeats
from tests.conftest import NO_PLOTS, REPO, job_env, read_metrics, run_train

pytestmark = pytest.mark.slow

STEPS = 6
COMMON = (f"train.max_steps={STEPS}", "train.micro_batch_size=2", "logger.progress_every=100", "eval.every=0")
NO_EXPORT = "train.export=false"  # where no test reads the export


@pytest.fixture(scope="session")
def data_with_bad_line(tmp_path_factory) -> Path:
    """30 records of the embedded data, line 4 malformed (skipped by default).

    Small enough that the first epoch, which reads every record, ends within the run.
    """
    lines = embedded_path("data/train.jsonl").read_text().splitlines()[:29]
    lines.insert(3, '{"messages": [{"role": "user", "content": "cut sho')
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory, data_with_bad_line) -> dict[str, Path]:
    """The same training as 2+1, 1+1 (accum 2), 1+2 (accum 1) and 2 colocated ranks (accum 1).
    The 1+1 job's ranks start as fresh interpreters (DFLASH_MP_RANK_START=fresh), the others' are
    forked from the launcher's agent."""
    root = tmp_path_factory.mktemp("runs")
    data = f"data.train_files=[{data_with_bad_line}]"
    splits = {
        "2t1d": (
            "topology.targets=2",
            "topology.drafters=1",
            "train.grad_accum=2",
            "train.checkpoint_every=2",
            "logger.plots=true",  # the one job whose curves a test reads
        ),
        "1t1d": ("topology.targets=1", "topology.drafters=1", "train.grad_accum=2", NO_EXPORT),
        "1t2d": ("topology.targets=1", "topology.drafters=2", "train.grad_accum=1", NO_EXPORT),
        # On CPU the launcher needs the number of ranks (on GPU: one per visible GPU).
        "colocated": ("topology=colocated", "topology.drafters=2", "train.grad_accum=1"),
    }
    out = {}
    for name, split in splits.items():
        out[name] = root / name
        with pytest.MonkeyPatch.context() as env:
            if name == "1t1d":  # fresh interpreters: the other layouts' forked ranks must train alike
                env.setenv(agent.RANK_START_ENV, "fresh")
            run_train(out[name], *COMMON, data, *split)
    return out


def reference_run(data: Path, *overrides: str):
    """The single-process reference trainer on the same config; returns (losses, trainer)."""
    from dflash_mp.reference import reference_train

    cfg = compose_config([*COMMON, f"data.train_files=[{data}]", *overrides])
    records: list[dict] = []
    trainer = reference_train(to_dataclass(cfg), on_step=records.append)
    return [r["loss"] for r in records], trainer


def test_loss_does_not_depend_on_the_number_of_targets(runs):
    two = [r["loss"] for r in read_metrics(runs["2t1d"])]
    one = [r["loss"] for r in read_metrics(runs["1t1d"])]
    assert len(two) == STEPS
    assert two == one  # bitwise: same floats


def test_runtime_equals_the_single_process_reference(runs, data_with_bad_line):
    losses, _ = reference_run(data_with_bad_line, "train.grad_accum=2")
    assert [r["loss"] for r in read_metrics(runs["1t1d"])] == losses


def test_ranks_start_as_fresh_interpreters_when_asked(runs, monkeypatch):
    """DFLASH_MP_RANK_START=fresh (and any visible GPU) makes the agent plain torchrun: every rank a
    fresh interpreter; the job trains as with forked ranks (the 1+1 job: its losses equal the 2+1
    job's bit for bit, test_loss_does_not_depend_on_the_number_of_targets)."""
    monkeypatch.setenv(agent.RANK_START_ENV, "fresh")
    assert agent.start_method() == "fresh"
    monkeypatch.delenv(agent.RANK_START_ENV)
    assert agent.start_method() == "fork"  # no GPU here
    log = (runs["1t1d"] / "logs" / "job.log").read_text()
    assert "job succeeded" in log and "starting 2 rank(s) as fresh interpreters" in log
    assert "forked from this agent" in (runs["2t1d"] / "logs" / "job.log").read_text()


def test_two_drafters_with_half_the_accumulation_match(runs):
    one = [r["loss"] for r in read_metrics(runs["1t1d"])]
    two = [r["loss"] for r in read_metrics(runs["1t2d"])]
    assert two == pytest.approx(one, rel=1e-5)


def test_run_directory_layout_and_metrics(runs):
    run = runs["2t1d"]
    assert (run / "config.yaml").is_file()
    assert {p.name for p in (run / "logs").iterdir()} >= {
        "job.log",
        "rank0-target.log",
        "rank1-target.log",
        "rank2-drafter.log",
    }
    assert "rank 2 drafter" in (run / "logs" / "rank2-drafter.log").read_text()
    # The job's log says what was launched and why it ended, without the ranks' progress bars.
    job_log = (run / "logs" / "job.log").read_text()
    assert re.search(
        r"launching 3 process\(es\) with torchrun: \S+ -m dflash_mp.launch.agent .* -m dflash_mp.train ",
        job_log,
    )
    assert f"reached train.max_steps={STEPS} (step {STEPS})" in job_log and "end of data" not in job_log
    assert "Loading weights" not in job_log
    assert "config: experiment=embedded with " in job_log and f"train.max_steps={STEPS} (preset: " in job_log
    first = read_metrics(run)[0]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "samples_per_s",
        "tokens_per_s",
        "acc",
        "bytes_received",
        "target_busy_frac",
        "drafter_wait_frac",
    ):
        assert key in first
    assert first["bytes_received"] > 0
    # The malformed line was skipped, counted and logged with its file:line.
    assert sum(r["bad_records"] for r in read_metrics(run)) >= 1
    target_logs = (run / "logs" / "rank0-target.log").read_text() + (
        run / "logs" / "rank1-target.log"
    ).read_text()
    assert "train.jsonl:4" in target_logs
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    # logger.plots=true: the curves drawn when the job ended (the other layouts' jobs draw none).
    assert {p.name for p in (run / "plots").iterdir()} == {"loss.png", "samples_per_s.png", "acc.png"}
    assert not (runs["1t2d"] / "plots").exists()


def test_kill_9_then_resume_ends_with_the_same_weights(data_with_bad_line, tmp_path):
    run, steps = tmp_path / "killed", 20  # killed at a step of 2..10: well before the end
    args = [
        *COMMON,
        f"train.max_steps={steps}",
        f"data.train_files=[{data_with_bad_line}]",
        "topology.targets=2",
        "topology.drafters=1",
        "train.grad_accum=2",
        "train.checkpoint_every=1",
        NO_EXPORT,
        NO_PLOTS,
    ]
    cmd = [sys.executable, "-m", "dflash_mp.train", f"run_dir={run}", *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kill_after = random.Random(os.getpid()).randint(2, 10)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job at once: launcher, torchrun agent and ranks
    proc.wait()
    killed_at = checkpoint.latest(run / "checkpoints")
    assert killed_at is not None and killed_at.name < f"step_{steps:08d}", "the job ended before the kill"

    run_train(run, *args, "train.resume=true")
    resumed = load_file(run / "checkpoints" / f"step_{steps:08d}" / "drafter.safetensors")
    _, uninterrupted = reference_run(data_with_bad_line, f"train.max_steps={steps}", "train.grad_accum=2")
    expected = uninterrupted.drafter.state_dict()
    assert resumed.keys() == expected.keys()
    for name in resumed:
        assert torch.equal(resumed[name], expected[name]), name
    assert [r["step"] for r in read_metrics(run)] == list(range(1, steps + 1))


def test_bad_record_with_on_bad_record_fail_stops_with_file_and_line(data_with_bad_line, tmp_path):
    proc = run_train(
        tmp_path / "fail",
        *COMMON,
        f"data.train_files=[{data_with_bad_line}]",
        "data.on_bad_record=fail",
        "topology.targets=1",
        "topology.drafters=1",
        check=False,
    )
    assert proc.returncode != 0
    assert "train.jsonl:4" in (tmp_path / "fail" / "logs" / "job.log").read_text()


def test_colocated_equals_the_split_with_as_many_drafters(runs):
    split, colocated = read_metrics(runs["1t2d"]), read_metrics(runs["colocated"])
    assert len(colocated) == STEPS
    assert [r["loss"] for r in colocated] == [r["loss"] for r in split]  # bitwise
    # The malformed line was counted on the rank that read it and reached the metrics.
    assert [r["bad_records"] for r in colocated] == [r["bad_records"] for r in split]
    assert sum(r["bad_records"] for r in colocated) >= 1
    assert "train.jsonl:4" in "".join(p.read_text() for p in (runs["colocated"] / "logs").glob("rank*.log"))
    assert {p.name for p in (runs["colocated"] / "logs").iterdir()} >= {
        "rank0-colocated.log",
        "rank1-colocated.log",
    }
    last = f"step_{STEPS:08d}"
    weights = load_file(runs["colocated"] / "checkpoints" / last / "drafter.safetensors")
    expected = load_file(runs["1t2d"] / "checkpoints" / last / "drafter.safetensors")
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), name
    # No transport, no role balance: the time split between the two sides instead.
    assert "target_busy_frac" not in colocated[0]
    assert 0 < colocated[0]["target_time_frac"] < 1
    assert colocated[0]["target_time_frac"] + colocated[0]["drafter_time_frac"] == pytest.approx(1)
    assert (runs["colocated"] / "export" / "model.safetensors").is_file()


def test_colocated_under_plain_torchrun_resumes_after_a_failed_rank_to_the_same_weights(
    runs, data_with_bad_line, tmp_path
):
    """Plain torchrun with topology.drafters left null (the world size); rank 1 raises after the
    checkpoint of step 3, and the resumed job (through the launcher) ends as the uninterrupted one."""
    run = tmp_path / "colocated-resumed"
    args = [
        *COMMON,
        f"data.train_files=[{data_with_bad_line}]",
        "topology=colocated",
        "train.checkpoint_every=1",
        NO_PLOTS,
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    failed = subprocess.run(
        [*torchrun, "-m", "dflash_mp.train", f"run_dir={run}", *args],
        cwd=REPO,
        env=job_env() | {FAULT_ENV: "rank=1,step=3,kind=raise"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0
    assert "rank 1 (colocated) failed: RuntimeError: injected fault" in (run / "logs" / "job.log").read_text()
    assert read_heartbeats(run)[1]["role"] == "colocated"
    assert checkpoint.latest(run / "checkpoints").name == "step_00000003"

    run_train(run, *args, "topology.drafters=2", "train.resume=true")
    assert "resuming from" in (run / "logs" / "rank0-colocated.log").read_text()
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(runs["colocated"])]
    last = f"step_{STEPS:08d}"
    resumed = load_file(run / "checkpoints" / last / "drafter.safetensors")
    expected = load_file(runs["colocated"] / "checkpoints" / last / "drafter.safetensors")
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name
