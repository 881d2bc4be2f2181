"""What a rank does in a training job, in the order it does it: `run_job`.

- set up: the rank's log; on rank 0 the job's start in job.log, config.yaml (or what a resume
  changed beside it) and the run's tokenizer;
- resume: the first drafter picks the checkpoint, every rank starts at its step (`resume.py`);
- run the role: a target rank produces features (`roles.py`); a drafter or colocated rank trains
  (`roles.py`, `colocated.py`), and after each optimizer step the first drafter evaluates, logs
  and checkpoints for all (`RunRecorder`);
- finish: the first drafter draws the curves (`run/plots.py`) and exports (`export/`).

Setting up the process groups and leaving them is the entry point's (`dflash_mp.train`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dflash_mp.config.mask_token import save_run_tokenizer
from dflash_mp.config.precision import resolve_precision
from dflash_mp.config.schema import RootConfig, run_config
from dflash_mp.data import Records, open_records
from dflash_mp.evaluation.evaluator import AcceptanceEvaluator
from dflash_mp.run import checkpoint
from dflash_mp.run.logs import append_job_log, get_logger, setup_rank_logging
from dflash_mp.run.metrics import MetricsLogger, StepTally
from dflash_mp.run.plots import plot_run
from dflash_mp.run.rundir import CONFIG_HISTORY_NAME, record_config
from dflash_mp.runtime import watchdog
from dflash_mp.runtime.colocated import run_colocated
from dflash_mp.runtime.distributed import Job
from dflash_mp.runtime.resume import agree_on_start, job_data_layout, load_resume_state
from dflash_mp.runtime.roles import (
    data_order,
    make_feature_extractor,
    make_reader,
    run_drafter,
    run_target,
    total_steps,
)
from dflash_mp.runtime.target_parallel import replica_mesh
from dflash_mp.runtime.topology import Role
from dflash_mp.training.trainer import DrafterTrainer, NonFiniteStep


def run_job(cfg: RootConfig, job: Job, run_dir: Path) -> None:
    """This rank's part of the training job, from its log file to the export."""
    log = setup_rank_logging(run_dir, job.rank, job.role.value, console=job.is_first_drafter)
    if job.rank == 0:
        record_start(cfg, job, run_dir)
    log.info("role %s on %s, run_dir %s", job.role.value, job.device, run_dir)

    records = open_records(list(cfg.data.train_files))
    order = data_order(cfg, records)
    steps = total_steps(cfg, order, job.topology)
    layout_at = job_data_layout(cfg, job.topology, records)
    start_step, state = agree_on_start(cfg, job, run_dir, layout_at, steps)
    watchdog.beat("load", start_step)
    dtype, _, compile_layers = resolve_precision(cfg, job.device)

    if job.role is Role.TARGET:
        reader = make_reader(cfg, records, order)
        mesh = replica_mesh(job.replica_group, job.device)
        extractor = make_feature_extractor(cfg, dtype, job.device, compile_layers, mesh=mesh)
        run_target(cfg, job, start_step, steps, reader, extractor, dtype)
        return

    run_role = drafter_role(cfg, job, records, order, dtype, compile_layers)
    trainer = DrafterTrainer(
        cfg, job.device, steps, group=job.drafter_group, stop_requested=watchdog.stop_requested
    )
    if start_step > 0:
        trainer.load_training_state(state if state is not None else load_resume_state(run_dir, start_step))
    recorder = None
    if job.is_first_drafter:
        recorder = RunRecorder(cfg, run_dir, trainer, steps, start_step, layout_at)
        log.info("training %d steps from step %d (attention: %s)", steps, start_step, trainer.attention)
        if trainer.working is not None:
            copies = sum(param.numel() for param in trainer.working.master_of)
            log.info("drafter: %.0fM matmul weights as bf16 copies of fp32 masters", copies / 1e6)
    train(cfg, job, trainer, start_step, steps, run_role, recorder)
    if job.device.type == "cuda":  # every drafter's own high-water mark, in its log
        log.info("peak GPU memory %.1f GiB", torch.cuda.max_memory_allocated(job.device) / 2**30)
    if recorder is not None:
        finish(cfg, run_dir, trainer)


def record_start(cfg: RootConfig, job: Job, run_dir: Path) -> None:
    """Rank 0's record of the start: a job.log line, config.yaml with the run's tokenizer beside it
    (a fresh start), or what a resume changed, beside config.yaml and in job.log."""
    topology = job.topology
    if topology.colocated:
        roles = f"{job.world_size} colocated rank(s), each running the target and training"
    else:
        roles = f"{topology.targets} target(s) + {topology.drafters} drafter(s)"
        if topology.target_parallel > 1:
            roles += f" (targets: {topology.replicas} replica(s) of {topology.target_parallel} ranks)"
    append_job_log(run_dir, f"started: world {job.world_size} = {roles} on {job.device.type}")
    changes = record_config(run_dir, resolved_config(cfg), cfg.train.resume)
    save_run_tokenizer(cfg.model, run_dir / "tokenizer")  # once; with the mask token when added
    if changes:
        listed = "; ".join(f"{key}: {c['old']!r} -> {c['new']!r}" for key, c in changes.items())
        append_job_log(
            run_dir,
            f"resumed with a config that differs from config.yaml ({listed}): see {CONFIG_HISTORY_NAME}",
        )


def resolved_config(cfg: RootConfig) -> dict:
    """What config.yaml records and wandb gets: train.gamma and model.mask_token_id resolved."""
    return OmegaConf.to_container(run_config(cfg), resolve=True)  # type: ignore[return-value]


