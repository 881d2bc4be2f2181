"""The supervisor of one job: starts torchrun, watches the ranks, ends job.log with the outcome.

torchrun and every rank write into job.log; the supervisor watches the ranks' heartbeats (a rank
that stopped or froze is caught here even when its own watchdog thread cannot run), passes a
stop signal that reached it alone on to torchrun, kills what the job left, and writes the outcome
(dflash_mp.launch.outcome). It holds the run directory's lock, shared with the torchrun agent, for
the job's whole life.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from subprocess import Popen

from dflash_mp.launch.agent import AgentZygote, ForkedAgent
from dflash_mp.launch.agent import start as start_agent
from dflash_mp.launch.outcome import StopRequest, error_files, judge, write_job_state, write_outcome
from dflash_mp.run import startup
from dflash_mp.run.logs import append_job_log, job_log_path
from dflash_mp.run.processes import (
    JOB_ID_ENV,
    alive,
    become_subreaper,
    job_processes,
    kill,
    reap_orphans,
)
from dflash_mp.run.rundir import LOCK_NAME, RunDirLock
from dflash_mp.runtime.watchdog import PEER_GRACE_S, heartbeat_dir, preempted_marker, read_heartbeats

# Signals torchrun's agent turns into a graceful shutdown (the same signal to the workers, SIGKILL
# after the grace). SIGUSR1 (SLURM's `--signal=USR1@T`) and SIGUSR2 (submitit's) are added so a
# warning before the time limit reaches the workers instead of killing the agent.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# torchrun's grace between SIGTERM and SIGKILL: time for the drafters to finish a step and checkpoint.
SHUTDOWN_GRACE_S = 60
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # passed on when no rank got them
POLL_S = 0.2
# A stop signal sent to the launcher alone (docker stop, `kill PID`) is passed on to torchrun
# when no rank reports it after this long; a signal to the whole process group reached them all.
FORWARD_AFTER_S = 3.0
# The launcher kills a rank stuck beyond its own watchdog's limit by this much (the in-process
# watchdog should have acted; the launcher is the backstop).
LAUNCHER_GRACE_S = 10.0


def job_environment(run_dir: Path, job_id: str) -> dict[str, str]:
    """Environment for torchrun and the workers: caches and traces private to this job."""
    env = dict(os.environ)
    cache = run_dir / "cache"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    # FlashAttention 4's compiled kernels (train.attention=flash), on disk for a resumed or restarted
    # job to load instead of compiling again; FA4 writes them under a file lock, renamed into place.
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(cache / "flash_attention"))
    # NCCL flight recorder: on a collective timeout each rank dumps its last NCCL calls here.
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir / "nccl_trace" / "rank_"))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    env[JOB_ID_ENV] = job_id  # also tells the ranks that this supervisor holds the run directory
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path, log_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_mp.launch.agent",  # torchrun; on a machine without a GPU it forks the ranks (see there)
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        f"--signals-to-handle={TORCHRUN_SIGNALS}",
        f"--log-dir={log_dir}",
        "-m",
        "dflash_mp.train",
        *overrides,
        f"run_dir={run_dir}",
    ]


class JobMonitor:
    """What the supervisor learns while torchrun runs: who vanished when, who hung, which signal came."""

    def __init__(self, run_dir: Path, agent: Popen | ForkedAgent, job_id: str) -> None:
        self.run_dir, self.agent, self.job_id = run_dir, agent, job_id
        self.lock_path = run_dir / LOCK_NAME
        self.host = socket.gethostname()
        self.last_alive: dict[int, float] = {}
        self.vanished: dict[int, float] = {}  # rank -> last time it was seen alive
        self.hung: str | None = None
        self.stop: StopRequest | None = None  # the first stop signal from outside
        self._signal_mono = 0.0
        self._forwarded = False

    @property
    def signal(self) -> signal.Signals | None:
        return self.stop.signal if self.stop else None

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stop is None:
            self.stop, self._signal_mono = StopRequest(signal.Signals(signum), time.time()), time.monotonic()

    def poll(self) -> None:
        now = time.time()
        beats = {r: b for r, b in read_heartbeats(self.run_dir).items() if b["host"] == self.host}
        for rank, beat in beats.items():
            if alive(beat["pid"]):
                self.last_alive[rank] = now
            elif beat["state"] == "running" and rank not in self.vanished:
                self.vanished[rank] = self.last_alive.get(rank, now)
        self._check_hang(beats, now)
        self._forward_signal(beats)

    def _check_hang(self, beats: dict[int, dict], now: float) -> None:
        if self.hung is not None:
            return
        # The stalest heartbeat first: a frozen rank, not the ranks left waiting for it.
        for rank, beat in sorted(beats.items(), key=lambda item: (item[1]["written_at"], item[0])):
            timeout = beat["timeout_s"]
            if beat["state"] != "running" or timeout <= 0 or not alive(beat["pid"]):
                continue
            silent, idle = now - beat["written_at"], now - beat["progress_at"]
            if silent > timeout:
                why = (
                    f"its heartbeat thread has not run for {silent:.0f}s: the process is stopped or "
                    "frozen (SIGSTOP, a native call holding the GIL, swapped out)"
                )
            elif idle > timeout + PEER_GRACE_S + LAUNCHER_GRACE_S:
                why = f"no progress for {idle:.0f}s and its own watchdog did not end it"
            else:
                continue
            self.hung = (
                f"rank {rank} ({beat['role']}) hung in phase {beat['phase']!r} at step {beat['step']}: {why}"
            )
            append_job_log(self.run_dir, f"launcher watchdog: {self.hung}; killing the job")
            kill(job_processes(self.job_id, self.lock_path))
            return

    def _forward_signal(self, beats: dict[int, dict]) -> None:
        if self.signal not in STOP_SIGNALS or self._forwarded:
            return
        if time.monotonic() - self._signal_mono < FORWARD_AFTER_S:
            return
        self._forwarded = True
        if not any(beat["stop_requested"] for beat in beats.values()) and self.agent.poll() is None:
            append_job_log(self.run_dir, f"launcher: passing {self.signal.name} on to torchrun")
            self.agent.send_signal(self.signal)


class _Echo:
    """Copies what is appended to job.log to this terminal (foreground runs)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 (read until the job ends)
        self.file.seek(0, os.SEEK_END)
        self.enabled = True

    def pump(self) -> None:
        data = self.file.read()
        if data and self.enabled:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except OSError:  # the terminal went away; job.log still has everything
                self.enabled = False


