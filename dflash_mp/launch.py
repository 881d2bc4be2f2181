"""Local launcher: one torchrun job per run directory; no silent failure, no zombie, no orphan.

    python -m dflash_mp.launch run    [key=value ...]   # foreground, like python -m dflash_mp.train
    python -m dflash_mp.launch start  [key=value ...]   # detached: outlives the terminal/ssh session
    python -m dflash_mp.launch status RUN_DIR
    python -m dflash_mp.launch stop   RUN_DIR [--timeout S]
    python -m dflash_mp.launch doctor [--nnodes N] [--nproc-per-node P] [--port P] [key=value ...]

The run directory and logs/job.log exist, and their paths are printed, before anything can
fail; the preflight checks of dflash_mp.doctor pass before torchrun starts; torchrun and every
rank write into job.log; a supervisor watches the ranks' heartbeats and ends job.log with the
outcome: exit code, the first failing rank with its role, and its traceback (from the error
file torchrun's `@record` wrote for it). Everything the job starts carries DFLASH_MP_JOB_ID in
its environment, so what the job left behind is found and killed by that, never by name.

Exit codes of a job (`run`, the supervisor of `start`, `python -m dflash_mp.train`):
    0  succeeded
    1  failed: a rank raised or died (job.log names the first one and ends with its traceback)
    2  preflight failed: bad config or environment, no worker was started
    3  hung: a rank made no progress for watchdog.timeout_s (or was stopped/frozen)
   75  preempted: a checkpoint was written at a step boundary; requeue with train.resume=true
  130  interrupted by SIGINT before a checkpoint
  143  stopped by SIGTERM before a checkpoint could be written
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dflash_mp.logs import append_job_log, job_log_path
from dflash_mp.watchdog import (
    EXIT_HUNG,
    EXIT_PREEMPTED,
    PEER_GRACE_S,
    heartbeat_dir,
    preempted_marker,
    read_heartbeats,
)

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1  # a rank raised or died
EXIT_PREFLIGHT = 2  # bad config or environment; no worker was started
EXIT_INTERRUPTED = 130  # Ctrl-C before a checkpoint
EXIT_STOPPED = 143  # SIGTERM before a checkpoint could be written
# EXIT_HUNG (3) and EXIT_PREEMPTED (75) come from dflash_mp.watchdog: the ranks exit with them.

JOB_ID_ENV = "DFLASH_MP_JOB_ID"
# Signals torchrun's agent turns into a graceful shutdown (SIGTERM to the workers, SIGKILL after
# the grace). SIGUSR1 is added so SLURM's `--signal=USR1@T` warning reaches the workers instead
# of killing the agent.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# torchrun's grace between SIGTERM and SIGKILL: time for the drafters to finish a step and checkpoint.
SHUTDOWN_GRACE_S = 60
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.2
# A stop signal sent to the launcher alone (docker stop, `kill PID`) is passed on to torchrun
# when no rank reports it after this long; a signal to the whole process group reached them all.
FORWARD_AFTER_S = 3.0
# The launcher kills a rank stuck beyond its own watchdog's limit by this much (the in-process
# watchdog should have acted; the launcher is the backstop).
LAUNCHER_GRACE_S = 10.0
STOP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0  # for the detached supervisor to record itself in job.json
PR_SET_CHILD_SUBREAPER = 36


# ------------------------------------------------------------------------------ environment


def job_environment(run_dir: Path, job_id: str) -> dict[str, str]:
    """Environment for torchrun and the workers: caches and traces private to this job."""
    env = dict(os.environ)
    cache = run_dir / "cache"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    # NCCL flight recorder: on a collective timeout each rank dumps its last NCCL calls here.
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir / "nccl_trace" / "rank_"))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    env[JOB_ID_ENV] = job_id
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path, log_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
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


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ------------------------------------------------------------------------------ processes


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, None when it does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = data[data.rindex(")") + 2 :].split()  # the command name may contain spaces
    return fields[0], int(fields[1]), int(fields[2])


def alive(pid: int) -> bool:
    """Running or stopped; a zombie is dead (it only waits to be reaped)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid`, zombies included."""
    return [pid for pid in _all_pids() if (stat := _proc_stat(pid)) is not None and stat[2] == pgid]


def zombie_children(ppid: int) -> list[int]:
    return [pid for pid in _all_pids() if (stat := _proc_stat(pid)) is not None and stat[:2] == ("Z", ppid)]


def job_processes(job_id: str) -> list[int]:
    """Live processes started for job `job_id` (torchrun, ranks, their helpers), by environment."""
    marker = f"{JOB_ID_ENV}={job_id}".encode()
    found = []
    for pid in _all_pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if marker in environ.split(b"\0") and alive(pid):
            found.append(pid)
    return found


def _kill(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, sig)


def _become_subreaper() -> None:
    """Ranks whose torchrun agent died are re-parented to this process, which reaps them,
    instead of lingering as <defunct> under a PID 1 that never reaps (a bare container)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: init adopts orphans as usual
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_orphans(agent_pid: int | None) -> None:
    """Reap exited children other than the agent (Popen reaps that one): the supervisor's only
    other children are ranks adopted as a subreaper."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == agent_pid:
            return
        os.waitpid(info.si_pid, 0)


# ------------------------------------------------------------------------------ job state


def job_state_path(run_dir: Path) -> Path:
    return run_dir / "job.json"


def read_job_state(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(job_state_path(run_dir).read_text())
    except (OSError, ValueError):
        return {}


def write_job_state(run_dir: Path, **fields: Any) -> None:
    """Merge `fields` into RUN_DIR/job.json (pid, pgid, state, exit code ... of the launch)."""
    state = read_job_state(run_dir) | fields
    tmp = job_state_path(run_dir).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, job_state_path(run_dir))


@dataclass
class Outcome:
    state: str  # succeeded | failed | hung | preempted | interrupted | stopped
    exit_code: int
    summary: str
    details: list[str] = field(default_factory=list)  # the root cause's traceback


def write_outcome(run_dir: Path, outcome: Outcome, elapsed_s: float) -> None:
    """The last lines of job.log (and job.json): what happened, whom to blame, its traceback."""
    if outcome.details:
        append_job_log(run_dir, "root cause:\n" + "\n".join(outcome.details).rstrip())
    verdict = outcome.state if outcome.exit_code == 0 else outcome.state.upper()
    append_job_log(
        run_dir, f"job {verdict}: exit code {outcome.exit_code} after {elapsed_s:.1f}s: {outcome.summary}"
    )
    write_job_state(
        run_dir,
        state=outcome.state,
        exit_code=outcome.exit_code,
        summary=outcome.summary,
        ended_at=time.time(),
    )


# ------------------------------------------------------------------------------ supervising


class JobMonitor:
    """What the supervisor learns while torchrun runs: who vanished when, who hung, which signal came."""

    def __init__(self, run_dir: Path, agent: subprocess.Popen, job_id: str) -> None:
        self.run_dir, self.agent, self.job_id = run_dir, agent, job_id
        self.host = socket.gethostname()
        self.last_alive: dict[int, float] = {}
        self.vanished: dict[int, float] = {}  # rank -> last time it was seen alive
        self.hung: str | None = None
        self.signal: signal.Signals | None = None
        self._signal_at = 0.0
        self._forwarded = False

    def on_signal(self, signum: int, frame: object) -> None:
        if self.signal is None:
            self.signal, self._signal_at = signal.Signals(signum), time.monotonic()

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
        for rank, beat in sorted(beats.items()):
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
            _kill(job_processes(self.job_id))
            return

    def _forward_signal(self, beats: dict[int, dict]) -> None:
        if self.signal not in (signal.SIGTERM, signal.SIGUSR1) or self._forwarded:
            return
        if time.monotonic() - self._signal_at < FORWARD_AFTER_S:
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


def _error_files(log_dir: Path) -> dict[int, dict[str, Any]]:
    """torchrun's error files (written by @record) by local rank: message, traceback, timestamp."""
    found = {}
    for path in log_dir.glob("*/attempt_*/*/error.json"):
        try:
            message = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError):
            continue
        if isinstance(message, dict):
            extra = message.get("extraInfo", {})
            found[int(path.parent.name)] = {
                "message": message.get("message", ""),
                "traceback": extra.get("py_callstack", ""),
                "timestamp": float(extra.get("timestamp", 0)),
            }
    return found


def _first_failure(
    beats: dict[int, dict], vanished: dict[int, float], errors: dict[int, dict], targets: int
) -> Outcome | None:
    """The failure that came first. A rank that vanished is dated by when it was last seen alive,
    so the ranks that failed because of it (a closed connection) always come after it."""
    events = []
    for rank, beat in beats.items():
        if beat["state"] == "failed":
            events.append((beat["written_at"], rank, beat["role"], f"raised {beat['error']}"))
        elif beat["state"] == "running" and rank in vanished:
            what = "died without a Python traceback (killed by a signal, the OOM killer, or a native crash)"
            events.append((vanished[rank], rank, beat["role"], what))
    for rank, error in errors.items():
        if rank not in beats:  # failed before its heartbeat started
            role = "target" if rank < targets else "drafter"
            events.append((error["timestamp"], rank, role, f"raised {error['message']}"))
    if not events:
        return None
    _, rank, role, what = min(events)
    details = errors[rank]["traceback"].splitlines() if rank in errors else []
    return Outcome("failed", EXIT_FAILED, f"first failure: rank {rank} ({role}) {what}", details)


def outcome_of(
    run_dir: Path, code: int, monitor: JobMonitor, log_dir: Path, nproc: int, targets: int
) -> Outcome:
    beats = read_heartbeats(run_dir)
    finished = len(beats) == nproc and all(b["state"] == "done" for b in beats.values())
    if code == 0 or finished:  # a signal that reached torchrun after its ranks finished changes nothing
        return Outcome("succeeded", EXIT_SUCCEEDED, f"all ranks finished; see {run_dir}")
    marker = preempted_marker(run_dir)
    if marker.exists():
        info = json.loads(marker.read_text())
        return Outcome(
            "preempted",
            EXIT_PREEMPTED,
            f"stopped by {info['signal']} with a checkpoint at step {info['step']}; continue with "
            "train.resume=true",
        )
    hung = [b for b in sorted(beats.values(), key=lambda b: b["written_at"]) if b["state"] == "hung"]
    if monitor.hung is not None or hung:
        summary = monitor.hung or f"rank {hung[0]['rank']} ({hung[0]['role']}) {hung[0]['error']}"
        return Outcome("hung", EXIT_HUNG, summary)
    if monitor.signal is signal.SIGINT:
        return Outcome("interrupted", EXIT_INTERRUPTED, "interrupted by SIGINT")
    if monitor.signal is not None:
        return Outcome("stopped", EXIT_STOPPED, f"stopped by {monitor.signal.name} before a checkpoint")
    first = _first_failure(beats, monitor.vanished, _error_files(log_dir), targets)
    return first or Outcome("failed", EXIT_FAILED, f"torchrun exited with {code}; see its summary above")


def supervise(run_dir: Path, nproc: int, targets: int, overrides: list[str], echo: bool) -> int:
    """Run one torchrun job to its end and write the outcome; returns the job's exit code."""
    job_id = uuid.uuid4().hex[:16]
    log_dir = run_dir / "logs" / "torchrun" / job_id
    for stale in [preempted_marker(run_dir), *heartbeat_dir(run_dir).glob("rank*.json")]:
        stale.unlink(missing_ok=True)  # left by an earlier attempt in this run directory
    (run_dir / "nccl_trace").mkdir(parents=True, exist_ok=True)
    _become_subreaper()
    echo_to_terminal = _Echo(job_log_path(run_dir)) if echo else None
    append_job_log(run_dir, f"launching {nproc} process(es) with torchrun: {' '.join(overrides)}")
    started = time.monotonic()
    log_fd = os.open(job_log_path(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        agent = subprocess.Popen(
            torchrun_command(nproc, overrides, run_dir, log_dir),
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            env=job_environment(run_dir, job_id),
        )
    finally:
        os.close(log_fd)
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
    monitor = JobMonitor(run_dir, agent, job_id)
    previous = {sig: signal.signal(sig, monitor.on_signal) for sig in LAUNCHER_SIGNALS}
    try:
        while agent.poll() is None:
            monitor.poll()
            _reap_orphans(agent.pid)
            if echo_to_terminal is not None:
                echo_to_terminal.pump()
            time.sleep(POLL_S)
        monitor.poll()
        leftovers = job_processes(job_id)
        if leftovers:
            append_job_log(
                run_dir, f"launcher: killing {len(leftovers)} process(es) the job left: {leftovers}"
            )
            _kill(leftovers)
            deadline = time.monotonic() + 5  # SIGKILL is asynchronous: let them die before the last reap
            while any(alive(pid) for pid in leftovers) and time.monotonic() < deadline:
                time.sleep(0.05)
        outcome = outcome_of(run_dir, agent.returncode, monitor, log_dir, nproc, targets)
        write_outcome(run_dir, outcome, time.monotonic() - started)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _reap_orphans(None)
    if echo_to_terminal is not None:
        echo_to_terminal.pump()
        echo_to_terminal.file.close()
    return outcome.exit_code


# ------------------------------------------------------------------------------ launching


def announce(run_dir: Path) -> None:
    """The run directory and its job log exist, and the user knows where, before anything can fail."""
    run_dir.mkdir(parents=True, exist_ok=True)
    append_job_log(run_dir, f"run directory {run_dir} on {socket.gethostname()}")
    print(f"RUN_DIR={run_dir}\nJOB_LOG={job_log_path(run_dir)}", flush=True)


def preflight_failure(run_dir: Path, problems: list[str], started: float) -> int:
    """Report preflight problems on stderr and in job.log; the exit code of a job that never started."""
    text = "\n".join(f"  - {p}" for p in problems)
    print(f"dflash_mp: preflight failed, no worker was started:\n{text}", file=sys.stderr, flush=True)
    summary = "preflight failed, no worker was started: " + "; ".join(problems)
    write_outcome(run_dir, Outcome("failed", EXIT_PREFLIGHT, summary), time.monotonic() - started)
    return EXIT_PREFLIGHT


def launch(dict_cfg: DictConfig, overrides: list[str], run_dir: Path, detach: bool = False) -> int:
    """Announce, preflight, then run one job in the foreground or start it detached."""
    from dflash_mp import doctor

    started = time.monotonic()
    announce(run_dir)
    checks = doctor.preflight(dict_cfg, run_dir)
    bad = doctor.failed(checks)
    if bad:
        return preflight_failure(run_dir, [f"{c.name}: {c.message}" for c in bad], started)
    for warning in (c for c in checks if c.message.startswith("warning:")):
        print(f"dflash_mp: {warning.name}: {warning.message}", file=sys.stderr, flush=True)
        append_job_log(run_dir, f"preflight {warning.name}: {warning.message}")
    append_job_log(run_dir, f"preflight: {len(checks)} checks passed")
    targets, drafters = int(dict_cfg.topology.targets), int(dict_cfg.topology.drafters)
    if detach:
        return start_detached(run_dir, targets + drafters, targets, overrides)
    return supervise(run_dir, targets + drafters, targets, overrides, echo=True)


def start_detached(run_dir: Path, nproc: int, targets: int, overrides: list[str]) -> int:
    """Start a supervisor that belongs to no terminal: double fork, own session, output to job.log."""
    argv = [sys.executable, "-m", "dflash_mp.launch", "_supervise", "--nproc", str(nproc)]
    argv += ["--targets", str(targets), str(run_dir), *overrides]
    write_job_state(run_dir, state="starting", pid=None, exit_code=None, summary=None)
    sys.stdout.flush()
    sys.stderr.flush()
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


def launch_from_hydra(dict_cfg: DictConfig) -> int:
    """Turn the current Hydra job (a single run or one job of a sweep) into a torchrun job."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("run_dir=")]
    if dict_cfg.run_dir:
        run_dir = Path(dict_cfg.run_dir)
    elif hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN":
        run_dir = Path(hydra_cfg.sweep.dir) / str(hydra_cfg.sweep.subdir)
    else:
        run_dir = default_run_dir(dict_cfg.name)
    code = launch(dict_cfg, overrides, run_dir.resolve())
    if code != 0:
        raise SystemExit(code)
    return code


# ------------------------------------------------------------------------------ operating


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


def _owned(state: dict[str, Any]) -> list[int]:
    """Live processes of the launch recorded in job.json: its supervisor and what the job started."""
    pids = job_processes(state["job_id"]) if state.get("job_id") else []
    pid = state.get("pid")
    if pid and alive(pid) and b"dflash_mp" in _cmdline(pid):  # the pid may have been reused since
        pids.append(pid)
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def status(run_dir: Path) -> int:
    """Print running / finished / failed ..., exit code, last step, heartbeat ages, last log lines."""
    state, log_path = read_job_state(run_dir), job_log_path(run_dir)
    if not state and not log_path.exists():
        print(f"{run_dir}: not a run directory (no job.json, no logs/job.log)", file=sys.stderr)
        return 1
    now = time.time()
    beats = read_heartbeats(run_dir)
    label = state.get("state", "unknown (not started by dflash_mp.launch)")
    if label in ("starting", "running") and not _owned(state):
        label = "lost: its supervisor is gone without writing an outcome"
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
                f"  rank {rank} {b['role']:7} {b['state']:9} phase {b['phase']:10} step {b['step']:<6} "
                f"progress {_age(now - b['progress_at'])} ago  pid {b['pid']}@{b['host']}"
            )
    if log_path.exists():
        print(f"--- last lines of {log_path}")
        print("\n".join(log_path.read_text(errors="replace").splitlines()[-10:]))
    return 0


def stop(run_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the job (drafters checkpoint at the next step), SIGKILL what is left after `timeout_s`."""
    state = read_job_state(run_dir)
    owned = _owned(state)
    if not owned:
        print(f"{run_dir}: not running ({state.get('state', 'no job.json')})")
        return 0
    pid, pgid = state["pid"], state["pgid"]
    # A detached job leads its own process group; a foreground one shares the shell's, which must
    # not be signalled: there the supervisor passes the signal on to torchrun itself.
    own_group = pid == pgid
    if own_group:
        print(f"stopping {run_dir}: SIGTERM to process group {pgid}", flush=True)
        os.killpg(pgid, signal.SIGTERM)
    else:
        print(f"stopping {run_dir}: SIGTERM to the supervisor, pid {pid}", flush=True)
        os.kill(pid, signal.SIGTERM)
    started = time.monotonic()
    while _owned(state) and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    if left := _owned(state):
        print(f"still running after {timeout_s:g}s: SIGKILL", flush=True)
        if own_group:
            os.killpg(pgid, signal.SIGKILL)
        else:
            _kill(left)
        while _owned(state) and time.monotonic() - started < timeout_s + 10:
            time.sleep(0.2)
    if read_job_state(run_dir).get("state") in ("starting", "running"):  # the supervisor was killed
        write_outcome(
            run_dir,
            Outcome("stopped", EXIT_STOPPED, f"killed by `stop` after {timeout_s:g}s"),
            time.monotonic() - started,
        )
    final = read_job_state(run_dir)
    print(f"{final.get('state')}: exit code {final.get('exit_code')}: {final.get('summary')}")
    return 0


# ------------------------------------------------------------------------------ command line


def _override(overrides: list[str], key: str) -> str | None:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    return values[-1] if values else None


def _compose(overrides: list[str]) -> DictConfig:
    from dflash_mp.config import compose_config

    return compose_config(overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,start,status,stop,doctor}")
    overrides_help = "Hydra overrides key=value; run_dir=PATH chooses the run directory"
    for name, text in (("run", "run a job in the foreground"), ("start", "start a job detached")):
        command = commands.add_parser(name, help=text)
        command.add_argument("overrides", nargs="*", help=overrides_help)
    command = commands.add_parser("status", help="state, exit code, last step, heartbeats, last log lines")
    command.add_argument("run_dir", type=Path)
    command = commands.add_parser("stop", help="SIGTERM the job's process group, SIGKILL after --timeout")
    command.add_argument("run_dir", type=Path)
    command.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S)
    command = commands.add_parser("doctor", help="preflight checks only")
    command.add_argument("--nnodes", type=int, default=1)
    command.add_argument("--nproc-per-node", type=int, default=None, help="default: the whole topology")
    command.add_argument("--port", type=int, default=None, help="a rendezvous port that must be free here")
    command.add_argument("overrides", nargs="*", help=overrides_help)
    command = commands.add_parser("_supervise")  # what `start` runs detached
    command.add_argument("run_dir", type=Path)
    command.add_argument("--nproc", type=int, required=True)
    command.add_argument("--targets", type=int, required=True)
    command.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    if args.command == "status":
        return status(args.run_dir.resolve())
    if args.command == "stop":
        return stop(args.run_dir.resolve(), args.timeout)
    if args.command == "_supervise":
        return supervise(args.run_dir, args.nproc, args.targets, args.overrides, echo=False)

    overrides = [o for o in args.overrides if not o.startswith("run_dir=")]
    run_dir = Path(
        _override(args.overrides, "run_dir") or default_run_dir(_override(args.overrides, "name") or "dflash")
    )
    run_dir = run_dir.resolve()
    if args.command == "doctor":
        from dflash_mp import doctor

        checks = doctor.preflight(
            _compose(args.overrides), run_dir, args.nnodes, args.nproc_per_node, args.port
        )
        print(doctor.format_checks(checks))
        return EXIT_PREFLIGHT if doctor.failed(checks) else EXIT_SUCCEEDED
    started = time.monotonic()
    try:
        dict_cfg = _compose(args.overrides)
    except Exception as e:  # an unknown key or a value of the wrong type, named by Hydra
        announce(run_dir)
        return preflight_failure(run_dir, [f"config: {e}"], started)
    return launch(dict_cfg, overrides, run_dir, detach=args.command == "start")


if __name__ == "__main__":
    sys.exit(main())
