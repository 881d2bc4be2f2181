"""Batch jobs: a Hydra sweep of whole jobs (each point its own torchrun job), and
slurm/train.sbatch run with stand-ins for SLURM's srun and scontrol: a job trained on two
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
from tests.test_faults import FAST, ONE_EACH, last_lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_sweep_runs_each_point_in_its_own_directory_under_run_dir_past_a_failed_point(tmp_path):
    """A given run_dir is the sweep's parent: each point its own torchrun job in <n>_<swept
    overrides>/ under it; point 1 fails its preflight, point 2 still runs; the summary beside the
    points lists every point with its final loss."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mp.train", "-m", "optim.lr=1e-4,-1,6e-4", f"run_dir={sweep}"]
        + ["train.max_steps=2", *ONE_EACH, *FAST],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == outcome.EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {
        num: sweep / name
        for num, name in ((0, "0_optim.lr-0.0001"), (1, "1_optim.lr--1"), (2, "2_optim.lr-0.0006"))
    }
    job_ids = set()
    for num, lr in ((0, "0.0001"), (2, "0.0006")):
        assert f"lr: {lr}" in (runs[num] / "config.yaml").read_text()
        assert [r["step"] for r in read_metrics(runs[num])] == [1, 2]
        assert "job succeeded: exit code 0" in last_lines(runs[num], 1)
        job_ids.add(outcome.read_job_state(runs[num])["job_id"])
    assert len(job_ids) == 2
    assert outcome.read_job_state(runs[1])["exit_code"] == outcome.EXIT_PREFLIGHT
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        [*(r.name for r in runs.values()), "multirun.yaml", "points", "summary.txt"]
    )
    summary = (sweep / "summary.txt").read_text()
    assert summary in proc.stdout and "1 of 3 point(s) failed" in summary
    rows = {line.split()[0]: line.split() for line in summary.splitlines()[2:]}
    losses = {num: f"{read_metrics(runs[num])[-1]['loss']:.4f}" for num in (0, 2)}
    assert (
        rows["0"][1:6] == ["succeeded", "0", losses[0], "-", str(runs[0])] and "optim.lr=0.0001" in rows["0"]
    )
    assert rows["1"][1:6] == ["not-started", "2", "-", "-", str(runs[1])] and "optim.lr=-1" in rows["1"]
    assert rows["2"][1:6] == ["succeeded", "0", losses[2], "-", str(runs[2])]


def test_a_sweep_whose_point_cannot_start_is_refused_before_any_point_starts(tmp_path):
    """Point 1's directory holds an earlier run: refused (exit 2) by the single-run rules, naming
    the point, before point 0 starts; swept run_dir and a run_dir holding a run are refused too."""
    sweep = tmp_path / "sweep"
    (sweep / "1_optim.lr-0.003").mkdir(parents=True)
    (sweep / "1_optim.lr-0.003" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    command = [sys.executable, "-m", "dflash_mp.train", "-m", "optim.lr=1e-3,3e-3", f"run_dir={sweep}"]
    proc = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == outcome.EXIT_PREFLIGHT, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sweep refused, no point was started" in proc.stderr
    assert (
        f"point 1: run_dir={sweep / '1_optim.lr-0.003'} holds an earlier run (metrics.jsonl)" in proc.stderr
    )
    assert "train.resume=true" in proc.stderr and "point 0" not in proc.stderr
    assert sorted(p.name for p in sweep.iterdir()) == ["1_optim.lr-0.003"]  # nothing else was made


def test_the_up_front_check_takes_resume_overwrite_and_the_parent_into_account(tmp_path):
    from dflash_mp.launch.sweep_points import point_name, point_problem, sweep_problems

    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    cfg = compose_config([])
    assert "holds an earlier run" in point_problem(used, ["optim.lr=0.1"], cfg)
    assert point_problem(used, ["optim.lr=0.1", "train.resume=true"], cfg) is None
    assert point_problem(used, ["train.overwrite=true"], cfg) is None
    (used / "PREEMPTED").write_text("{}")  # a requeued point resumes
    assert point_problem(used, [], cfg) is None
    assert point_problem(tmp_path / "new", [], cfg) is None
    # The sweep's run_dir itself holding a run: refused, whatever its points.
    problems = sweep_problems(cfg, used, ["optim.lr"])
    assert len(problems) == 1 and f"run_dir={used} holds a run (metrics.jsonl)" in problems[0]
    # Names: index and swept overrides, what a path and a Hydra override read unquoted.
    overrides = ["optim.lr=0.001", "model.target_path=/m/Qwen3 8B", "train.max_steps=2", "+x.y=[1,2]"]
    assert point_name(3, overrides, ["optim.lr", "model.target_path", "x.y"]) == (
        "3_optim.lr-0.001_model.target_path-_m_Qwen3_8B_x.y-_1_2_"
    )
    assert point_name(0, overrides, []) == "0" and len(point_name(1, ["a=" + "x" * 300], ["a"])) == 100


def test_the_summary_has_each_points_final_loss_and_last_tau(tmp_path):
    from dflash_mp.launch.sweep import read_points, record_point, summary_table

    run = tmp_path / "0_optim.lr-0.001"
    run.mkdir()
    lines = [{"step": 1, "loss": 3.0, "tau": 1.5}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": None}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')
    record_point(tmp_path, 0, ["optim.lr=0.001"], 0, run)
    record_point(tmp_path, 1, ["optim.lr=-1"], 2, tmp_path / "1_optim.lr--1")
    records = read_points(tmp_path)
    assert (records[0]["final_loss"], records[0]["last_tau"], records[0]["last_step"]) == (2.5, 1.5, 2)
    rows = [line.split() for line in summary_table(records).splitlines()]
    assert rows[0][:5] == ["point", "outcome", "exit", "loss", "tau"]
    assert rows[1][:5] == ["0", "succeeded", "0", "2.5000", "1.50"]
    assert rows[2][:5] == ["1", "not-started", "2", "-", "-"]


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
    """slurm/train.sbatch as SLURM would run it on 2 nodes of one "GPU" each: two torchrun agents
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
            "slurm/train.sbatch",
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
    """slurm/train.sbatch's decisions, with srun standing in for a job that a rank failure tore down
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
        ["bash", "slurm/train.sbatch", "topology.targets=1", "topology.drafters=1"],
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
