"""Batch jobs: a Hydra sweep of whole jobs (each point its own torchrun job), and
launch/slurm.sbatch run with stand-ins for SLURM's srun and scontrol: a job trained on two
"nodes" of this machine (the multi-node path on loopback) and the script's requeue decisions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from dflash_mp.config.schema import compose_config
from dflash_mp.launch import outcome
from dflash_mp.launch.sweep import resume_if_preempted
from tests.conftest import REPO, job_env, read_metrics
from tests.test_faults import FAST, last_lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_sweep_runs_each_job_as_its_own_torchrun_job_past_a_failed_point(tmp_path):
    """Point 1 fails its preflight; point 2 still runs, and the summary lists every point."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mp.train", "-m", "optim.lr=1e-4,-1,6e-4", "train.max_steps=2"]
        + ["topology.targets=1", "topology.drafters=1", *FAST],
        cwd=REPO,
        env=job_env() | {"DFLASH_SWEEP_DIR": str(sweep)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == outcome.EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_ids = set()
    for num, lr in ((0, "0.0001"), (2, "0.0006")):
        run = sweep / str(num)
        assert f"lr: {lr}" in (run / "config.yaml").read_text()
        assert [r["step"] for r in read_metrics(run)] == [1, 2]
        assert "job succeeded: exit code 0" in last_lines(run, 1)
        job_ids.add(outcome.read_job_state(run)["job_id"])
    assert len(job_ids) == 2
    assert outcome.read_job_state(sweep / "1")["exit_code"] == outcome.EXIT_PREFLIGHT
    summary = (sweep / "summary.txt").read_text()
    assert summary in proc.stdout and "1 of 3 point(s) failed" in summary
    rows = {line.split()[0]: line.split() for line in summary.splitlines()[2:]}
    assert rows["0"][1:4] == ["succeeded", "0", str(sweep / "0")] and "optim.lr=0.0001" in rows["0"]
    assert rows["1"][1:4] == ["not-started", "2", str(sweep / "1")] and "optim.lr=-1" in rows["1"]
    assert rows["2"][1:4] == ["succeeded", "0", str(sweep / "2")]


# srun on two nodes runs its task once per node: here twice on this machine, each a torchrun agent
# of the one c10d rendezvous the script sets up (on loopback).
TWO_NODE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
"$@" &
first=$!
"$@"
second=$?
wait $first
first=$?
exit $(( first ? first : second ))
"""


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_with_stand_ins_for_srun_and_scontrol(tmp_path):
    """launch/slurm.sbatch as SLURM would run it on 2 nodes of one "GPU" each: two torchrun agents
    in one c10d rendezvous on loopback, the target on one node and the drafter on the other (roles
    go by global rank: whole nodes can hold one role), then the script's verdict on the job."""
    bin_dir, run = tmp_path / "bin", tmp_path / "slurm-run"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(TWO_NODE_SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo localhost\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    slurm = dict(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="dflash", SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost"
    )
    env = job_env() | slurm | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    env |= {"GPUS_PER_NODE": "1", "RUN_DIR": str(run), "PORT": str(_free_port())}
    proc = subprocess.run(
        [
            "bash",
            "launch/slurm.sbatch",
            "topology.targets=1",
            "topology.drafters=1",
            "train.max_steps=3",
            *FAST,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert "2 node(s) x 1" in (run / "logs" / "job.log").read_text()
    assert "job succeeded: exit code 0" in last_lines(run, 1)
    # One rank per node, each node's agent logging on its own, the ranks' roles by global rank.
    assert len(list((run / "logs" / "torchrun").glob("4242.0/*"))) == 2
    assert {p.name for p in (run / "logs").glob("rank*.log")} == {"rank0-target.log", "rank1-drafter.log"}


def test_a_sweep_point_requeued_after_a_preemption_resumes(tmp_path):
    run, overrides = tmp_path / "3", ["optim.lr=6e-4"]
    cfg = compose_config(overrides)
    assert not resume_if_preempted(run, cfg, overrides) and not cfg.train.resume
    run.mkdir()
    (run / "PREEMPTED").write_text(json.dumps({"step": 4, "signal": "SIGUSR2"}))
    assert resume_if_preempted(run, cfg, overrides)
    assert cfg.train.resume and overrides == ["optim.lr=6e-4", "train.resume=true"]


FAKE_SRUN = """
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
Path(os.environ["FAKE_SRUN_ARGS"]).write_text(json.dumps(args))
run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run_dir=")))
got = []
signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
(run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)


def beat(rank, role, state, at):
    fields = dict(rank=rank, role=role, host="node", pid=1, state=state, phase="receive", step=4)
    fields |= dict(progress_at=at, written_at=at, timeout_s=900, stop_requested=None, error=None)
    fields |= dict(blame=None, exited=state != "running")  # a killed rank never marks its exit
    (run_dir / "heartbeats" / f"rank{rank}.json").write_text(json.dumps(fields))


now = time.time()
if os.environ["FAKE_SCENARIO"] == "failure":
    beat(0, "target", "running", now - 5)  # SIGKILLed: its heartbeat stopped there
    beat(1, "drafter", "preempted", now)  # torchrun's teardown SIGTERM: it checkpointed
    signal_name = "SIGTERM"
else:  # SLURM's warning before the time limit reaches the batch script, which passes it on
    os.kill(os.getppid(), signal.SIGUSR1)
    deadline = time.time() + 30
    while not got and time.time() < deadline:
        time.sleep(0.05)
    beat(0, "target", "stopped", time.time())
    beat(1, "drafter", "preempted", time.time())
    signal_name = "SIGUSR1" if got else "none"
(run_dir / "PREEMPTED").write_text(json.dumps({"step": 4, "signal": signal_name}))
sys.exit(1)  # torchrun's exit code whenever a worker did not exit 0
"""


@pytest.mark.parametrize(
    "scenario, attempt, code, requeued",
    [("failure", 0, outcome.EXIT_FAILED, False), ("preemption", 0, 75, True), ("preemption", 3, 75, False)],
)
def test_the_sbatch_script_requeues_only_a_real_preemption_and_only_so_often(
    tmp_path, scenario, attempt, code, requeued
):
    """launch/slurm.sbatch's decisions, with srun standing in for a job that a rank failure tore down
    (the survivors checkpointed and wrote PREEMPTED) or that SLURM's USR1 stopped."""
    bin_dir, run = tmp_path / "bin", tmp_path / "slurm-run"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n'
        '[ "$1 $2" = "show hostnames" ] && echo localhost\nexit 0\n'
    )
    # The preflight is tested elsewhere: here it passes at once.
    (bin_dir / "python").write_text(f'#!/bin/bash\n[ "$3" = doctor ] && exit 0\nexec {sys.executable} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = job_env() | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python")}
    env |= dict(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="dflash", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost"
    )
    env |= dict(
        SLURM_RESTART_COUNT=str(attempt), SLURM_CPUS_PER_TASK="12", GPUS_PER_NODE="2", RUN_DIR=str(run)
    )
    env |= dict(FAKE_SCENARIO=scenario, FAKE_SRUN_ARGS=str(tmp_path / "srun.json"))
    proc = subprocess.run(
        ["bash", "launch/slurm.sbatch", "topology.targets=1", "topology.drafters=1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    scontrol = (tmp_path / "scontrol.log").read_text()
    assert ("requeue 4242" in scontrol) == requeued, scontrol
    log = (run / "logs" / "job.log").read_text()
    assert "--cpus-per-task=12" in json.loads((tmp_path / "srun.json").read_text())  # all CPUs to the step
    if scenario == "failure":
        assert "job FAILED: exit code 1" in log and "first failure: rank 0 (target) died" in log, log
        assert not (run / "PREEMPTED").exists()
    else:
        assert "batch script: got SIGUSR1" in log and "job PREEMPTED: exit code 75" in log, log
        assert requeued or "not requeueing: this was attempt 3 and MAX_REQUEUES=3" in log
