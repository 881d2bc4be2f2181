"""Fault tolerance with real processes: a rank killed, raising, hanging or stopped, and a
preempted job that resumes to the same weights.

Every job runs `python -m dflash_mp.launch run` in its own session, as an operator would start
it; each test bounds the time the job takes to end and checks that nothing of it is left. The
fault hook and a rank's own watchdog (also under plain torchrun): test_watchdog.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.launch.outcome import EXIT_FAILED, read_job_state
from dflash_mp.run.processes import group_members, job_processes
from dflash_mp.runtime.watchdog import EXIT_HUNG, EXIT_PREEMPTED, FAULT_ENV, read_heartbeats
from tests.conftest import NO_PLOTS, REPO, job_env, read_metrics, run_train

# Small and quick; logger.progress_every keeps the console quiet.
# Nothing a fault test does not look at: no export, no evaluation (each costs seconds per job).
FAST = ("train.micro_batch_size=1", "train.export=false", "eval.every=0", "logger.progress_every=1000")
FAST += (NO_PLOTS,)
# One target and one drafter unless a test needs more: a rank fewer is seconds of CPU fewer per job.
ONE_EACH = ("topology.targets=1", "topology.drafters=1")
ROLES = {0: "target", 1: "drafter"}


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def leftovers(run_dir: Path, *pgids: int) -> list[int]:
    """Processes of a job still there, zombies included: in the given process groups, in the
    ranks' own groups (torchrun gives each rank its own session) or carrying the job's id."""
    groups = set(pgids) | {beat["pid"] for beat in read_heartbeats(run_dir).values()}
    found = {pid for pgid in groups for pid in group_members(pgid)}
    job_id = read_job_state(run_dir).get("job_id")
    return sorted(found | set(job_processes(job_id) if job_id else []))


def last_lines(run_dir: Path, n: int) -> str:
    return "\n".join((run_dir / "logs" / "job.log").read_text().splitlines()[-n:])


class LaunchedJob:
    """`python -m dflash_mp.launch run` in its own session (process group = its pid)."""

    def __init__(self, run_dir: Path, *overrides: str, fault: str | None = None) -> None:
        self.run_dir = run_dir
        env = job_env() | ({FAULT_ENV: fault} if fault else {})
        self.output = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_mp.launch", "run", f"run_dir={run_dir}", *FAST, *overrides],
            cwd=REPO,
            env=env,
            stdout=self.output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        wait_until(lambda: self.steps_done() >= step or self.proc.poll() is not None, timeout, f"step {step}")
        assert self.proc.poll() is None, f"the job ended early:\n{last_lines(self.run_dir, 30)}"

    def rank_pid(self, rank: int) -> int:
        return read_heartbeats(self.run_dir)[rank]["pid"]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def assert_nothing_left(self) -> None:
        wait_until(lambda: not leftovers(self.run_dir, self.proc.pid), 10, "the job's processes to go")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in leftovers(self.run_dir, self.proc.pid):
            os.kill(pid, signal.SIGKILL)
        self.output.close()


@pytest.fixture
def launch(tmp_path):
    jobs: list[LaunchedJob] = []

    def start(name: str, *overrides: str, fault: str | None = None) -> LaunchedJob:
        jobs.append(LaunchedJob(tmp_path / name, *overrides, fault=fault))
        return jobs[-1]

    yield start
    for job in jobs:
        job.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1], ids=["target", "drafter"])
def test_sigkill_of_a_rank_ends_the_whole_job(launch, rank):
    job = launch(f"kill{rank}", "train.max_steps=1000", *ONE_EACH)
    job.wait_for_step(2)
    os.kill(job.rank_pid(rank), signal.SIGKILL)
    assert job.wait(timeout=90) == EXIT_FAILED  # within a bound, not after the 900 s watchdog
    job.assert_nothing_left()
    assert f"first failure: rank {rank} ({ROLES[rank]}) died without a Python traceback" in last_lines(
        job.run_dir, 1
    )


@pytest.mark.slow
def test_an_exception_in_a_rank_ends_the_job_with_its_traceback_last(launch):
    job = launch("raise", "train.max_steps=1000", *ONE_EACH, fault="rank=0,step=2,kind=raise")
    assert job.wait(timeout=180) == EXIT_FAILED
    job.assert_nothing_left()
    tail = last_lines(job.run_dir, 25)
    assert "Traceback (most recent call last)" in tail
    assert "RuntimeError: injected fault at step" in tail
    assert "first failure: rank 0 (target) raised RuntimeError: injected fault" in last_lines(job.run_dir, 1)


@pytest.mark.slow
def test_a_stopped_rank_is_caught_by_the_launcher_watchdog(launch):
    timeout_s = 10
    job = launch("sigstop", "train.max_steps=1000", *ONE_EACH, f"watchdog.timeout_s={timeout_s}")
    job.wait_for_step(2)
    os.kill(job.rank_pid(0), signal.SIGSTOP)  # its heartbeat thread cannot run: only the launcher sees it
    assert job.wait(timeout=timeout_s + 90) == EXIT_HUNG
    job.assert_nothing_left()
    last = last_lines(job.run_dir, 1)
    assert "job HUNG" in last and "rank 0 (target) hung in phase" in last and "stopped or frozen" in last


@pytest.mark.slow
def test_a_stop_signal_checkpoints_and_the_resumed_job_ends_with_the_uninterrupted_weights(launch):
    """SIGUSR2 here, what submitit's SLURM jobs get before the time limit: it stops the job like
    SIGTERM and SIGUSR1 (SIGTERM: the detached job's `stop` in test_launch)."""
    steps = 12
    args = (f"train.max_steps={steps}", "train.checkpoint_every=0")
    # The drafter stalls at step 5 until the stop request: the job is still running when the signal
    # comes however slow the machine is, and the resumed job and the reference stay short.
    job = launch("preempted", *args, *ONE_EACH, fault="rank=1,step=5,kind=stall,seconds=120")
    job.wait_for_step(3)
    os.killpg(job.proc.pid, signal.SIGUSR2)  # to the whole group, as SLURM does: torchrun passes it on
    assert job.wait(timeout=120) == EXIT_PREEMPTED
    job.assert_nothing_left()
    marker = json.loads((job.run_dir / "PREEMPTED").read_text())
    assert marker["signal"] == "SIGUSR2"
    stopped_at = marker["step"]
    assert 3 <= stopped_at < steps
    assert (job.run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "drafter.safetensors").is_file()
    assert "job PREEMPTED: exit code 75" in last_lines(job.run_dir, 1)

    run_train(job.run_dir, *FAST, *args, *ONE_EACH, "train.resume=true")
    assert [r["step"] for r in read_metrics(job.run_dir)] == list(range(1, steps + 1))
    resumed = load_file(job.run_dir / "checkpoints" / f"step_{steps:08d}" / "drafter.safetensors")
    from dflash_mp.reference import reference_train

    expected = reference_train(to_dataclass(compose_config([*FAST, *args]))).drafter.state_dict()
    assert resumed.keys() == expected.keys()
    for name in resumed:
        assert torch.equal(resumed[name], expected[name]), name


@pytest.mark.slow
def test_preempted_ranks_leave_their_process_groups_without_aborting(launch):
    """1 target, 2 drafters: the drafters wait on headers when the stop comes, with receives still
    posted. Every rank ends by itself, with no abort from gloo's threads in the job log."""
    job = launch("preempted-1t2d", "topology.targets=1", "topology.drafters=2", "train.max_steps=400")
    job.wait_for_step(3)
    os.killpg(job.proc.pid, signal.SIGUSR2)
    assert job.wait(timeout=120) == EXIT_PREEMPTED
    job.assert_nothing_left()
    log = (job.run_dir / "logs" / "job.log").read_text()
    for abort in ("terminate called", "Fatal Python error", "Aborted"):
        assert abort not in log, log[-3000:]
    assert all(beat["exited"] for beat in read_heartbeats(job.run_dir).values())


def _phase(run_dir: Path, rank: int) -> str | None:
    beat = read_heartbeats(run_dir).get(rank)
    return beat["phase"] if beat else None


@pytest.mark.slow
def test_a_rank_killed_while_the_first_drafter_evaluates_is_a_failure_not_a_preemption(launch):
    """torchrun's teardown SIGTERMs the survivors; the first drafter, done evaluating, takes it for a
    stop request and checkpoints. Still rank 0's failure: exit 1, no PREEMPTED marker to requeue on."""
    job = launch(
        "kill-in-eval", "train.max_steps=1000", "eval.every=2", "topology.targets=1", "topology.drafters=1"
    )
    wait_until(lambda: _phase(job.run_dir, 1) == "eval" or job.proc.poll() is not None, 120, "an evaluation")
    os.kill(job.rank_pid(0), signal.SIGKILL)
    assert job.wait(timeout=90) == EXIT_FAILED
    job.assert_nothing_left()
    last = last_lines(job.run_dir, 1)
    assert "job FAILED: exit code 1" in last, last
    assert "first failure: rank 0 (target) died without a Python traceback (killed by SIGKILL)" in last
    assert not (job.run_dir / "PREEMPTED").exists()
    # The communication timeout follows the watchdog (900 s by default), so the watchdog fires first.
    assert "process groups time out after 1020s" in (job.run_dir / "logs" / "job.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "stall_step, stall_phase",
    [(10, "optimizer"), (11, "compute")],
    ids=["drafter-before-its-last-step", "drafter-in-its-last-step"],
)
def test_a_target_killed_after_it_finished_sending_is_named_as_the_failure(launch, stall_step, stall_phase):
    """The target has sent everything (heartbeat "done") while the drafter, stalled, still trains;
    a SIGKILL of the target then is its failure, never a preemption (the drafter checkpoints on
    torchrun's teardown SIGTERM before its last step) or a success (in its last step)."""
    job = launch(
        f"kill-done-{stall_step}",
        "train.max_steps=12",
        "topology.targets=1",
        "topology.drafters=1",
        # The first stall lets the target run ahead, so the drafter has posted the receives of every
        # micro-batch left (its transport posts them as their headers arrive) before the second.
        fault=f"rank=1,step={stall_step - 2},phase=compute,kind=stall,seconds=5;"
        f"rank=1,step={stall_step},phase={stall_phase},kind=stall,seconds=300",
    )
    done = lambda: read_heartbeats(job.run_dir).get(0, {}).get("state") == "done"  # noqa: E731
    wait_until(lambda: done() or job.proc.poll() is not None, 90, "the target to finish sending")
    assert read_heartbeats(job.run_dir)[1]["state"] == "running"
    os.kill(job.rank_pid(0), signal.SIGKILL)
    assert job.wait(timeout=120) == EXIT_FAILED, last_lines(job.run_dir, 10)
    job.assert_nothing_left()
    last = last_lines(job.run_dir, 1)
    assert "job FAILED: exit code 1" in last, last
    assert "first failure: rank 0 (target) died without a Python traceback (killed by SIGKILL)" in last
    assert "after it had ended its work (done)" in last
    assert not (job.run_dir / "PREEMPTED").exists()
