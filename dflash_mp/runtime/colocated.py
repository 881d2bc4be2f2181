"""The colocated layout (topology.layout=colocated): one process per GPU reads its own
micro-batches, runs the target on them and trains the drafter on the result; DDP over all ranks.

Rank d trains on the micro-batches drafter d trains on in the split layout
(Topology.micro_batches_of_drafter) and feeds the drafter what a target rank would have sent
(`features_of`, the reference trainer's path), so a colocated job of N ranks trains as the split
with N drafter ranks: the same loss column, bit for bit on CPU. As a drafter rank does, it
takes the next step's first micro-batch (here: reads and tokenizes it, runs the target on it) while
the device runs the optimizer update, so the host's work at a step's start is not the device's wait.
"""

from __future__ import annotations

import functools

import torch

from dflash_mp.config.schema import RootConfig
from dflash_mp.data import MicroBatch, MicroBatchReader
from dflash_mp.run.logs import get_logger
from dflash_mp.runtime.clock import RoleClock
from dflash_mp.runtime.distributed import Job
from dflash_mp.runtime.roles import hidden_states_for_drafter
from dflash_mp.runtime.watchdog import Preempted, beat
from dflash_mp.training.features import Features, features_of
from dflash_mp.training.trainer import PreparedBatch


def run_colocated(
    cfg: RootConfig,
    job: Job,
    trainer,
    start_step: int,
    steps: int,
    on_step,
    reader: MicroBatchReader,
    extractor,
    dtype: torch.dtype,
) -> None:
    """Read, run the target, train, report: `on_step(record)` runs after every optimizer step, as
    for a drafter rank of the split layout; stop requests are agreed on the same way."""
    log = get_logger()
    topology = job.topology
    target_clock, drafter_clock = RoleClock(job.device), RoleClock(job.device)
    bad_before, too_long_before = reader.bad_records, reader.too_long_records
    log.info(
        "colocated: training on micro-batches %d..%d of every %d, steps %d..%d",
        job.drafter_index * cfg.train.grad_accum,
        (job.drafter_index + 1) * cfg.train.grad_accum - 1,
        topology.micro_batches_per_step,
        start_step,
        steps,
    )

    def micro_batch(m: int) -> Features:
        """Micro-batch m read, through the target, as a drafter rank of the split receives it."""
        nonlocal bad_before, too_long_before
        beat("tokenize", trainer.step)
        with target_clock.busy():
            batch = reader.read(m)
        bad, bad_before = reader.bad_records - bad_before, reader.bad_records
        too_long, too_long_before = reader.too_long_records - too_long_before, reader.too_long_records
        beat("forward", trainer.step)
        with target_clock.busy():
            return through_target(batch, extractor, dtype, job.device, bad, too_long)

    # The next step's first micro-batch is read (tokenized on the host), run through the target
    # and prepared while the device runs the update, as a drafter rank of the split receives it.
    early: list[PreparedBatch] = []

    def read_early(next_step: int) -> None:
        with drafter_clock.paused():
            features = micro_batch(topology.micro_batches_of_drafter(job.drafter_index, next_step)[0])
        early.append(trainer.prepare(features))

    for step in range(start_step, steps):
        mine = topology.micro_batches_of_drafter(job.drafter_index, step)
        for m in mine:
            batch = early.pop() if early else micro_batch(m)
            beat("compute", trainer.step)
            with drafter_clock.busy():
                trainer.micro_step(batch, last_of_step=m == mine[-1])
        beat("optimizer", trainer.step)
        with drafter_clock.busy():
            record = trainer.optimizer_step(
                while_waiting=functools.partial(read_early, step + 1) if step + 1 < steps else None
            )
        record.update(time_split(target_clock, drafter_clock))
        on_step(record)
        if trainer.step < steps and trainer.stop_agreed:
            raise Preempted(trainer.step)
    log.info(
        "done after step %d: target side %.1fs, drafter side %.1fs, %d bad records",
        trainer.step,
        target_clock.busy_s,
        drafter_clock.busy_s,
        reader.bad_records,
    )


def through_target(
    batch: MicroBatch, extractor, dtype: torch.dtype, device: torch.device, bad: int = 0, too_long: int = 0
) -> Features:
    """A micro-batch read on the host, through the target on `device`, as a drafter rank receives it.
    Nothing here waits for the device: this runs while the update is queued (`MicroBatch.to`)."""
    batch = batch.to(device)
    return features_of(batch, hidden_states_for_drafter(extractor, batch, dtype, device), bad, too_long)


def time_split(target_clock: RoleClock, drafter_clock: RoleClock) -> dict[str, float]:
    """Which side this rank spent its work time on since it started (reading and the target
    forward vs the drafter's steps): no role waits on another here, so the split layout's
    busy/wait fractions have no meaning; this says what a step costs on each side."""
    target, drafter = target_clock.busy_s, drafter_clock.busy_s
    total = max(target + drafter, 1e-9)
    return {"target_time_frac": target / total, "drafter_time_frac": drafter / total}
