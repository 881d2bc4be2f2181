"""Entry point: `torchrun ... -m dflash_mp.train [overrides]`, or `python -m dflash_mp.train`.

Under torchrun every process reads the config, takes its role from its global rank and
runs it. Started without torchrun (plain python, `make train`, a Hydra sweep with -m),
it launches one local torchrun job per config through dflash_mp.launch and waits.
Under plain torchrun, rank 0 holds the run directory's lock (dflash_mp.run.rundir) for the job.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash_mp.config.schema import CONF_DIR, ConfigError, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.run.logs import append_job_log, get_logger
from dflash_mp.runtime import watchdog

EXIT_CONFIG_ERROR = 2


def run_rank(dict_cfg: DictConfig) -> None:
    """One torchrun worker: set up, run the role, tear down."""
    import torch.distributed as dist

    from dflash_mp.runtime.distributed import env_ranks, init_job, process_group_timeout_s, shared_run_dir
    from dflash_mp.runtime.topology import Topology

    watchdog.die_with_agent()
    cfg = to_dataclass(dict_cfg)
    rank, _, world_size = env_ranks()
    try:
        validate(cfg, world_size=world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"dflash_mp: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)

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
    try:
        _run_role(cfg, job, run_dir)
    except watchdog.Preempted as stop:
        watchdog.finish("preempted")
        append_job_log(run_dir, f"rank {job.rank} ({job.role.value}) {stop}")
        _leave_process_groups()
        sys.exit(watchdog.EXIT_PREEMPTED)
    except BaseException as e:
        # Once a stop was requested, a rank whose peers already left ends on a broken connection:
        # expected, so no error file that would pass for the job's root cause.
        state = "stopped" if watchdog.stop_requested() else "failed"
        watchdog.finish(state, f"{type(e).__name__}: {e}")
        append_job_log(run_dir, f"rank {job.rank} ({job.role.value}) {state}: {type(e).__name__}: {e}")
        if state == "stopped":
            get_logger().info("stopped on request", exc_info=True)
            _leave_process_groups()
            sys.exit(watchdog.EXIT_PREEMPTED)
        raise
    watchdog.finish("done")  # waiting in the barrier below is not a hang
    dist.barrier(group=job.meta_group)
    dist.destroy_process_group()
    if job.rank == 0:
        append_job_log(run_dir, f"finished: {run_dir}")


def _leave_process_groups() -> None:
    """Destroy the process groups before a rank exits early: left to the interpreter's exit, gloo's
    threads are still joinable when C++ destroys them, and the rank aborts ("terminate called
    without an active exception", "Fatal Python error: Aborted") after it ended cleanly."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _preflight_under_plain_torchrun(cfg, run_dir: Path, job) -> None:
    """Under plain torchrun (no launcher holds the run directory or ran the preflight), rank 0 takes
    the run directory's lock for the life of its process, refuses a fresh start over an earlier run
    (or clears it with train.overwrite=true) and reads the data sample and the held-out prompts as
    the launcher's preflight does; every rank exits with the reason, before any heavy work."""
    from dflash_mp.doctor import failed, reading_checks
    from dflash_mp.run.processes import JOB_ID_ENV
    from dflash_mp.run.rundir import RunDirBusy, clear_run_dir, fresh_start_problem, lock_run_dir
    from dflash_mp.runtime.distributed import broadcast_text

    if os.environ.get(JOB_ID_ENV):  # the launcher's supervisor holds and checked it
        return
    problem = ""
    if job.rank == 0:
        try:
            lock_run_dir(run_dir)  # held until this process exits: the fd stays open
            problem = fresh_start_problem(run_dir, cfg.train.resume, cfg.train.overwrite) or ""
            if not problem:
                bad = failed(reading_checks(cfg))
                problem = "; ".join(f"{c.name}: {c.message}" for c in bad)
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
        _leave_process_groups()
        sys.exit(EXIT_CONFIG_ERROR)


def _run_role(cfg, job, run_dir: Path) -> None:
    from dflash_mp.config.precision import resolve_precision
    from dflash_mp.data import open_records
    from dflash_mp.run import checkpoint
    from dflash_mp.run.logs import setup_rank_logging
    from dflash_mp.run.metrics import MetricsLogger, StepTally
    from dflash_mp.run.rundir import CONFIG_HISTORY_NAME, record_config
    from dflash_mp.runtime.distributed import broadcast_int
    from dflash_mp.runtime.resume import data_files_fingerprint, data_layout
    from dflash_mp.runtime.roles import (
        load_resume_state,
        make_feature_extractor,
        make_reader,
        resume_step,
        run_drafter,
        run_target,
        total_steps,
    )
    from dflash_mp.runtime.topology import Role
    from dflash_mp.training.trainer import DrafterTrainer

    log = setup_rank_logging(run_dir, job.rank, job.role.value, console=job.is_first_drafter)
    if job.rank == 0:
        roles = (
            f"{job.world_size} colocated rank(s), each running the target and training"
            if job.topology.colocated
            else f"{job.topology.targets} target(s) + {job.topology.drafters} drafter(s)"
            + (
                f" (targets: {job.topology.replicas} replica(s) of {job.topology.target_parallel} ranks)"
                if job.topology.target_parallel > 1
                else ""
            )
        )
        append_job_log(run_dir, f"started: world {job.world_size} = {roles} on {job.device.type}")
        # Written at a fresh start (with train.gamma and model.mask_token_id resolved, and the run's
        # tokenizer beside it); a resume keeps it and records what it changed next to it.
        from dflash_mp.config.mask_token import save_run_tokenizer
        from dflash_mp.config.schema import run_config

        resolved = OmegaConf.to_container(run_config(cfg), resolve=True)
        changes = record_config(run_dir, resolved, cfg.train.resume)
        save_run_tokenizer(cfg.model, run_dir / "tokenizer")  # once; with the mask token when added
        if changes:
            listed = "; ".join(f"{key}: {c['old']!r} -> {c['new']!r}" for key, c in changes.items())
            append_job_log(
                run_dir,
                f"resumed with a config that differs from config.yaml ({listed}): see {CONFIG_HISTORY_NAME}",
            )
    log.info("role %s on %s, run_dir %s", job.role.value, job.device, run_dir)

    index = open_records(list(cfg.data.train_files))
    steps = total_steps(cfg, len(index), job.topology)
    # Taken once: checkpoints record the data as this job found it.
    layout_at = functools.partial(
        data_layout, cfg, job.topology, data_files_fingerprint(index.paths, len(index))
    )
    first_drafter = job.topology.targets
    state = None
    if job.is_first_drafter:
        start_step, state = resume_step(cfg, run_dir, layout_at, steps)
    start_step = broadcast_int(start_step if job.is_first_drafter else 0, first_drafter, job.meta_group)
    watchdog.beat("load", start_step)
    dtype, _, compile_layers = resolve_precision(cfg, job.device)

    if job.role is Role.TARGET:
        reader = make_reader(cfg, index)
        from dflash_mp.runtime.target_parallel import replica_mesh

        mesh = replica_mesh(job.replica_group, job.device)
        extractor = make_feature_extractor(cfg, dtype, job.device, compile_layers, mesh=mesh)
        run_target(cfg, job, start_step, steps, reader, extractor, dtype)
        return

    run = run_drafter
    if job.role is Role.COLOCATED:
        from dflash_mp.runtime.colocated import run_colocated

        run = functools.partial(
            run_colocated,
            reader=make_reader(cfg, index),
            extractor=make_feature_extractor(cfg, dtype, job.device, compile_layers),
            dtype=dtype,
        )
    trainer = DrafterTrainer(
        cfg, job.device, steps, group=job.drafter_group, stop_requested=watchdog.stop_requested
    )
    if start_step > 0:
        trainer.load_training_state(state if state is not None else load_resume_state(run_dir, start_step))
    metrics = evaluator = None
    if job.is_first_drafter and cfg.eval.every > 0:
        from dflash_mp.evaluation.acceptance import AcceptanceEvaluator

        # Loads the whole target beside the drafter (on CUDA it refuses one that cannot fit).
        evaluator = AcceptanceEvaluator(cfg, job.device)
    if job.is_first_drafter:
        from dflash_mp.config.schema import run_config

        # wandb gets what config.yaml records: train.gamma and model.mask_token_id resolved.
        resolved = OmegaConf.to_container(run_config(cfg), resolve=True)
        metrics = MetricsLogger(run_dir, steps, start_step, cfg.logger, resolved)
        log.info("training %d steps from step %d (attention: %s)", steps, start_step, trainer.attention)
        if trainer.working is not None:
            copies = sum(param.numel() for param in trainer.working.master_of)
            log.info("drafter: %.0fM matmul weights as bf16 copies of fp32 masters", copies / 1e6)

    def checkpoint_due(step: int) -> bool:
        every = cfg.train.checkpoint_every
        return bool(every and step % every == 0) or step == steps

    def save_checkpoint() -> None:
        watchdog.beat("checkpoint", trainer.step)
        checkpoint.save(
            run_dir / "checkpoints",
            trainer.training_state(),
            cfg.train.keep_checkpoints,
            data_layout=layout_at(trainer.step),
        )

    tally = StepTally()  # every drafter alike: they agree on which steps are skipped

    def on_step(record: dict) -> None:
        tally.add(record)
        if metrics is None:
            return
        if evaluator is not None and (record["step"] % cfg.eval.every == 0 or record["step"] == steps):
            watchdog.beat("eval", trainer.step)
            with trainer.full_precision_weights():
                record["tau"] = evaluator(trainer.drafter)["tau"]
            trainer.restart_step_clock()  # evaluation time is not training throughput
        metrics.log(record)
        if checkpoint_due(record["step"]):
            save_checkpoint()

    try:
        run(cfg, job, trainer, start_step, steps, on_step)
    except watchdog.Preempted:
        if metrics is not None:  # the first drafter saves for all: DDP keeps their weights equal
            if not checkpoint_due(trainer.step):
                save_checkpoint()
            metrics.close()
            watchdog.mark_preempted(run_dir, trainer.step)
        if job.drafter_group is not None and job.topology.drafters > 1:
            import torch.distributed as dist

            dist.barrier(group=job.drafter_group)  # no drafter leaves before the checkpoint is on disk
        raise
    if metrics is not None:
        metrics.close()
    tally.require_training()  # a job that applied no update must not end as done
    if metrics is not None:
        from dflash_mp.run.plots import plot_run

        plot_run(run_dir)
        if cfg.train.export:
            watchdog.beat("export", trainer.step)
            from dflash_mp.export.hf import export_drafter

            path = export_drafter(trainer.drafter, run_dir / "export")
            log.info("exported the drafter to %s", path)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> int:
    from dflash_mp.runtime.distributed import under_torchrun

    if under_torchrun():
        from torch.distributed.elastic.multiprocessing.errors import record

        # @record inside Hydra's handler: Hydra turns exceptions into exit(1), so the rank's
        # traceback must reach torchrun's error file before that.
        record(run_rank)(dict_cfg)
        return 0
    from dflash_mp.launch.sweep import launch_from_hydra

    return launch_from_hydra(dict_cfg)


if __name__ == "__main__":
    main()
