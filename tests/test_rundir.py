"""The run directory: one job at a time (an OS lock), no fresh start over an earlier run, config
changes on resume recorded; the process groups' timeout against the watchdog; wandb ids."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from dflash_mp.config.schema import ConfigError, compose_config
from dflash_mp.config.validation import validate
from dflash_mp.run.metrics import wandb_run_id
from dflash_mp.run.rundir import (
    CONFIG_HISTORY_NAME,
    RunDirBusy,
    clear_run_dir,
    fresh_start_problem,
    lock_run_dir,
    record_config,
)
from dflash_mp.runtime.distributed import process_group_timeout_s
from dflash_mp.runtime.watchdog import PEER_GRACE_S
from tests.conftest import REPO, job_env

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dflash_mp.run.rundir import lock_run_dir
    lock_run_dir(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(600)
""")


def hold_lock(run_dir) -> subprocess.Popen:
    """Another process holding the run directory's lock, as a running job's supervisor does."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)],
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_the_lock_names_its_holder_and_goes_with_it_even_on_sigkill(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirBusy) as busy:
            lock_run_dir(tmp_path)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(busy.value)
        assert str(tmp_path) in str(busy.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = lock_run_dir(tmp_path)  # the kernel dropped the dead holder's lock: no stale pid file
    assert json.loads((tmp_path / "job.lock").read_text())["pid"] == os.getpid()
    lock.release()


def _earlier_run(run_dir) -> None:
    (run_dir / "checkpoints" / "step_00000007").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "job.log").write_text("earlier run\n")
    (run_dir / "logs" / "rank0-target.log").write_text("earlier rank\n")


def test_a_fresh_start_over_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    assert fresh_start_problem(tmp_path, resume=False, overwrite=False) is None  # empty: fine
    _earlier_run(tmp_path)
    problem = fresh_start_problem(tmp_path, resume=False, overwrite=False)
    assert problem is not None and f"run_dir={tmp_path}" in problem
    for way_out in ("train.resume=true", "a new run_dir", "train.overwrite=true", "step_00000007"):
        assert way_out in problem
    assert fresh_start_problem(tmp_path, resume=True, overwrite=False) is None
    lock = lock_run_dir(tmp_path)
    removed = clear_run_dir(tmp_path)
    assert set(removed) == {"checkpoints", "metrics.jsonl"}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["job.lock", "job.log", "logs"]
    assert fresh_start_problem(tmp_path, resume=False, overwrite=False) is None
    lock.release()
    with pytest.raises(ConfigError, match="train.overwrite=true clears run_dir"):
        validate(compose_config(["train.resume=true", "train.overwrite=true"]))


def test_a_resume_with_a_different_config_is_recorded_next_to_config_yaml(tmp_path):
    first = {"optim": {"lr": 6e-4}, "train": {"resume": False, "max_steps": 10}, "run_dir": "a"}
    assert record_config(tmp_path, first, resume=False) == {}
    same = {"optim": {"lr": 6e-4}, "train": {"resume": True, "max_steps": 10}, "run_dir": "/abs/a"}
    assert record_config(tmp_path, same, resume=True) == {}  # resume and run_dir are no change
    assert not (tmp_path / CONFIG_HISTORY_NAME).exists()
    changed = {"optim": {"lr": 3e-4}, "train": {"resume": True, "max_steps": 20}, "run_dir": "a"}
    changes = record_config(tmp_path, changed, resume=True)
    assert changes == {"optim.lr": {"old": 6e-4, "new": 3e-4}, "train.max_steps": {"old": 10, "new": 20}}
    history = [json.loads(line) for line in (tmp_path / CONFIG_HISTORY_NAME).read_text().splitlines()]
    assert len(history) == 1 and history[0]["changes"] == changes
    assert "lr: 0.0006" in (tmp_path / "config.yaml").read_text()  # the run's original config stays


def test_the_process_groups_time_out_after_the_watchdog_would_have_fired(tmp_path):
    """A rank waiting on a stuck peer must be outlived by the watchdog that names the peer: the
    groups init_job builds time out after watchdog.timeout_s plus more than the waiting grace."""
    script = textwrap.dedent("""
        import sys, torch
        from dflash_mp.runtime.distributed import init_job, process_group_timeout_s
        from dflash_mp.runtime.topology import Topology
        job = init_job(Topology(1, 1, 1), "cpu", timeout_s=process_group_timeout_s(float(sys.argv[1])),
                       drafter_group=False)
        for group in (torch.distributed.group.WORLD, job.meta_group):
            print(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    """)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = job_env() | dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run(
        [sys.executable, "-c", script, "900"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    timeouts = [float(line) for line in proc.stdout.split()]
    assert len(timeouts) == 2 and all(t > 900 + PEER_GRACE_S + 10 for t in timeouts), timeouts
    assert process_group_timeout_s(3000) > 3000 + PEER_GRACE_S + 10
    assert process_group_timeout_s(0) >= 1800  # no watchdog: long, but not forever


def test_wandb_run_ids_follow_the_absolute_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "sweep-a" / "0", tmp_path / "sweep-b" / "0"
    assert wandb_run_id(first) != wandb_run_id(second)  # sweep points of two sweeps
    assert wandb_run_id("sweep-a/0") == wandb_run_id(first)  # relative or absolute: one run
    assert all(c.isalnum() or c in "-_" for c in wandb_run_id(first))