def supervise(
    run_dir: Path,
    nproc: int,
    targets: int,
    overrides: list[str],
    echo: bool,
    lock: RunDirLock,
    zygote: AgentZygote | None = None,
) -> int:
    """Run one torchrun job to its end and write the outcome; returns the job's exit code."""
    startup.resume()
    job_id = uuid.uuid4().hex[:16]
    log_dir = run_dir / "logs" / "torchrun" / job_id
    for stale in [preempted_marker(run_dir), *heartbeat_dir(run_dir).glob("rank*.json")]:
        stale.unlink(missing_ok=True)  # left by an earlier attempt in this run directory
    (run_dir / "nccl_trace").mkdir(parents=True, exist_ok=True)
    become_subreaper()
    echo_to_terminal = _Echo(job_log_path(run_dir)) if echo else None
    agent, started = _start_torchrun(run_dir, job_id, log_dir, nproc, overrides, lock, zygote)
    monitor = JobMonitor(run_dir, agent, job_id)
    previous = {sig: signal.signal(sig, monitor.on_signal) for sig in LAUNCHER_SIGNALS}
    try:
        while agent.poll() is None:
            monitor.poll()
            reap_orphans(agent.pid)
            if echo_to_terminal is not None:
                echo_to_terminal.pump()
            time.sleep(POLL_S)
        monitor.poll()
        _kill_leftovers(run_dir, job_id, lock.path)
        outcome = judge(
            run_dir,
            agent.returncode,
            nproc=nproc,
            targets=targets,
            errors=error_files(log_dir),
            vanished=monitor.vanished,
            stop=monitor.stop,
            launcher_hang=monitor.hung,
        )
        write_outcome(run_dir, outcome, time.monotonic() - started)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reap_orphans(None)
    if echo_to_terminal is not None:
        echo_to_terminal.pump()
        echo_to_terminal.file.close()
    if monitor.signal is signal.SIGUSR2 and callable(previous[signal.SIGUSR2]):
        # Under submitit, SIGUSR2 announces the time limit: the job has checkpointed, now its own
        # handler requeues the job (and the requeued sweep point resumes).
        previous[signal.SIGUSR2](signal.SIGUSR2, None)
    return outcome.exit_code


def _start_torchrun(
    run_dir: Path,
    job_id: str,
    log_dir: Path,
    nproc: int,
    overrides: list[str],
    lock: RunDirLock,
    zygote: AgentZygote | None,
) -> tuple[Popen | ForkedAgent, float]:
    """(torchrun's agent, the monotonic time it started), the job's state written as running."""
    command = torchrun_command(nproc, overrides, run_dir, log_dir)
    append_job_log(run_dir, f"launching {nproc} process(es) with torchrun: {shlex.join(command)}")
    started = time.monotonic()
    agent = start_agent(
        command,
        job_environment(run_dir, job_id),
        job_log_path(run_dir),
        lock.fd,
        zygote,
    )
    write_job_state(
        run_dir,
        state="running",
        pid=os.getpid(),
        pgid=os.getpgrp(),
        agent_pid=agent.pid,
        job_id=job_id,
        host=socket.gethostname(),
        started_at=time.time(),
        exit_code=None,
        summary=None,
    )
    return agent, started


def _kill_leftovers(run_dir: Path, job_id: str, lock_path: Path) -> None:
    """Kill the job's processes still alive once torchrun has ended, and wait for them to go."""
    leftovers = job_processes(job_id, lock_path)
    if leftovers:
        append_job_log(run_dir, f"launcher: killing {len(leftovers)} process(es) the job left: {leftovers}")
        kill(leftovers)
        deadline = time.monotonic() + 5  # SIGKILL is asynchronous: let them die before the last reap
        while any(alive(pid) for pid in leftovers) and time.monotonic() < deadline:
            time.sleep(0.05)
