"""The launcher: preflight before any worker starts, detached jobs operated with status and
stop, a run directory's lock, and the launcher killed. Sweeps and the SLURM script:
test_launch_batch.py; a used run directory and resumes: test_resume_e2e.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_mp.config.schema import compose_config
from dflash_mp.embedded import embedded_path
from dflash_mp.launch import doctor, outcome, supervisor
from dflash_mp.run import processes
from dflash_mp.run.rundir import LOCK_NAME
from dflash_mp.runtime.watchdog import EXIT_PREEMPTED, FAULT_ENV
from tests.conftest import REPO, job_env, read_metrics
from tests.test_faults import FAST, last_lines, leftovers, wait_until


def launch_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_mp.launch", *args],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("entry", ["dflash_mp.train", "dflash_mp.launch run"])
def test_a_bad_config_fails_before_any_worker_naming_every_field(tmp_path, entry):
    run = tmp_path / "bad"
    bad = ("train.micro_batch_size=0", f"data.train_files=[{tmp_path / 'missing.jsonl'}]")
    proc = subprocess.run(
        [sys.executable, "-m", *entry.split(), f"run_dir={run}", *bad],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == outcome.EXIT_PREFLIGHT, proc.stderr
    for field in ("train.micro_batch_size=0", "data.train_files[0]="):
        assert field in proc.stderr
        assert field in last_lines(run, 1)  # the job log ends with the outcome, naming the field
    assert f"RUN_DIR={run}" in proc.stdout
    # No worker ever started: no torchrun logs, no rank logs, no heartbeats.
    assert not (run / "logs" / "torchrun").exists() and not (run / "heartbeats").exists()
    assert not list((run / "logs").glob("rank*.log"))
    assert outcome.read_job_state(run)["exit_code"] == outcome.EXIT_PREFLIGHT
    # The launcher's standby agent (forked before the preflight on a machine without a GPU) ended
    # with it: nothing holds the run directory.
    assert not processes.holders_of(run / LOCK_NAME)


def test_the_config_change_from_the_preset_is_one_line():
    from dflash_mp.launch.launcher import config_changes

    changed = config_changes(compose_config(["train.max_steps=7", "topology.targets=1", "run_dir=/x"]))
    assert changed == (
        "config: experiment=embedded with 2 change(s): topology.targets=1 (preset: 2), train.max_steps=7 "
        "(preset: 1000)"
    )
    assert config_changes(compose_config([])) == "config: experiment=embedded as it is"
    custom = config_changes(compose_config(["experiment=qwen3-8b", "optim.lr=1e-4"]))
    assert custom.startswith("config: experiment=qwen3-8b with 1 change(s): optim.lr=0.0001 (preset: ")


def test_doctor_names_a_missing_target_once_counts_its_checks_and_warns_of_a_gpu_preset_on_cpu(
    tmp_path, monkeypatch
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    missing = tmp_path / "nowhere"
    checks = doctor.preflight(
        compose_config([f"model.target_path={missing}", "train.device=cpu"]), tmp_path / "run"
    )
    named = [c for c in checks if str(missing) in c.message and "no config.json" in c.message + c.name]
    assert [c.name for c in doctor.failed(checks) if "is not a directory" in c.message] == ["target"]
    assert not named, named  # the config check does not say it again
    bad = len(doctor.failed(checks))
    assert doctor.count_line(checks) == f"{len(checks)} checks: {len(checks) - bad} ok, {bad} failed"
    gpu = doctor.preflight(
        compose_config(["experiment=qwen3-8b", f"model.target_path={missing}"]), tmp_path / "run"
    )
    devices = next(c for c in gpu if c.name == "devices")
    assert devices.ok and devices.message.startswith("warning: no GPU is visible, so experiment=qwen3-8b")
    assert "(1 with a warning)" in doctor.count_line(gpu)
    embedded = doctor.preflight(compose_config([]), tmp_path / "run")
    assert next(c for c in embedded if c.name == "devices").message.startswith("CPU, ")


def test_doctor_names_a_busy_port_and_a_target_without_weights(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text((embedded_path("target") / "config.json").read_text())
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        checks = doctor.preflight(
            compose_config(
                [
                    "experiment=custom",
                    f"model.target_path={target}",
                    "topology=2t1d",
                    f"data.train_files=[{embedded_path('data/train.jsonl')}]",
                    "data.max_length=512",
                    "eval.every=0",
                ]
            ),
            tmp_path / "run",
            port=busy.getsockname()[1],
        )
    failed = {c.name: c.message for c in doctor.failed(checks)}
    assert set(failed) == {"target", "port"}, failed
    assert "no *.safetensors or *.bin weights" in failed["target"]
    assert "is in use" in failed["port"]
    assert {c.name for c in checks} >= {"imports", "config", "devices", "backends", "disk"}


def _heartbeat(run_dir, stop_requested: str | None) -> None:
    (run_dir / "heartbeats").mkdir()
    now = time.time()
    beat = dict(rank=0, role="target", host=socket.gethostname(), pid=os.getpid(), state="running")
    beat |= dict(phase="forward", step=1, progress_at=now, written_at=now, timeout_s=0.0)
    beat |= dict(stop_requested=stop_requested, error=None)
    (run_dir / "heartbeats" / "rank0.json").write_text(json.dumps(beat))


@pytest.mark.parametrize("ranks_got_it", [False, True])
def test_the_supervisor_passes_sigterm_on_only_when_no_rank_got_it(tmp_path, monkeypatch, ranks_got_it):
    """`kill SUPERVISOR` or `docker stop` reach the supervisor alone: it passes the signal on to
    torchrun. A signal to the whole process group reached torchrun already: no second one."""
    monkeypatch.setattr(supervisor, "FORWARD_AFTER_S", 0.0)
    _heartbeat(tmp_path, "SIGTERM" if ranks_got_it else None)
    agent = subprocess.Popen(["sleep", "60"])
    try:
        monitor = supervisor.JobMonitor(tmp_path, agent, job_id="none")
        monitor.on_signal(signal.SIGTERM, None)
        monitor.poll()
        if ranks_got_it:
            time.sleep(0.5)
            assert agent.poll() is None
        else:
            assert agent.wait(timeout=10) == -signal.SIGTERM
    finally:
        agent.kill()
        agent.wait()


def _steps_done(run) -> int:
    return len(read_metrics(run)) if (run / "metrics.jsonl").exists() else 0


@pytest.fixture
def adopt_orphans():
    """This process adopts orphans and must reap them, as an init that reaps does (docker --init)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(processes.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    yield
    prctl(processes.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.mark.slow
def test_a_detached_job_outlives_its_shell_and_obeys_status_and_stop(tmp_path, adopt_orphans):
    run = tmp_path / "detached"
    args = [f"run_dir={run}", "train.max_steps=100000", "topology.targets=1", "topology.drafters=1", *FAST]
    # A login shell in its own session, as over ssh: it starts the job and exits at once.
    # The drafter stalls at step 60 until the stop request: the job trains past the steps the test
    # waits for and then idles while start, status and stop run (at full speed it trained ~450
    # steps meanwhile, a quarter of the test's CPU time).
    shell = subprocess.Popen(
        ["bash", "-c", f"{sys.executable} -m dflash_mp.launch start {' '.join(args)}; exit"],
        cwd=REPO,
        env=job_env() | {FAULT_ENV: "rank=1,step=60,kind=stall,seconds=600"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = shell.communicate(timeout=60)
    state = outcome.read_job_state(run)
    try:
        assert shell.returncode == 0, err
        assert f"RUN_DIR={run}" in out and "started: supervisor pid" in out
        supervisor = state["pid"]
        assert supervisor == state["pgid"] == os.getsid(supervisor)  # its own session and group
        with pytest.raises(ProcessLookupError):  # the hang-up of the shell's group reaches nothing of it
            os.killpg(shell.pid, signal.SIGHUP)

        wait_until(lambda: _steps_done(run) >= 3, 120, "training to start")
        before = _steps_done(run)
        wait_until(lambda: _steps_done(run) > before + 2, 60, "training to go on without its shell")

        # One job per run directory: a second start is refused at once, naming the supervisor.
        second = launch_cli("start", *args)
        assert second.returncode == outcome.EXIT_PREFLIGHT
        assert f"pid {supervisor} on host {socket.gethostname()}" in second.stderr, second.stderr
        assert outcome.read_job_state(run)["pid"] == supervisor
        assert len(list((run / "logs" / "torchrun").iterdir())) == 1  # no second torchrun

        status = launch_cli("status", str(run))
        assert status.returncode == 0, status.stderr
        for line in ("state:      running", "last step:", "heartbeat:  last", "rank 1 drafter", "job.log"):
            assert line in status.stdout, status.stdout

        stop = launch_cli("stop", str(run), timeout=180)
        assert stop.returncode == 0 and "preempted: exit code 75" in stop.stdout, stop.stdout + stop.stderr
        # Adopted by this process, the supervisor has ended: reaping it here leaves no zombie.
        _, status_word = os.waitpid(supervisor, 0)
        assert os.waitstatus_to_exitcode(status_word) == EXIT_PREEMPTED
        wait_until(lambda: not leftovers(run, supervisor), 10, "the job's processes to go")
        assert (run / "PREEMPTED").exists()
        after = launch_cli("status", str(run)).stdout
        assert "state:      preempted" in after and "exit code:  75" in after
        # The log tail status shows: the agent's end in one line, not torchrun's SignalException stack.
        assert "Traceback" not in after and "SignalException" not in after, after
        assert "dflash_mp agent: stopped by SIGTERM, which it passed on to the ranks" in after, after
    finally:
        for pid in leftovers(run, state.get("pgid") or 0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("name", ["x.jsonl", "x.parquet"])
def test_data_without_a_usable_record_is_refused_under_plain_torchrun_too(tmp_path, name):
    """No launcher ran the preflight: rank 0 reads the data sample itself, every rank exits with
    the reason before loading a model, and nothing is trained or reported as done. Random bytes:
    as JSONL every line is a bad record; as Parquet the file is not one."""
    data = tmp_path / name
    # The same bytes on every run; a blank first line is not a record.
    data.write_bytes(b" \n" + random.Random(0).randbytes(4000))
    run = tmp_path / "binary"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + ["-m", "dflash_mp.train", "topology.targets=1", "topology.drafters=1", "train.max_steps=5"]
        + [f"data.train_files=[{data}]", f"run_dir={run}", *FAST],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    # Every rank exits with the reason (torchrun may end the slower one before it prints).
    if name.endswith(".jsonl"):
        assert re.search(
            r"dflash_mp: rank \d: refused: data: (\d+) of the \1 records are bad \(100.0%\)", output
        )
        # The first bad record by file:line (past the blank line; random bytes may hold more).
        assert re.search(rf"{re.escape(str(data))}:\d+: ", output) and "data.max_bad_fraction" in output
    else:
        assert re.search(rf"dflash_mp: rank \d: refused: data: {data}: not a readable Parquet file", output)
    log = (run / "logs" / "job.log").read_text()
    assert "preflight failed, no training started: data:" in log and "finished" not in log
    assert not (run / "metrics.jsonl").exists() and not (run / "heartbeats").exists()


def test_a_second_job_on_a_run_dir_is_refused_at_once_naming_the_holder(tmp_path):
    from tests.test_rundir import hold_lock

    run = tmp_path / "taken"
    holder = hold_lock(run)
    try:
        # Waiting for the lock would run into launch_cli's timeout instead of returning.
        proc = launch_cli("start", f"run_dir={run}", "topology.targets=1", "topology.drafters=1", *FAST)
        assert proc.returncode == outcome.EXIT_PREFLIGHT
        assert f"pid {holder.pid} on host {socket.gethostname()}" in proc.stderr, proc.stderr
        assert not (run / "job.json").exists() and not (run / "logs").exists()  # the holder's files untouched
    finally:
        holder.kill()
        holder.wait()


def test_each_job_keeps_its_compile_caches_under_the_run_dir_unless_set(tmp_path, monkeypatch):
    from dflash_mp.launch.supervisor import job_environment

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    env = job_environment(tmp_path, "job")
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cache" / "flash_attention")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/shared/fa4")
    assert job_environment(tmp_path, "job")["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == "/shared/fa4"


ORPHAN = """
import json, os, socket, sys, time
from pathlib import Path
from dflash_mp.run.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
os.ftruncate(lock.fd, 0)
os.pwrite(lock.fd, json.dumps({"pid": int(sys.argv[2]), "host": socket.gethostname()}).encode(), 0)
print("locked", flush=True)
time.sleep(600)
"""


def test_stop_and_status_work_from_the_run_dir_when_the_supervisor_is_gone(tmp_path):
    """A process of a job outlived its killed supervisor and holds the run directory: the refusal
    says the recorded pid has exited and names who holds the lock; status says so; stop ends it."""
    from dflash_mp.run.rundir import RunDirBusy, lock_run_dir

    run = tmp_path / "orphaned"
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(run), str(dead.pid)],
        cwd=REPO,
        env=job_env() | {processes.JOB_ID_ENV: "orphaned-job"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert left.stdout.readline().strip() == "locked"
        outcome.write_job_state(run, state="running", pid=dead.pid, pgid=dead.pid, job_id="orphaned-job")
        with pytest.raises(RunDirBusy) as busy:
            lock_run_dir(run)
        assert f"pid {dead.pid} on host {socket.gethostname()} took" in str(busy.value)
        assert f"has exited, but pid(s) [{left.pid}] still hold it" in str(busy.value)
        assert f"python -m dflash_mp.launch stop {run}" in str(busy.value)
        status = launch_cli("status", str(run))
        assert f"running without its supervisor (pid {dead.pid} is gone), pids [{left.pid}]" in status.stdout
        stop = launch_cli("stop", str(run), "--timeout", "30")
        assert stop.returncode == 0 and "Traceback" not in stop.stderr, stop.stdout + stop.stderr
        assert left.wait(timeout=30) == -signal.SIGTERM
        assert "stopped: exit code 143" in stop.stdout, stop.stdout
        lock_run_dir(run).release()  # free again
    finally:
        left.kill()
        left.wait()


def assert_ranks_forked_from_the_agent(run_dir, launcher: int) -> None:
    """On a machine without a GPU the launcher forks its torchrun agent (dflash_mp.launch.agent) and
    the agent every rank: the agent is the launcher's child running its command line, each rank the
    agent's child, with that command line too (no fresh interpreter) and, as under torchrun, its own
    session. Holding the run directory's lock, they are found as the job's processes."""
    from dflash_mp.runtime.watchdog import read_heartbeats

    state = outcome.read_job_state(run_dir)
    agent = state["agent_pid"]
    launcher_cmdline = processes.cmdline(launcher)
    assert processes.cmdline(agent) == launcher_cmdline, processes.cmdline(agent)
    assert Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(launcher)
    ranks = []
    for rank, beat in read_heartbeats(run_dir).items():
        pid = beat["pid"]
        ranks.append(pid)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ppid, session = int(fields[1]), int(fields[3])
        assert (ppid, session) == (agent, pid), f"rank {rank}: parent {ppid}, session {session}"
        assert processes.cmdline(pid) == launcher_cmdline, (
            f"rank {rank} was not forked: {processes.cmdline(pid)}"
        )
    found = processes.job_processes(state["job_id"], run_dir / LOCK_NAME)
    assert {agent, *ranks} <= set(found), (agent, ranks, found)
    # The forked agent writes into job.log, as the launcher's subprocess did.
    assert (
        f"starting {len(ranks)} rank(s) forked from this agent" in (run_dir / "logs" / "job.log").read_text()
    )


@pytest.mark.slow
def test_killing_the_launcher_ends_the_whole_job(tmp_path, adopt_orphans):
    """kill -9 of `python -m dflash_mp.launch run`: its torchrun agent gets the stop it would get
    from `stop` (the drafter checkpoints), every rank ends, the run directory is free again, and
    status and stop tell what happened."""
    from dflash_mp.run.rundir import lock_run_dir
    from tests.test_faults import LaunchedJob

    job = LaunchedJob(
        tmp_path / "launcher-killed", "train.max_steps=100000", "topology.targets=1", "topology.drafters=1"
    )
    try:
        job.wait_for_step(2)
        assert_ranks_forked_from_the_agent(job.run_dir, job.proc.pid)
        job_id = outcome.read_job_state(job.run_dir)["job_id"]
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait()

        def ended() -> bool:
            with contextlib.suppress(ChildProcessError):  # reap the adopted agent and ranks
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            return not processes.job_processes(job_id) and not leftovers(job.run_dir, job.proc.pid)

        wait_until(ended, 120, "the job's processes to end")
        lock_run_dir(job.run_dir).release()
        status = launch_cli("status", str(job.run_dir))
        assert f"state:      lost: its supervisor (pid {job.proc.pid}) is gone" in status.stdout, (
            status.stdout
        )
        stop = launch_cli("stop", str(job.run_dir))
        assert stop.returncode == 0 and "Traceback" not in stop.stderr, stop.stdout + stop.stderr
        assert f"nothing of the job is running: its supervisor (pid {job.proc.pid}) is gone" in stop.stdout
        assert "preempted: exit code 75" in stop.stdout and (job.run_dir / "PREEMPTED").exists(), stop.stdout
        assert "state:      preempted" in launch_cli("status", str(job.run_dir)).stdout
        # The agent's end is one line in job.log, not torchrun's stack.
        log = (job.run_dir / "logs" / "job.log").read_text()
        assert "dflash_mp agent: stopped by SIGTERM, which it passed on to the ranks" in log, log[-3000:]
        assert "SignalException" not in log, log[-3000:]
    finally:
        job.cleanup()


@pytest.mark.parametrize("command", ["status", "stop"])
def test_status_and_stop_of_a_path_that_is_no_run_directory_exit_2_naming_it(tmp_path, command) -> None:
    """A mistyped RUN_DIR is a bad argument (exit 2, like every entry point's), not an empty job."""
    typo = tmp_path / "no-such-run"
    proc = launch_cli(command, str(typo))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{typo}: not a run directory" in proc.stderr and "None" not in proc.stdout
    # The lock alone makes it one (plain torchrun's rank 0 takes it before writing job.log).
    typo.mkdir()
    (typo / LOCK_NAME).touch()
    proc = launch_cli(command, str(typo))
    assert proc.returncode == 0 and "not a run directory" not in proc.stderr, proc.stdout + proc.stderr


def test_stop_says_nothing_runs_when_the_supervisor_died_alone(tmp_path, capsys) -> None:
    """job.json still says running, no process of the job is left: stop says so and records it."""
    from dflash_mp.launch.detached import stop

    dead = subprocess.Popen(["true"])
    dead.wait()
    outcome.write_job_state(tmp_path, state="running", pid=dead.pid, pgid=dead.pid)
    assert stop(tmp_path, timeout_s=1) == 0
    out = capsys.readouterr().out
    assert f"nothing of the job is running: its supervisor (pid {dead.pid}) is gone" in out, out
    assert "(running)" not in out and "failed: exit code 1" in out


def test_the_launcher_and_its_preflight_import_no_torch() -> None:
    """`python -m dflash_mp.launch status|stop|start` and the launcher's preflight: each import of
    torch costs every job's launcher about a CPU-second (a config check reaching a model module)."""
    code = "import sys, dflash_mp.launch.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]
