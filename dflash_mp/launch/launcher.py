"""One job from a config: take the run directory, announce it, preflight, then supervise or detach."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from dflash_mp.config.validation import processes_per_job
from dflash_mp.launch import doctor
from dflash_mp.launch.agent import AgentZygote
from dflash_mp.launch.detached import start_detached
from dflash_mp.launch.outcome import EXIT_PREFLIGHT, Outcome, read_job_state, write_outcome
from dflash_mp.launch.supervisor import supervise
from dflash_mp.run import startup
from dflash_mp.run.logs import append_job_log, job_log_path
from dflash_mp.run.rundir import RunDirBusy, RunDirLock, clear_run_dir, lock_run_dir


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def holding_run_dir(run_dir: Path, body: Callable[[RunDirLock], int]) -> int:
    """Run `body` holding the run directory's lock; refuse at once (exit 2, touching nothing of
    the other job) when another job holds it."""
    try:
        lock = lock_run_dir(run_dir)
    except RunDirBusy as e:
        print(f"dflash_mp: refused: {e}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT
    try:
        return body(lock)
    finally:
        lock.release()  # a supervisor started from `body` keeps its own share of the lock


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
    if read_job_state(run_dir):
        # An earlier job's record (and its PREEMPTED marker) stays: `status` and a SLURM requeue
        # read them, and this launch never started. job.log tells of the refusal.
        append_job_log(
            run_dir,
            f"launch refused, exit code {EXIT_PREFLIGHT} (the earlier job's job.json is kept): {summary}",
        )
        return EXIT_PREFLIGHT
    write_outcome(run_dir, Outcome("failed", EXIT_PREFLIGHT, summary), time.monotonic() - started)
    return EXIT_PREFLIGHT


def launch(dict_cfg: DictConfig, overrides: list[str], run_dir: Path, detach: bool = False) -> int:
    """Take the run directory, announce, preflight, then run one job in the foreground or start it detached."""
    return holding_run_dir(run_dir, lambda lock: _launch(dict_cfg, overrides, run_dir, lock, detach))


def _launch(dict_cfg: DictConfig, overrides: list[str], run_dir: Path, lock: RunDirLock, detach: bool) -> int:
    started = time.monotonic()
    announce(run_dir)
    # Before anything runs a thread pool (see dflash_mp.launch.agent).
    zygote = None if detach else AgentZygote.fork(lock.fd, job_log_path(run_dir))
    try:
        return _checked_launch(dict_cfg, overrides, run_dir, lock, detach, started, zygote)
    finally:
        if zygote is not None:  # unless it became the agent: the job never began
            zygote.discard()


def _checked_launch(
    dict_cfg: DictConfig,
    overrides: list[str],
    run_dir: Path,
    lock: RunDirLock,
    detach: bool,
    started: float,
    zygote: AgentZygote | None,
) -> int:
    checks = doctor.preflight(dict_cfg, run_dir)
    startup.resume()  # what the launcher imports is imported by now
    bad = doctor.failed(checks)
    if bad:
        return preflight_failure(run_dir, [f"{c.name}: {c.message}" for c in bad], started)
    for shown in (c for c in checks if c.message.startswith("warning:") or c.name == "memory"):
        print(f"dflash_mp: {shown.name}: {shown.message}", file=sys.stderr, flush=True)
        append_job_log(run_dir, f"preflight {shown.name}: {shown.message}")
    append_job_log(run_dir, f"preflight: {len(checks)} checks passed")
    changes = config_changes(dict_cfg)
    print(f"dflash_mp: {changes}", file=sys.stderr, flush=True)
    append_job_log(run_dir, changes)
    if dict_cfg.train.get("overwrite", False):
        removed = clear_run_dir(run_dir)
        append_job_log(
            run_dir, f"train.overwrite=true: removed the earlier run's {', '.join(removed) or 'nothing'}"
        )
    targets = int(dict_cfg.topology.targets)
    nproc = processes_per_job(dict_cfg, doctor.visible_gpus())  # the preflight made sure it is known
    if detach:
        return start_detached(run_dir, nproc, targets, overrides, lock)
    return supervise(run_dir, nproc, targets, overrides, echo=True, lock=lock, zygote=zygote)


# Keys every run sets for itself: no change of the recipe.
OWN_KEYS = ("run_dir",)


def config_changes(dict_cfg: DictConfig) -> str:
    """One line: where the job's config differs from its preset's (conf/experiment/PRESET.yaml)."""
    from omegaconf import OmegaConf

    preset = str(dict_cfg.get("preset") or "")
    try:
        base = _compose([f"experiment={preset}"] if preset else [])
    except Exception as e:  # the line informs; it never stops a launch
        return f"config: not compared with its preset ({type(e).__name__}: {e})"
    ours = _leaves(OmegaConf.to_container(dict_cfg, resolve=False))
    theirs = _leaves(OmegaConf.to_container(base, resolve=False))
    changed = [
        f"{key}={ours.get(key, '(unset)')} (preset: {theirs.get(key, 'unset')})"
        for key in sorted(ours.keys() | theirs.keys())
        if ours.get(key) != theirs.get(key) and key not in OWN_KEYS
    ]
    name = f"experiment={preset}" if preset else "the default config"
    if not changed:
        return f"config: {name} as it is"
    return f"config: {name} with {len(changed)} change(s): {', '.join(changed)}"


def _compose(overrides: list[str]) -> DictConfig:
    """conf/ composed with `overrides`, also inside a Hydra app (`python -m dflash_mp.train`)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from dflash_mp.config.schema import compose_config

    if GlobalHydra.instance().is_initialized():
        return compose("config", overrides=overrides)
    return compose_config(overrides)


def _leaves(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict) and node:
        found: dict[str, object] = {}
        for key, value in node.items():
            found |= _leaves(value, f"{prefix}{key}.")
        return found
    return {prefix.rstrip("."): node}
