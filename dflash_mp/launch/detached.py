"""Jobs that outlive the terminal: `start` (detached supervisor), `status` and `stop` of a run directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dflash_mp.launch.outcome import (
    EXIT_FAILED,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    EXIT_SUCCEEDED,
    Outcome,
    read_job_state,
    write_job_state,
    write_outcome,
)
from dflash_mp.run.logs import job_log_path
from dflash_mp.run.processes import alive, cmdline, holders_of, job_processes, kill
from dflash_mp.run.rundir import LOCK_NAME, RunDirLock
from dflash_mp.runtime.watchdog import preempted_marker, read_heartbeats

STOP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0  # for the detached supervisor to record itself in job.json


def start_detached(run_dir: Path, nproc: int, targets: int, overrides: list[str], lock: RunDirLock) -> int:
    """Start a supervisor that belongs to no terminal: double fork, own session, output to job.log.
    It inherits the run directory's lock, so the lock is never free between this process and it."""
    argv = [sys.executable, "-m", "dflash_mp.launch", "_supervise", "--nproc", str(nproc)]
    argv += ["--targets", str(targets), "--lock-fd", str(lock.fd), str(run_dir), *overrides]
    write_job_state(run_dir, state="starting", pid=None, exit_code=None, summary=None)
    sys.stdout.flush()
    sys.stderr.flush()
    os.set_inheritable(lock.fd, True)
    child = os.fork()
    if child == 0:
        try:
            if os.fork() != 0:
                os._exit(0)  # the middle process ends at once: init adopts the supervisor
            os.setsid()  # own session and process group: no SIGHUP when the ssh session ends
            null = os.open(os.devnull, os.O_RDONLY)
            log = os.open(job_log_path(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.execv(sys.executable, argv)
        finally:
            os._exit(127)  # only reached if exec failed
    os.waitpid(child, 0)  # reap the middle process: the caller keeps no zombie
    deadline = time.monotonic() + START_TIMEOUT_S
    while (state := read_job_state(run_dir)).get("state") == "starting" and time.monotonic() < deadline:
        time.sleep(0.1)
    if state.get("state") != "running":
        print(f"dflash_mp: the supervisor did not start; see {job_log_path(run_dir)}", file=sys.stderr)
        if state.get("state") == "starting":
            write_outcome(
                run_dir,
                Outcome("failed", EXIT_FAILED, "the detached supervisor did not start"),
                START_TIMEOUT_S,
            )
        return EXIT_FAILED
    print(
        f"started: supervisor pid {state['pid']}, process group {state['pgid']}\n"
        f"  status: python -m dflash_mp.launch status {run_dir}\n"
        f"  stop:   python -m dflash_mp.launch stop {run_dir}",
        flush=True,
    )
    return EXIT_SUCCEEDED


def _age(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(max(seconds, 0)))


def _last_metrics(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - 8192, 0))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:  # a line being written, or cut by the seek
            continue
    return None


def _supervisor(state: dict[str, Any]) -> int | None:
    """The pid of the launch's supervisor while it lives (the pid may have been reused since)."""
    pid = state.get("pid")
    return pid if pid and alive(pid) and b"dflash_mp" in cmdline(pid) else None


def _owned(run_dir: Path, state: dict[str, Any]) -> list[int]:
    """Live processes of the job: its supervisor, what the job started (by the job's id), and
    whatever still holds the run directory's lock (plain torchrun's rank 0, an orphaned agent)."""
    pids = set(job_processes(state["job_id"]) if state.get("job_id") else [])
    pids |= set(holders_of(run_dir / LOCK_NAME))
    if supervisor := _supervisor(state):
        pids.add(supervisor)
    return sorted(pids)


def _is_run_dir(run_dir: Path, state: dict[str, Any]) -> bool:
    """A job started here: the launcher's job.json, the job's log, or the lock (plain torchrun's rank 0
    takes it before it writes the log)."""
    return bool(state) or job_log_path(run_dir).exists() or (run_dir / LOCK_NAME).exists()


def _not_a_run_dir(run_dir: Path) -> int:
    """A mistyped RUN_DIR: say so (exit 2, a bad argument) rather than report a job that never was."""
    print(
        f"{run_dir}: not a run directory (no job.json, logs/job.log or {LOCK_NAME}): give the run_dir "
        "a job was started with",
        file=sys.stderr,
    )
    return 2


def status(run_dir: Path) -> int:
    """Print running / finished / failed ..., exit code, last step, heartbeat ages, last log lines."""
    state, log_path = read_job_state(run_dir), job_log_path(run_dir)
    if not _is_run_dir(run_dir, state):
        return _not_a_run_dir(run_dir)
    now = time.time()
    beats = read_heartbeats(run_dir)
    label = state.get("state", "unknown (not started by dflash_mp.launch)")
    if label in ("starting", "running") and not _supervisor(state):
        if left := _owned(run_dir, state):
            label = (
                f"running without its supervisor (pid {state.get('pid')} is gone), pids {left}: "
                f"end them with python -m dflash_mp.launch stop {run_dir}"
            )
        else:
            label = f"lost: its supervisor (pid {state.get('pid')}) is gone without writing an outcome"
    elif label.startswith("unknown") and any(b["state"] == "running" for b in beats.values()):
        label = "running (ranks report heartbeats)"
    print(f"run_dir:    {run_dir}\nstate:      {label}")
    if state.get("exit_code") is not None:
        print(f"exit code:  {state['exit_code']} ({state.get('summary')})")
    if state.get("pid"):
        print(f"supervisor: pid {state['pid']}, process group {state.get('pgid')} on {state.get('host')}")
    last = _last_metrics(run_dir)
    if last is not None:
        loss = "-" if last["loss"] is None else f"{last['loss']:.4f}"  # None: a step without loss tokens
        print(f"last step:  {last['step']} (loss {loss}, lr {last['lr']:.3g})")
    if beats:
        newest = max(b["written_at"] for b in beats.values())
        print(f"heartbeat:  last {now - newest:.1f}s ago")
        for rank, b in sorted(beats.items()):
            print(
                f"  rank {rank} {b['role']:9} {b['state']:9} phase {b['phase']:10} step {b['step']:<6} "
                f"progress {_age(now - b['progress_at'])} ago  pid {b['pid']}@{b['host']}"
            )
    if log_path.exists():
        print(f"--- last lines of {log_path}")
        print("\n".join(log_path.read_text(errors="replace").splitlines()[-10:]))
    return 0


def stop(run_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the job (drafters checkpoint at the next step), SIGKILL what is left after `timeout_s`.
    Works from the run directory alone, whichever of the job's processes is already gone."""
    state = read_job_state(run_dir)
    if not _is_run_dir(run_dir, state):
        return _not_a_run_dir(run_dir)
    started = time.monotonic()
    owned = _owned(run_dir, state)
    supervisor, pgid = _supervisor(state), state.get("pgid")
    # A detached job leads its own process group; a foreground one shares the shell's, which must
    # not be signalled: there the supervisor passes the signal on to torchrun itself.
    own_group = supervisor is not None and supervisor == pgid
    if not owned:
        print(f"{run_dir}: {_nothing_running(state)}")
    elif own_group:
        print(f"stopping {run_dir}: SIGTERM to process group {pgid}", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    elif supervisor is not None:
        print(f"stopping {run_dir}: SIGTERM to the supervisor, pid {supervisor}", flush=True)
        kill([supervisor], signal.SIGTERM)
    else:
        # torchrun's agent turns SIGTERM into the ranks' graceful stop; without it, the ranks.
        agent = state.get("agent_pid")
        first = [agent] if agent in owned else owned
        print(
            f"stopping {run_dir}: its supervisor (pid {state.get('pid')}) is gone; SIGTERM to {first}",
            flush=True,
        )
        kill(first, signal.SIGTERM)
    while _owned(run_dir, state) and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    if left := _owned(run_dir, state):
        print(f"still running after {timeout_s:g}s: SIGKILL to {left}", flush=True)
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        kill(left)
        while _owned(run_dir, state) and time.monotonic() - started < timeout_s + 10:
            time.sleep(0.2)
    if read_job_state(run_dir).get("state") in ("starting", "running"):  # no supervisor wrote the end
        _record_lost_supervisor(run_dir, state, bool(owned), time.monotonic() - started)
    final = read_job_state(run_dir)
    print(f"{final.get('state')}: exit code {final.get('exit_code')}: {final.get('summary')}")
    return 0


def _nothing_running(state: dict[str, Any]) -> str:
    """What `stop` says of a run directory none of whose processes lives."""
    recorded = state.get("state")
    if recorded in ("starting", "running"):
        return (
            f"nothing of the job is running: its supervisor (pid {state.get('pid')}) is gone without "
            "writing an outcome"
        )
    if recorded is None:
        return "nothing is running (no job.json: not started by dflash_mp.launch)"
    return f"not running: job.json records {recorded}, exit code {state.get('exit_code')}"


def _record_lost_supervisor(run_dir: Path, state: dict[str, Any], stopped: bool, elapsed_s: float) -> None:
    """The outcome of a job whose supervisor ended without writing it (killed, or killed by `stop`)."""
    who = f"its supervisor (pid {state.get('pid')}) ended without writing an outcome"
    marker = preempted_marker(run_dir)
    if marker.exists():  # the ranks got their stop and the drafters checkpointed
        step = json.loads(marker.read_text())["step"]
        outcome = Outcome(
            "preempted",
            EXIT_PREEMPTED,
            f"{who}; stopped with a checkpoint at step {step}; continue with train.resume=true",
        )
    elif stopped:
        outcome = Outcome("stopped", EXIT_STOPPED, f"{who}; `stop` ended what was left before a checkpoint")
    else:
        outcome = Outcome("failed", EXIT_FAILED, f"{who}; nothing of the job was left running")
    write_outcome(run_dir, outcome, elapsed_s)
