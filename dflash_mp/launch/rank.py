"""One torchrun rank's program: join the job, run this rank's part of it, leave.

`python -m dflash_mp.train` runs it under torchrun, and the launcher's agent runs `main` in each
rank it forks (dflash_mp.launch.agent). What the rank does, phase by phase, is
dflash_mp.runtime.job; this module gives it the process around it: the config checked against the
world size, the process groups, the watchdog, the exit codes, and under plain torchrun (no
launcher) rank 0's hold of the run directory and its preflight.

Whatever imports torch is imported inside the functions a rank runs: `python -m dflash_mp.train`
imports this module before it knows whether it is a rank or the launcher, and the launcher takes
the run directory and prints its paths before anything heavy is imported.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import hydra
from omegaconf import DictConfig

from dflash_mp.config.schema import CONF_DIR, ConfigError, RootConfig, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.launch.doctor import failed, memory_checks, reading_checks
from dflash_mp.launch.outcome import EXIT_PREFLIGHT
from dflash_mp.run import startup
from dflash_mp.run.logs import append_job_log, get_logger
from dflash_mp.run.processes import JOB_ID_ENV
from dflash_mp.run.rundir import RunDirBusy, clear_run_dir, fresh_start_problem, lock_run_dir
from dflash_mp.runtime import watchdog

if TYPE_CHECKING:
    from dflash_mp.runtime.distributed import Job


def run_rank(dict_cfg: DictConfig) -> None:
    """One torchrun worker: join the job, run this rank's part of it, leave. A failure is written
    to job.log and raised, for torchrun's error file; a stop on request exits EXIT_PREEMPTED."""
    import torch.distributed as dist

    from dflash_mp.runtime.job import run_job

    watchdog.die_with_agent()
    _without_progress_bars()
    cfg = to_dataclass(dict_cfg)
    job, run_dir = _join_job(cfg)
    startup.resume()  # joined, with the training stack imported (above)
    try:
        run_job(cfg, job, run_dir)
    except watchdog.Preempted as stop:
        watchdog.finish("preempted")
        append_job_log(run_dir, f"rank {job.rank} ({job.role.value}) {stop}")
        _exit_early(watchdog.EXIT_PREEMPTED)
    except BaseException as e:
        # Once a stop was requested, a rank whose peers already left ends on a broken connection:
        # expected, so no error file that would pass for the job's root cause.
        state = "stopped" if watchdog.stop_requested() else "failed"
        watchdog.finish(state, f"{type(e).__name__}: {e}")
        append_job_log(run_dir, f"rank {job.rank} ({job.role.value}) {state}: {type(e).__name__}: {e}")
        if state == "stopped":
            get_logger().info("stopped on request", exc_info=True)
            _exit_early(watchdog.EXIT_PREEMPTED)
        raise
    watchdog.finish("done")  # waiting in the barrier below is not a hang
    dist.barrier(group=job.meta_group)
    dist.destroy_process_group()
    if job.rank == 0:
        append_job_log(run_dir, f"finished: {run_dir}")


def _without_progress_bars() -> None:
    """No Hugging Face progress bars in a rank ("Loading weights" per rank would fill job.log); the
    rank's log lines say what it loads."""
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def _join_job(cfg: RootConfig) -> tuple[Job, Path]:
    """Check the config against the world size, form the process groups, agree on the run
    directory, run the preflight (plain torchrun only) and start the watchdog."""
    from dflash_mp.runtime.distributed import env_ranks, init_job, process_group_timeout_s, shared_run_dir
    from dflash_mp.runtime.topology import Topology

    rank, _, world_size = env_ranks()
    try:
        validate(cfg, world_size=world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"dflash_mp: {e}", file=sys.stderr)
        sys.exit(EXIT_PREFLIGHT)

    if cfg.topology.layout == "colocated":
        cfg.topology.drafters = world_size  # null: every rank trains (validated to agree when set)
    topology = Topology(
        cfg.topology.targets, cfg.topology.drafters, cfg.train.grad_accum, cfg.topology.target_parallel
    )
    timeout_s = process_group_timeout_s(cfg.watchdog.timeout_s)
    job = init_job(topology, cfg.train.device, timeout_s=timeout_s)
    run_dir = Path(shared_run_dir(cfg.run_dir, cfg.name, job.meta_group))
    _preflight_under_plain_torchrun(cfg, run_dir, job)
    if job.rank == 0:
        why = (
            f"watchdog.timeout_s={cfg.watchdog.timeout_s:g} + margin, so the watchdog fires first"
            if cfg.watchdog.timeout_s > 0
            else "watchdog.timeout_s=0: no watchdog, the groups' timeout is the only hang detection"
        )
        append_job_log(run_dir, f"process groups time out after {timeout_s:g}s ({why})")
    watchdog.start(run_dir, job.rank, job.role.value, cfg.watchdog.timeout_s)
    return job, run_dir


