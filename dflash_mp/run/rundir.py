"""Who may use a run directory, and what a new job may do with what is already in it.

- **One job per run directory.** `lock_run_dir` takes an OS lock (flock) on RUN_DIR/job.lock and
  writes the holder's pid and host into it. The kernel drops the lock when the last process
  holding it ends, however it ends (SIGKILL included): no stale pid file to clean up.
- **No fresh start over an earlier run.** Without train.resume=true, a run directory that holds
  checkpoints or metrics is refused (its metrics would be truncated and checkpoint retention,
  sorted by step, would delete the new run's checkpoints while the old run's higher steps stay).
  train.overwrite=true clears it first.
- **Config changes on resume are recorded.** config.yaml is the config the run started with; a
  resume whose config differs appends the differences to config_history.jsonl.

Free of torch imports: the launcher uses it before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import resource
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_NAME = "job.lock"
CONFIG_NAME = "config.yaml"
CONFIG_HISTORY_NAME = "config_history.jsonl"
# Keys that name the run directory or how it is entered, not what is trained.
NOT_A_CONFIG_CHANGE = frozenset({"run_dir", "train.resume", "train.overwrite"})


class RunDirBusy(RuntimeError):
    """Another job holds the run directory's lock."""


@dataclass
class RunDirLock:
    """The lock on RUN_DIR/job.lock, held through `fd` (inherited fds share it)."""

    path: Path
    fd: int

    def record_holder(self) -> None:
        """Name this process as the holder (pid, host) for the message a second job gets."""
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data.encode(), 0)

    def release(self) -> None:
        """Close this process's hold; the lock goes when no other process shares the fd."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take the run directory's lock now or raise RunDirBusy naming the holder's pid and host."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(
            f"{run_dir} is in use by another job: {_holder(path)}. Wait "
            f"for it to end, stop it (python -m dflash_mp.launch stop {run_dir}), or "
            "choose another run_dir"
        ) from None
    lock = RunDirLock(path, fd)
    lock.record_holder()
    return lock


def adopt_lock(run_dir: Path, fd: int) -> RunDirLock:
    """A lock inherited from the process that took it (the detached supervisor from `start`)."""
    lock = RunDirLock(run_dir / LOCK_NAME, fd)
    lock.record_holder()
    return lock


def _holder(path: Path) -> str:
    from dflash_mp.run.processes import alive, holders_of

    try:
        holder = json.loads(path.read_text())
        pid, host = holder["pid"], holder["host"]
    except (OSError, ValueError, KeyError):  # caught between the lock and the write
        return f"a process (pid and host not written yet) holds {path}"
    if host != socket.gethostname() or alive(pid):
        return f"pid {pid} on host {host} holds {path}"
    # The process that took the lock is gone; what it started still shares the lock.
    return f"pid {pid} on host {host} took {path} and has exited, but pid(s) {holders_of(path)} still hold it"


def write_error_cause(error: BaseException, where: Path) -> str:
    """A failed write in words: the OS error in `error`'s chain (or in a message such as
    safetensors' "(os error 27)"), named as disk full, quota or file-size limit, with the free space."""
    code = None
    cause: BaseException | None = error
    while cause is not None and code is None:
        code = cause.errno if isinstance(cause, OSError) else None
        found = re.search(r"os error (\d+)", str(cause))
        code = code or (int(found.group(1)) if found else None)
        cause = cause.__cause__ or cause.__context__
    try:
        free = f"{shutil.disk_usage(where).free / 2**30:.1f} GiB free at {where}"
    except OSError:
        free = f"free space at {where} unknown"
    if code == errno.ENOSPC:
        return f"the disk is full ({free})"
    if code == errno.EDQUOT:
        return f"the disk quota is exceeded ({free})"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        return f"a file would exceed the file-size limit (ulimit -f: {shown})"
    if code is not None:
        return f"{os.strerror(code)} ({free})"
    return f"{type(error).__name__}: {error} (a full disk, a quota or a file-size limit are the usual causes; {free})"


# ------------------------------------------------------------------------------ fresh starts


def earlier_run(run_dir: Path) -> list[str]:
    """What an earlier run left that a fresh start would destroy: checkpoints, metrics."""
    found = []
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and (names := sorted(p.name for p in checkpoints.glob("step_*"))):
        found.append(f"checkpoints up to {names[-1]}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def fresh_start_problem(run_dir: Path, resume: bool, overwrite: bool) -> str | None:
    """Why this job may not start in `run_dir`, with the ways out; None when it may."""
    if resume or overwrite:
        return None
    found = earlier_run(run_dir)
    if not found:
        return None
    return (
        f"run_dir={run_dir} holds an earlier run ({', '.join(found)}) and train.resume=false: "
        "continue it with train.resume=true, choose a new run_dir, or clear it with train.overwrite=true"
    )


def clear_run_dir(run_dir: Path) -> list[str]:
    """Remove an earlier run (train.overwrite=true); keep the lock file and the job log. Returns
    what was removed."""
    keep = {run_dir / LOCK_NAME, run_dir / "logs"}
    removed = []
    for path in sorted(run_dir.iterdir()):
        if path in keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    logs = run_dir / "logs"
    if logs.is_dir():  # the rank logs and torchrun logs of the earlier run; job.log keeps the history
        for path in logs.iterdir():
            if path.name != "job.log":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


# ------------------------------------------------------------------------------ config record


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat |= _flatten(value, f"{prefix}{key}.")
        return flat
    return {prefix[:-1]: node}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Keys whose values differ between two resolved configs: {key: {"old": ..., "new": ...}}."""
    before, after = _flatten(old), _flatten(new)
    return {
        key: {"old": before.get(key), "new": after.get(key)}
        for key in sorted(before.keys() | after.keys())
        if key not in NOT_A_CONFIG_CHANGE and before.get(key) != after.get(key)
    }


def record_config(run_dir: Path, config: dict[str, Any], resume: bool) -> dict[str, dict[str, Any]]:
    """Write config.yaml for a fresh start; on a resume keep it and append what changed to
    config_history.jsonl. Returns the changes (empty when none)."""
    from omegaconf import OmegaConf

    path = run_dir / CONFIG_NAME
    if not resume or not path.exists():
        OmegaConf.save(OmegaConf.create(config), path)
        return {}
    original = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    changes = config_changes(original, config)  # type: ignore[arg-type]
    if changes:
        entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resume": True, "changes": changes}
        with open(run_dir / CONFIG_HISTORY_NAME, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return changes