def drafter_role(
    cfg: RootConfig, job: Job, records: Records, order, dtype: torch.dtype, compile_layers: bool
) -> Callable[..., None]:
    """The training loop of this rank: a drafter's (receive, train), or a colocated rank's, which
    reads its own micro-batches and runs the target on them first."""
    if job.role is not Role.COLOCATED:
        return run_drafter
    return functools.partial(
        run_colocated,
        reader=make_reader(cfg, records, order),
        extractor=make_feature_extractor(cfg, dtype, job.device, compile_layers),
        dtype=dtype,
    )


def train(
    cfg: RootConfig,
    job: Job,
    trainer: DrafterTrainer,
    start_step: int,
    steps: int,
    run_role: Callable[..., None],
    recorder: RunRecorder | None,
) -> None:
    """Run the role's loop to the last step, or to an agreed stop (preemption: checkpoint first)."""
    tally = StepTally()  # every drafter alike: they agree on which steps are skipped

    def on_step(record: dict) -> None:
        tally.add(record)
        if recorder is not None:
            recorder.record(record)

    try:
        run_role(cfg, job, trainer, start_step, steps, on_step)
    except NonFiniteStep as stop:  # the step that ends the job has its line in metrics.jsonl too
        if recorder is not None:
            recorder.metrics.log(stop.record)
        raise
    except watchdog.Preempted:
        if recorder is not None:
            recorder.preempted()
        if job.drafter_group is not None and job.topology.drafters > 1:
            dist.barrier(group=job.drafter_group)  # no drafter leaves before the checkpoint is on disk
        raise
    if recorder is not None:
        recorder.close()
    tally.require_training()  # a job that applied no update must not end as done


def finish(cfg: RootConfig, run_dir: Path, trainer: DrafterTrainer) -> None:
    """The first drafter's last work: the training curves (logger.plots), then the export (train.export)."""
    if cfg.logger.plots:
        plot_run(run_dir)
    if cfg.train.export:
        watchdog.beat("export", trainer.step)
        from dflash_mp.export.hf import export_drafter  # transformers' modeling stack: only when exporting
        from dflash_mp.export.speculators_format import target_verifier

        dspark = trainer.drafter.arch == "dspark"  # speculators' format names the target
        verifier = target_verifier(cfg.model.target_path) if dspark else None
        path = export_drafter(trainer.drafter, run_dir / "export", verifier=verifier)
        get_logger().info("exported the drafter to %s", path)


class RunRecorder:
    """What the first drafter keeps of each optimizer step, for every drafter (DDP keeps their
    weights equal): metrics.jsonl, tau where an evaluation is due, checkpoints where one is due."""

    def __init__(
        self,
        cfg: RootConfig,
        run_dir: Path,
        trainer: DrafterTrainer,
        steps: int,
        start_step: int,
        layout_at: Callable[[int], dict],
    ) -> None:
        self.cfg, self.run_dir, self.trainer, self.steps, self.layout_at = (
            cfg,
            run_dir,
            trainer,
            steps,
            layout_at,
        )
        # Loads the whole target beside the drafter (on CUDA it refuses one that cannot fit).
        self.evaluator = AcceptanceEvaluator(cfg, trainer.device) if cfg.eval.every > 0 else None
        self.metrics = MetricsLogger(run_dir, steps, start_step, cfg.logger, resolved_config(cfg))

    def record(self, record: dict) -> None:
        """After optimizer step record["step"]: evaluate if due, log the record, checkpoint if due."""
        step = record["step"]
        if self.evaluator is not None and (step % self.cfg.eval.every == 0 or step == self.steps):
            watchdog.beat("eval", self.trainer.step)
            with self.trainer.full_precision_weights():
                measured = self.evaluator.measure(self.trainer.drafter)  # tau, tau/<name> per benchmark
            record.update(measured)
            get_logger().info(eval_line(step, measured, self.evaluator.acceptance_rate))
            self.trainer.restart_step_clock()  # evaluation time is not training throughput
        self.metrics.log(record)
        if self.checkpoint_due(step):
            self.save_checkpoint()

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return bool(every and step % every == 0) or step == self.steps

    def save_checkpoint(self) -> None:
        watchdog.beat("checkpoint", self.trainer.step)
        checkpoint.save(
            self.run_dir / "checkpoints",
            self.trainer.training_state(),
            self.cfg.train.keep_checkpoints,
            data_layout=self.layout_at(self.trainer.step),
        )

    def preempted(self) -> None:
        """The job stops at this step boundary: checkpoint it (unless just done) and say so."""
        if not self.checkpoint_due(self.trainer.step):
            self.save_checkpoint()
        self.metrics.close()
        watchdog.mark_preempted(self.run_dir, self.trainer.step)

    def close(self) -> None:
        self.metrics.close()


def eval_line(step: int, measured: dict[str, float], acceptance_rate: list[float]) -> str:
    """The console's (and job.log's) line of an evaluation during training."""
    parts = [f"tau {measured['tau']:.3f} on the held-out prompts"] if "tau" in measured else []
    parts += [f"{name} {value:.3f}" for name, value in measured.items() if name != "tau"]
    line = f"eval at step {step}: {', '.join(parts) or 'nothing measured'}"
    if acceptance_rate:
        line += "; acceptance by block position " + " ".join(f"{rate:.2f}" for rate in acceptance_rate)
    return line