def _exit_early(code: int) -> NoReturn:
    """Leave the process groups (dflash_mp.runtime.distributed.leave_process_groups), exit `code`.
    A receive still posted after that wait (a target that hung) keeps a thread inside gloo, which
    would abort the interpreter's teardown once that target goes: the rank then runs its exit
    handlers and ends without the teardown."""
    from dflash_mp.runtime.distributed import LEAVE_TIMEOUT_S, leave_process_groups

    if leave_process_groups(LEAVE_TIMEOUT_S):
        sys.exit(code)
    get_logger().warning(
        "leaving: a target sent nothing for %gs, a receive is still posted; exiting without the "
        "interpreter's teardown",
        LEAVE_TIMEOUT_S,
    )
    atexit._run_exitfuncs()  # the heartbeat's "exited" mark, the log files' flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _preflight_under_plain_torchrun(cfg: RootConfig, run_dir: Path, job: Job) -> None:
    """Under plain torchrun (no launcher holds the run directory or ran the preflight), rank 0 takes
    the run directory's lock for the life of its process, refuses a fresh start over an earlier run
    (or clears it with train.overwrite=true), refuses a resume its checkpoints rule out, a config
    whose predicted peak memory exceeds the GPU's, and reads the data sample and the held-out prompts
    as the launcher's preflight does; every rank exits with the reason, before any heavy work."""
    from dflash_mp.runtime.distributed import broadcast_text
    from dflash_mp.runtime.resume import resume_problem

    if os.environ.get(JOB_ID_ENV):  # the launcher's supervisor holds and checked it
        return
    problem = ""
    if job.rank == 0:
        try:
            lock_run_dir(run_dir)  # held until this process exits: the fd stays open
            problem = fresh_start_problem(run_dir, cfg.train.resume, cfg.train.overwrite) or ""
            if not problem and cfg.train.resume:
                problem = resume_problem(cfg, run_dir, job.topology.world_size) or ""
            if not problem:
                problem = _checks_problem(cfg, run_dir)
            if not problem and cfg.train.overwrite:
                removed = clear_run_dir(run_dir)
                append_job_log(
                    run_dir, f"train.overwrite=true: removed the earlier run's {', '.join(removed)}"
                )
            if problem:
                append_job_log(run_dir, f"preflight failed, no training started: {problem}")
        except RunDirBusy as e:  # the job.log is the other job's
            problem = str(e)
    problem = broadcast_text(problem, src=0, group=job.meta_group)
    if problem:
        print(f"dflash_mp: rank {job.rank}: refused: {problem}", file=sys.stderr, flush=True)
        _exit_early(EXIT_PREFLIGHT)


def _checks_problem(cfg: RootConfig, run_dir: Path) -> str:
    """The launcher's memory and data checks (dflash_mp.launch.doctor) as one line, empty when they pass;
    the memory line goes to job.log."""
    memory = memory_checks(cfg)  # the predicted peak per GPU, before any rank loads the target
    bad = failed(memory) or failed(reading_checks(cfg))
    if not bad:
        for check in memory:
            append_job_log(run_dir, f"preflight memory: {check.message}")
    return "; ".join(f"{c.name}: {c.message}" for c in bad)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def run_recorded(dict_cfg: DictConfig) -> int:
    """run_rank under torchrun's @record, inside Hydra's handler: Hydra turns exceptions into
    exit(1), so the rank's traceback must reach torchrun's error file before that. It is printed
    from there once (the launcher's root cause, torchrun's summary): not by Hydra too."""
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(run_rank)(dict_cfg)
    except Exception:
        raise SystemExit(1) from None
    return 0


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> int:
    """A rank the launcher's agent forked: its command line composed as `python -m dflash_mp.train`
    composes it under torchrun."""
    return run_recorded(dict_cfg)
