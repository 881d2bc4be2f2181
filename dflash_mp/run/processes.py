"""The processes of a job, read from /proc: alive, zombie, in a process group, carrying the job's id.

Everything a job starts carries DFLASH_MP_JOB_ID in its environment or holds its run directory's
lock, so what a job left behind is found and killed by that, never by name. Free of torch imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path

JOB_ID_ENV = "DFLASH_MP_JOB_ID"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


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


def job_processes(job_id: str, lock_path: Path | None = None) -> list[int]:
    """Live processes started for job `job_id` (torchrun, ranks, their helpers), by environment,
    and, given the run directory's `lock_path`, the others holding it (an agent forked from the
    launcher and its ranks keep the launcher's /proc environ), this process left out."""
    marker = f"{JOB_ID_ENV}={job_id}".encode()
    found = set(holders_of(lock_path)) - {os.getpid()} if lock_path is not None else set()
    for pid in _all_pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if marker in environ.split(b"\0") and alive(pid):
            found.add(pid)
    return sorted(found)


def holders_of(path: Path) -> list[int]:
    """Live processes with `path` open (those sharing a run directory's lock), found through
    /proc/PID/fd: the lock file names no process once its taker is gone."""
    target, found = str(path.resolve()), []
    for pid in _all_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target and alive(pid):
                    found.append(pid)
                    break
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, sig)


def become_subreaper() -> None:
    """Ranks whose torchrun agent died are re-parented to this process, which reaps them,
    instead of lingering as <defunct> under a PID 1 that never reaps (a bare container)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: init adopts orphans as usual
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A Popen `preexec_fn`: the child gets `sig` when the process starting it dies (Linux), so a
    killed launcher takes its torchrun agent along, and the agent its ranks."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork
    except (OSError, AttributeError):  # not Linux
        return lambda: None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), sig)

    return arm


def reap_orphans(agent_pid: int | None) -> None:
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
