"""The doctor's checks of the host a job starts on (disk, run directory, PID 1's reaping, the
rendezvous port), and `Check`, the one-line result every doctor check gives (doctor.py)."""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from dflash_mp.run.processes import zombie_children
from dflash_mp.run.rundir import fresh_start_problem

# Enough for logs and a few checkpoints of a small drafter; a real drafter needs more (~16 B/param each).
MIN_FREE_GIB = 1.0


@dataclass
class Check:
    name: str
    ok: bool
    message: str  # what was found, or the reason and the fix


def check_disk(run_dir: Path, min_free_gib: float = MIN_FREE_GIB) -> Check:
    existing = Path(run_dir).absolute()
    while not existing.exists():  # the run directory may not exist yet: judge the disk it will be on
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        return Check("disk", False, f"{existing} is not writable: choose run_dir=PATH on a writable disk")
    free = shutil.disk_usage(existing).free / 2**30
    if free < min_free_gib:
        return Check(
            "disk",
            False,
            f"{free:.1f} GiB free at {existing}, below {min_free_gib:g} GiB: free space or choose another run_dir",
        )
    return Check("disk", True, f"{free:.0f} GiB free at {existing}")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> Check:
    """A fresh start must not destroy an earlier run's checkpoints and metrics."""
    problem = fresh_start_problem(Path(run_dir), resume, overwrite)
    if problem is not None:
        return Check("run_dir", False, problem)
    if overwrite:
        return Check(
            "run_dir", True, f"warning: train.overwrite=true: {run_dir} is cleared before the job starts"
        )
    return Check("run_dir", True, f"{run_dir}: {'resume' if resume else 'fresh start'}")


def check_reaper() -> Check:
    """Orphans (a detached job's supervisor, once it ends) are adopted by PID 1, which must reap them."""
    init = Path("/proc/1/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or "?"
    zombies = zombie_children(1)
    if zombies:  # a warning: only what ends detached is affected
        return Check(
            "reaper",
            True,
            f"warning: PID 1 ({init}) leaves {len(zombies)} orphan(s) <defunct>; so will a detached "
            "job's supervisor once it ends: run containers with an init (docker run --init, tini)",
        )
    return Check("reaper", True, f"PID 1 ({init}): no unreaped orphans")


def check_port(port: int) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as e:
            return Check(
                "port",
                False,
                f"port {port} is in use ({e.strerror}): pick a free one (--rdzv-endpoint HOST:PORT, MASTER_PORT)",
            )
    return Check("port", True, f"port {port} is free")
