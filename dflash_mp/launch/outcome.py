"""How a job ended, and whom to blame: exit codes, RUN_DIR/job.json and the last lines of job.log.

Failures are judged before a stop: when a rank dies, torchrun's teardown SIGTERMs the survivors,
which take it as a stop request and may checkpoint and write PREEMPTED. So a job counts as
preempted only when no rank failed before the stop signal came from outside (the user, `stop`,
SLURM); otherwise the first failing rank is the cause and the PREEMPTED marker is withdrawn, so
that no requeue script takes the failure for a preemption. A rank that had finished its work and
then died by a signal (its heartbeat says so: it never exited through Python) failed too: the
job neither succeeded nor was preempted. A hang reported by a rank waiting on a peer names that
peer. Free of torch imports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_mp.run.logs import append_job_log, job_log_path
from dflash_mp.runtime.watchdog import EXIT_HUNG, EXIT_PREEMPTED, preempted_marker, read_heartbeats

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1  # a rank raised or died
EXIT_PREFLIGHT = 2  # bad config or environment (or the run directory is taken); no worker was started
EXIT_INTERRUPTED = 130  # Ctrl-C before a checkpoint
EXIT_STOPPED = 143  # SIGTERM before a checkpoint could be written
# EXIT_HUNG (3) and EXIT_PREEMPTED (75) come from dflash_mp.runtime.watchdog: the ranks exit with them.
STATE_OF_EXIT_CODE = {
    EXIT_SUCCEEDED: "succeeded",
    EXIT_FAILED: "failed",
    EXIT_PREFLIGHT: "not-started",
    EXIT_HUNG: "hung",
    EXIT_PREEMPTED: "preempted",
    EXIT_INTERRUPTED: "interrupted",
    EXIT_STOPPED: "stopped",
}


@dataclass
class Outcome:
    state: str  # succeeded | failed | hung | preempted | interrupted | stopped
    exit_code: int
    summary: str
    details: list[str] = field(default_factory=list)  # the root cause's traceback


@dataclass
class StopRequest:
    """A stop signal that reached the job from outside, and when (wall clock)."""

    signal: signal.Signals
    at: float


# ------------------------------------------------------------------------------ job.json


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


def write_outcome(run_dir: Path, outcome: Outcome, elapsed_s: float) -> None:
    """The last lines of job.log (and job.json): what happened, whom to blame, its traceback."""
    if outcome.state != "preempted":
        preempted_marker(run_dir).unlink(missing_ok=True)  # a teardown's checkpoint is no preemption
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


# ------------------------------------------------------------------------------ judging


def error_files(log_dir: Path) -> dict[int, dict[str, Any]]:
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


# torchrun's failure summary, one entry per failed worker: "exitcode  : -9 (pid: 1234)".
_TORCHRUN_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
LOG_TAIL_BYTES = 256 * 1024


def worker_exit_codes(run_dir: Path) -> dict[int, int]:
    """Exit codes by pid from torchrun's failure summaries at the end of job.log (negative: the
    signal that killed the worker)."""
    try:
        with open(job_log_path(run_dir), "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES, 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    return {int(pid): int(code) for code, pid in _TORCHRUN_EXITCODE.findall(text)}


def _death(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"died without a Python traceback (killed by {name})"
    if exit_code is not None:
        return f"died without a Python traceback (exited with code {exit_code})"
    return "died without a Python traceback (killed by a signal, the OOM killer, or a native crash)"


def role_of_rank(rank: int, targets: int | None) -> str:
    """The role of a rank that failed before its heartbeat named it: `targets` 0 is the colocated
    layout, None a job whose topology is not known (it never wrote config.yaml)."""
    if targets is None:
        return "role unknown"
    if targets == 0:
        return "colocated"
    return "target" if rank < targets else "drafter"


# Errors in what the user gave (data, config, prompts), whose message says all: the job's last
# lines give it without the rank's traceback.
USER_ERRORS = ("DataError:", "EmptyData:", "ConfigError:", "TargetConfigError:", "EvalError:")

# Final heartbeat states of a rank that ended its work; it then still has to exit by itself.
ENDED_STATES = ("done", "preempted", "stopped")


def _hang(rank: int, beat: dict) -> tuple[int, str, str]:
    """(rank, role, what) of a hang: the peer a waiting rank blamed, else the rank itself."""
    blame = beat.get("blame")
    if not blame:
        return rank, beat["role"], str(beat["error"])
    return (
        blame["rank"],
        blame["role"],
        f"no progress in phase {blame['phase']!r} at step {blame['step']}: {blame['why']}; "
        f"rank {rank} ({beat['role']}) waited for it in phase {beat['phase']!r} at step {beat['step']}",
    )


def first_failure(
    beats: dict[int, dict],
    vanished: dict[int, float] | None,
    errors: dict[int, dict],
    targets: int | None,
    before: float | None = None,
    exit_codes: dict[int, int] | None = None,
) -> Outcome | None:
    """The failure or hang that came first (and before `before`, the outside stop, if any).

    A rank that vanished is dated by when it was last seen alive, so the ranks that failed because
    of it (a closed connection) always come after it. `vanished=None` judges a job that has ended
    (the SLURM script): a rank whose heartbeat still says running died without a word, at about
    the time of its last heartbeat.
    """
    events = []
    for rank, beat in beats.items():
        if beat["state"] == "failed":
            events.append((beat["written_at"], rank, beat["role"], f"raised {beat['error']}", "failed"))
        elif beat["state"] == "hung":
            events.append((beat["written_at"], *_hang(rank, beat), "hung"))
        elif beat["state"] == "running" and (vanished is None or rank in vanished):
            died = beat["written_at"] if vanished is None else vanished[rank]
            what = _death((exit_codes or {}).get(beat["pid"]))
            events.append((died, rank, beat["role"], what, "failed"))
        elif beat["state"] in ENDED_STATES and not beat.get("exited"):
            # Its heartbeat went on until it died: written_at dates the death.
            what = f"{_death((exit_codes or {}).get(beat['pid']))}, after it had ended its work ({beat['state']})"
            events.append((beat["written_at"], rank, beat["role"], what, "failed"))
    for rank, error in errors.items():
        if rank not in beats:  # failed before its heartbeat started
            role = role_of_rank(rank, targets)
            events.append((error["timestamp"], rank, role, f"raised {error['message']}", "failed"))
    events = [event for event in events if before is None or event[0] < before]
    if not events:
        return None
    _, rank, role, what, state = min(events)
    if state == "hung":
        return Outcome("hung", EXIT_HUNG, f"rank {rank} ({role}) hung: {what}")
    details = errors[rank]["traceback"].splitlines() if rank in errors else []
    if rank in errors and str(errors[rank]["message"]).startswith(USER_ERRORS):
        details = []  # the message names the file, the field and the fix: no stack to read
    return Outcome("failed", EXIT_FAILED, f"first failure: rank {rank} ({role}) {what}", details)


def judge(
    run_dir: Path,
    code: int,
    *,
    nproc: int,
    targets: int | None,
    errors: dict[int, dict],
    vanished: dict[int, float] | None,
    stop: StopRequest | None,
    launcher_hang: str | None = None,
) -> Outcome:
    """The outcome of a job whose torchrun (or srun) exited with `code`: success, then a hang the
    launcher caught, then the first rank failure before any outside stop, then the stop."""
    beats = read_heartbeats(run_dir)
    finished = len(beats) == nproc and all(b["state"] == "done" and b.get("exited") for b in beats.values())
    # A signal that reached torchrun after its ranks finished and exited changes nothing.
    if code == 0 or finished:
        return Outcome("succeeded", EXIT_SUCCEEDED, f"all ranks finished; see {run_dir}")
    if launcher_hang is not None:
        return Outcome("hung", EXIT_HUNG, launcher_hang)
    failure = first_failure(
        beats,
        vanished,
        errors,
        targets,
        before=stop.at if stop else None,
        exit_codes=worker_exit_codes(run_dir),
    )
    if failure is not None:
        return failure
    marker = preempted_marker(run_dir)
    if marker.exists():
        info = json.loads(marker.read_text())
        return Outcome(
            "preempted",
            EXIT_PREEMPTED,
            f"stopped by {info['signal']} with a checkpoint at step {info['step']}; continue with "
            "train.resume=true",
        )
    if stop is not None and stop.signal is signal.SIGINT:
        return Outcome("interrupted", EXIT_INTERRUPTED, "interrupted by SIGINT")
    if stop is not None:
        return Outcome("stopped", EXIT_STOPPED, f"stopped by {stop.signal.name} before a checkpoint")
    return Outcome("failed", EXIT_FAILED, f"torchrun exited with {code}; see its summary above")
